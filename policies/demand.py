"""How often each cached prefix is asked for: when one needs more copies than it has (pure).

A prefix that arrives faster than its holders can serve it needs another copy, whatever the
momentary queues say: in the hot-prefix benchmark at three slots per replica the gateway sent a
new 4,000-word document to its first holder for as long as that holder's queue was shorter
than the document's prefill elsewhere, and the backlog it built there in those two seconds
lasted the whole run (TTFT p50 1.0 s against round robin's 0.7 s).

Algorithm:

* A prefix is named by the hash of its last block (the chain property: that hash names the whole
  prefix).  ``cache_aware`` names the longest prefix any replica holds of the request, so each
  turn of a conversation is a prefix of its own (asked for once) while a shared document or
  system prompt is one prefix asked for by every request that carries it.
* ``record(key, now)`` keeps the last ``depth`` arrival times per prefix, for at most
  ``max_keys`` prefixes (the least recently asked for go first).
* ``rate(key, now, span_s)``: arrivals per second over the recorded ones, ``n / max(now -
  oldest, span_s)``; 0 with fewer than ``min_arrivals`` recorded (a prefix asked for twice
  proves nothing).
* ``needs_copy(key, now, holders, service_s, slots, util)``: the prefix's rate (over at least
  ``service_s``) times the time a request holds a slot is the number of its requests in flight
  (Little's law; a burst of n counts as n); it needs another copy when that exceeds ``holders x
  slots x util``.

How ``cache_aware`` uses it: the longest prefix any replica holds of the request is asked for at
some rate; times a request's slot time (its decode prior) that is the slots it keeps busy.  When
that exceeds ``replicate_util`` x its holders' slots (``max_running`` each), the holders are set
aside for this request (unless every replica holds it, or every one that does not is over the
bound), the bound is the tight one, and neither recomputing nor evicting is priced: the copy is
needed, and made now, while slots elsewhere are free, not once the holder's queue is longer than
a cold prefill (in the hot-prefix benchmark at 3 slots that backlog lasted the run: TTFT p50 1.4x
round robin's; then ~1.05x).  A conversation's turns are each a prefix of their own, asked for
once: never copied.

With ``warm_copies`` no client makes the copy: the request that shows the demand is ranked again
as if none were needed (it stays with a holder, unless leaving pays anyway: then it is the copy,
as without the flag), and its decision carries ``warm`` (``warm_decision``: the copy's replica,
reason ``warm-copy``, no alternates).  The gateway sends the prompt there with one output token
(``gateway.warms``) and reports it as a dispatch, so the next decisions see the copy being
computed (a follower may hold for it) and count its replica as a holder.  A copy that pulls the
prefix from a holder (``migrate``) is a warm too, carrying the pull: no client waits for the
transfer either.

A conversation's next turn is warmed too (``warm_turns``; ``turn_decision``): once a turn is
answered, the gateway asks ``CacheAware.warm_turn`` with the prompt and its answer, and prefills
it on the replica that served the turn while half its slots stay free (``gateway.turns``).
"""

from __future__ import annotations

from collections import deque

from .types import Decision, RequestFeatures


def warm_decision(copy: Decision) -> Decision:
    """The prefill-only request that makes the copy ``copy`` chose (pulling the prefix from a
    holder where that decision pulls): no alternates (a warm that fails is not retried
    elsewhere), and no demand of its own (``top_blocks`` 0)."""
    scores = dict(copy.scores)
    scores["top_blocks"] = 0.0
    scores["hold_ms"] = 0.0
    return Decision(replica=copy.replica, reason="warm-copy",
                    predicted_cached_tokens=copy.predicted_cached_tokens, scores=scores,
                    pull_from=copy.pull_from, pull_tokens=copy.pull_tokens)


def turn_decision(replica: str, matched_blocks: int, req: RequestFeatures,
                  prefill_ms_per_token: float) -> Decision:  # fmt: skip
    """The prefill of a conversation's next turn (``req``: the prompt with the answer appended)
    on ``replica``, which served the turn and holds ``matched_blocks`` of it: a warm of its own,
    no alternates, no demand."""
    cached = min(matched_blocks * req.tokens_per_hash, req.prompt_tokens)
    scores = {"ttft_ms": (req.prompt_tokens - cached) * prefill_ms_per_token, "top_blocks": 0.0,
              "matched_blocks": float(matched_blocks), "hold_ms": 0.0}
    return Decision(replica=replica, reason="warm-turn", predicted_cached_tokens=cached,
                    scores=scores)


class PrefixDemand:
    __slots__ = ("_arrivals", "_depth", "_max_keys", "_min")

    def __init__(self, depth: int = 16, max_keys: int = 4096, min_arrivals: int = 4) -> None:
        if depth < 2 or max_keys < 1 or not 2 <= min_arrivals <= depth:
            raise ValueError("need depth >= 2, max_keys >= 1, 2 <= min_arrivals <= depth")
        self._arrivals: dict[int, deque[float]] = {}
        self._depth = depth
        self._max_keys = max_keys
        self._min = min_arrivals

    def record(self, key: int, now: float) -> None:
        times = self._arrivals.pop(key, None)  # re-inserted last: dict order is recency
        if times is None:
            times = deque(maxlen=self._depth)
            if len(self._arrivals) >= self._max_keys:
                del self._arrivals[next(iter(self._arrivals))]
        times.append(now)
        self._arrivals[key] = times

    def rate(self, key: int, now: float, span_s: float = 1e-3) -> float:
        """Arrivals per second, over at least ``span_s`` (0 with too few recorded)."""
        times = self._arrivals.get(key)
        if times is None or len(times) < self._min:
            return 0.0
        return len(times) / max(now - times[0], span_s)

    def needs_copy(self, key: int, now: float, holders: int, service_s: float, slots: int,
                   util: float) -> bool:  # fmt: skip
        """Whether the prefix's requests would fill more than ``util`` of its holders' slots:
        its rate (over at least one ``service_s``, so a burst counts as the requests it is, not
        as a rate) times ``service_s`` against ``holders`` x ``slots`` x ``util``."""
        busy = self.rate(key, now, service_s) * service_s  # requests it keeps in flight
        return busy > holders * slots * util

    def __len__(self) -> int:
        return len(self._arrivals)
