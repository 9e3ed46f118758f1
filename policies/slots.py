"""When each request a gateway sent to a replica is predicted to free its slot (pure).

The ``cache_aware`` queue model needs to know how long a new request waits for a slot on a replica
that already runs ``max_running`` requests.  An average (a slot frees every ``service /
max_running``) is right only when the running requests started evenly spread; after a burst
they all end together, late, and a newcomer waits nearly a whole service time.  The gateway
knows better: it sent those requests, so it knows when each started, how long its prefill was
predicted to take and how many tokens it asked for.

Algorithm: ``start(replica, token, end_at)`` records a request's predicted end (``token`` names
it until ``end(token)``, wherever it ended up).  ``wait_s(replica, ahead, now, slot_s)``: a new
request with ``ahead`` requests in front of it for a slot (the queue it joins, plus itself)
starts when the ``ahead``-th earliest of those ends comes.  A request past its predicted end (a
longer answer than predicted, a stalled engine) is taken to end one ``slot_s`` from now:
counting it as ending at once would call a replica with a hung request free.  Requests beyond
those recorded (another gateway's, or the engine's own count being higher) free a slot every
``slot_s`` after the last recorded one.  At most ``per_replica`` requests are kept per replica
(the earliest ends go first): a replica with more in flight than that is past any estimate.
"""

from __future__ import annotations

import heapq


class SlotTimeline:
    __slots__ = ("_ends", "_where", "_per_replica")

    def __init__(self, per_replica: int = 1024) -> None:
        self._ends: dict[str, dict[int, float]] = {}
        self._where: dict[int, str] = {}
        self._per_replica = per_replica

    def start(self, replica: str, token: int, end_at: float) -> None:
        ends = self._ends.get(replica)
        if ends is None:
            ends = self._ends[replica] = {}
        if len(ends) >= self._per_replica:
            oldest = min(ends, key=ends.__getitem__)
            del ends[oldest]
            self._where.pop(oldest, None)
        self.end(token)
        ends[token] = end_at
        self._where[token] = replica

    def end(self, token: int) -> None:
        replica = self._where.pop(token, None)
        if replica is not None:
            self._ends[replica].pop(token, None)

    def wait_s(self, replica: str, ahead: int, now: float, slot_s: float) -> float:
        """Seconds until ``ahead`` slots have freed on ``replica``."""
        if ahead <= 0:
            return 0.0
        ends = self._ends.get(replica)
        if not ends:
            return ahead * slot_s
        late = now + slot_s  # an overdue request ends "soon": about one slot's share from now
        due = [e if e > now else late for e in ends.values()]
        if ahead <= len(due):
            return heapq.nsmallest(ahead, due)[-1] - now
        return max(due) - now + (ahead - len(due)) * slot_s

    def __len__(self) -> int:
        return sum(len(v) for v in self._ends.values())
