"""Prefills in flight: which replica is still computing which part of which prefix.

The ``PrefixIndex`` records a dispatched chain at once, so a request that follows another with the
same new prefix by less than its prefill time is predicted to hit blocks that do not exist yet.
Engines do not share a prefill in progress (vLLM caches a block once it is computed; the
simulator likewise), so the follower recomputes them: it is as cold there as anywhere.

Algorithm (pure, per policy instance, not shared between gateways):

* ``start(replica, hashes, first, ready_at)``: ``replica`` computes blocks ``first..`` of the chain
  ``hashes`` until ``ready_at``.  Stored as (ready_at, first, hashes[first]): by the chain property
  an equal hash at position ``first`` means the same prefix.  Each replica keeps its ``per_replica``
  most recent entries (a replica with more prefills in flight than that is saturated anyway).
* ``cuts(hashes, matched, now)``: for each replica in ``matched`` (replica -> the leading blocks
  the index says it holds), how many of those exist now: the smallest ``first`` of a live entry
  whose block hash is the request's at that position; only the replicas where part of the
  match is still being computed are returned (usually none).  One tuple compare per entry --
  none when the match ends before every entry's ``first`` (a shared system prompt matched on
  every replica, while each computes its own conversations): each replica keeps the least
  ``first`` of its entries.
* ``until(replica, hashes, matched, now)``: when all ``matched`` blocks will exist there (the
  latest ``ready_at`` of the live entries in them; ``now`` if none): how long a follower would
  wait to find the whole prefix instead of recomputing it.
* ``finish(replica, hashes)``: the request with chain ``hashes`` got its first token there, so the
  entries it (or an earlier request with the same prefix) started are done, whatever was predicted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class Warming:
    __slots__ = ("_live", "_lo", "_per_replica")

    def __init__(self, per_replica: int = 32) -> None:
        self._live: dict[str, deque[tuple[float, int, int]]] = {}
        self._lo: dict[str, int] = {}  # per replica, at most the least ``first`` of its entries
        self._per_replica = per_replica

    def start(self, replica: str, hashes: Sequence[int], first: int, ready_at: float) -> None:
        if first >= len(hashes):
            return
        live = self._live.get(replica)
        if live is None:
            live = self._live[replica] = deque(maxlen=self._per_replica)
        live.append((ready_at, first, hashes[first]))
        self._lo[replica] = min(first, self._lo.get(replica, first))

    def cuts(self, hashes: Sequence[int], matched: dict[str, int], now: float) -> dict[str, int]:
        """Replica -> blocks of its match that exist now, for the replicas in ``matched``
        (replica -> matched blocks) with part of their match still being computed."""
        out: dict[str, int] = {}
        lo = self._lo
        for replica, live in self._live.items():
            m = matched.get(replica)
            if m and live and m > lo[replica]:
                k = _ready(live, hashes, m, now)
                if k < m:
                    out[replica] = k
        return out

    def until(self, replica: str, hashes: Sequence[int], matched: int, now: float) -> float:
        """When the ``matched`` leading blocks will all exist on ``replica`` (``now`` if they do)."""
        out = now
        for ready_at, first, h in self._live.get(replica, ()):
            if first < matched and ready_at > out and hashes[first] == h:
                out = ready_at
        return out

    def finish(self, replica: str, hashes: Sequence[int]) -> None:
        """The prefill of ``hashes`` on ``replica`` is done (its first token came back)."""
        live = self._live.get(replica)
        if not live:
            return
        n = len(hashes)
        done = [e for e in live if e[1] < n and hashes[e[1]] == e[2]]
        for e in done:
            live.remove(e)
        if done:
            self._lo[replica] = min([e[1] for e in live], default=0)

    def __len__(self) -> int:
        return sum(len(v) for v in self._live.values())


def _ready(live: deque[tuple[float, int, int]], hashes: Sequence[int], matched: int,
           now: float) -> int:  # fmt: skip
    """The least ``first`` of the live entries that are the chain's blocks below ``matched``."""
    out = matched
    for ready_at, first, h in live:
        if first < out and ready_at > now and hashes[first] == h:
            out = first
    return out
