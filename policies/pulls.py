"""What pulling a prefix from a peer costs, for ``cache_aware``'s migration (the rule is below):
which replicas may pull and from which holder, the transfer priced by the link, plus what pulls
were seen to take beyond their predicted time to first token (the receiver asking the holder
first, on a busy link: in the multi-turn benchmark at 3 slots a median 8 ms, and a pull saving
less than that raised the TTFT p50).

Who can pull (``migrate``): ``auto`` (the default) only replicas whose engines advertise it
(``ReplicaState.pull_ms_per_token`` >= 0, scraped from ``kvgate:kv_pull_info``), each priced at
the slower end of its link with the holder; ``true`` every replica, priced as advertised or,
where nothing is, by ``transfer_ms_per_token``; ``false`` none.

The rule (``cache_aware``'s ranking).  Let ``top = max_r hit(r)``, held by ``h`` (the least
loaded of the replicas holding it that can serve a pull).  A replica r that can pull, with
``top - hit(r) >= migrate_min_tokens``, can pull the difference from h instead of recomputing
it::

    pull_ms(r) = transfer_overhead_ms + (top - hit(r)) * max(link(r), link(h))

and when ``pull_ms(r) < (top - hit(r)) * prefill_ms_per_token`` r (if within the load bound)
gets a second score, ``ttft_pull(r) = queue_ms(r) + (P - top) * prefill_ms_per_token +
pull_ms(r)`` (plus the ranking's penalty, as every score: the recompute of ``P - top`` and
the blocks the copy pushes out of r's cache, priced by ``evict_weight``).  If ``min ttft_pull``
is below every plain score (over the bound excluded) and either ``min ttft_pull + tie_ms +
pull_margin_ms`` is below the scores of the replicas holding ``top`` or a replica without it
wins by more than ``tie_ms`` anyway (a move without the pull copies as much into the
receiver's cache and computes the rest), the pick is made among the pull scores within
``tie_ms`` of their minimum, else exactly as without migration.  ``pull_margin_ms`` (0 by
default) is what a copy must save beyond that price: before the eviction was priced, a margin
of 100 ms kept prefixes from spreading to every replica (18 points of hit rate in the
shared-prefix benchmark); priced, a margin of 0 loses about a point of hits there and cuts
TTFT p50 and p99 by 40-50% at a load that queues (3 slots, two rounds against 100 ms).  So when
h's queue exceeds about ``pull_ms`` (long before it exceeds a full recompute) a cheap-transfer
replica takes the request at about h's hit; the decision then carries ``pull_from = h`` and
``pull_tokens = top - hit(r)`` (the gateway passes them on as ``kv_transfer_params``) and
predicts ``top`` cached tokens.  What pulls really take
beyond their prediction is learned and added to ``transfer_overhead_ms`` (below).
"""

from __future__ import annotations

from .cache_aware_scores import MIGRATE_ALL, MIGRATE_AUTO, CacheAwareParams, migrate_mode
from .types import Outcome

_MAX_PULLING = 4096  # pulls in flight tracked for learning their cost (more are not learned from)
_CLIP_MS = 50.0  # a residual beyond this is a mispredicted queue, not the pull's cost


class PullCost:
    """The holder to pull from and the price of a pull, learning the price's overhead."""

    __slots__ = ("_p", "_mode", "_extra_ms", "_pulling")

    def __init__(self, params: CacheAwareParams) -> None:
        self._p = params
        self._mode = migrate_mode(params.migrate)
        self._extra_ms = 0.0  # EWMA: what a pull took beyond its predicted TTFT
        self._pulling: dict[int, float] = {}  # a pull's key -> its predicted TTFT, while it runs

    def links(self, replicas: list) -> list[float]:
        """Each replica's pull cost in ms per token (below 0: it cannot pull or serve a pull)."""
        if self._mode == MIGRATE_AUTO:
            return [r.pull_ms_per_token for r in replicas]
        if self._mode == MIGRATE_ALL:
            default = self._p.transfer_ms_per_token
            return [r.pull_ms_per_token if r.pull_ms_per_token >= 0 else default for r in replicas]
        return []

    def holder(self, loads: list[int], hits: list[int], top: int, links: list[float]) -> int:
        """The index of the least loaded replica with the longest hit that can serve a pull,
        when migration is on and it matters; -1 when none."""
        if not links or top < self._p.migrate_min_tokens:
            return -1
        best = -1
        for i, h in enumerate(hits):
            if h == top and links[i] >= 0 and (best < 0 or loads[i] < loads[best]):
                best = i
        return best

    def price(self, missing: int, ms_per_token: float) -> tuple[int, float]:
        """(tokens to pull, transfer ms) for a replica ``missing`` tokens short of the holder
        over a link of ``ms_per_token``; (0, 0.0) when a pull would not beat recomputing them."""
        p = self._p
        if missing < p.migrate_min_tokens:
            return 0, 0.0
        ms = p.transfer_overhead_ms + self._extra_ms + missing * ms_per_token
        return (missing, ms) if ms < missing * p.prefill_ms_per_token else (0, 0.0)

    def started(self, key: int, predicted_ms: float) -> None:
        """A request that pulls was dispatched, its TTFT predicted at ``predicted_ms``."""
        if len(self._pulling) < _MAX_PULLING:
            self._pulling[key] = predicted_ms

    def ended(self, key: int, outcome: Outcome) -> None:
        """EWMA (``service_alpha``) of what a pull's TTFT took beyond its prediction (the
        receiver asking the holder first, its wait for the blocks), clipped to +-50 ms and never
        below 0; ``price`` adds it to ``transfer_overhead_ms``."""
        if not self._pulling:
            return
        predicted_ms = self._pulling.pop(key, None)
        if predicted_ms is None or not outcome.ok or outcome.ttft_s is None:
            return
        extra = min(max(outcome.ttft_s * 1000 - predicted_ms, -_CLIP_MS), _CLIP_MS)
        learned = self._extra_ms + self._p.service_alpha * (extra - self._extra_ms)
        self._extra_ms = max(0.0, learned)
