"""What pulling a prefix from a peer costs, for ``cache_aware``'s migration (see its header):
which replica to pull from, the transfer priced by the configured link, plus what pulls were
seen to take beyond their predicted time to first token (the receiver asking the holder first,
on a busy link: in the multi-turn benchmark at 3 slots a median 8 ms, and a pull saving less
than that raised the TTFT p50)."""

from __future__ import annotations

from .cache_aware_scores import CacheAwareParams
from .types import Outcome

_MAX_PULLING = 4096  # pulls in flight tracked for learning their cost (more are not learned from)
_CLIP_MS = 50.0  # a residual beyond this is a mispredicted queue, not the pull's cost


class PullCost:
    """The holder to pull from and the price of a pull, learning the price's overhead."""

    __slots__ = ("_p", "_extra_ms", "_pulling")

    def __init__(self, params: CacheAwareParams) -> None:
        self._p = params
        self._extra_ms = 0.0  # EWMA: what a pull took beyond its predicted TTFT
        self._pulling: dict[int, float] = {}  # a pull's key -> its predicted TTFT, while it runs

    def holder(self, ids: list[str], loads: list[int], hits: list[int], top: int) -> str | None:
        """The least loaded replica with the longest hit, when migration is on and it matters."""
        if not self._p.migrate or top < self._p.migrate_min_tokens:
            return None
        i = min((i for i, h in enumerate(hits) if h == top), key=loads.__getitem__)
        return ids[i]

    def price(self, missing: int) -> tuple[int, float]:
        """(tokens to pull, transfer ms) for a replica ``missing`` tokens short of the holder;
        (0, 0.0) when a pull would not beat recomputing them."""
        p = self._p
        if missing < p.migrate_min_tokens:
            return 0, 0.0
        ms = p.transfer_overhead_ms + self._extra_ms + missing * p.transfer_ms_per_token
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
