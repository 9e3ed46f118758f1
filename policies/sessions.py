"""SessionTable: session key -> replica id, with a TTL refreshed on use and a bounded size.

* Entries live in an ``OrderedDict`` in last-use order; every ``bind`` or ``get`` moves the entry to
  the end and sets its expiry to ``clock() + ttl_s``.  With a monotonic clock the head is therefore
  both the least recently used and the first to expire.
* Expired entries are invisible to ``get``/``peek`` at once and are deleted lazily (on ``get``, on
  ``bind`` -- which purges expired heads -- and by ``expire()``, for a background sweep).
* Size bound: ``max_sessions``; binding a new key beyond it evicts the least recently used.
* ``drop_replica`` uses a reverse map replica -> keys, so it costs O(sessions on that replica).
* ``peek`` never mutates: policies call it from ``select`` (which has no side effects) and bind
  from ``on_dispatch``.
* The clock is injected (monotonic seconds); tests pass a fake one.  Not thread-safe.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable


class SessionTable:
    def __init__(
        self,
        ttl_s: float = 1800.0,
        max_sessions: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._entries: OrderedDict[Hashable, tuple[str, float]] = OrderedDict()
        self._by_replica: dict[str, set[Hashable]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return self.peek(key) is not None

    def peek(self, key: Hashable) -> str | None:
        """The replica bound to ``key`` if the binding is live; changes nothing."""
        entry = self._entries.get(key)
        if entry is None or entry[1] <= self._clock():
            return None
        return entry[0]

    def get(self, key: Hashable) -> str | None:
        """Like ``peek``, but a live binding has its TTL refreshed; an expired one is deleted."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        now = self._clock()
        if entry[1] <= now:
            self._delete(key, entry[0])
            return None
        self._entries[key] = (entry[0], now + self.ttl_s)
        self._entries.move_to_end(key)
        return entry[0]

    def bind(self, key: Hashable, replica_id: str) -> None:
        """Bind (or re-bind) ``key`` to ``replica_id`` and refresh its TTL."""
        now = self._clock()
        old = self._entries.get(key)
        if old is not None and old[0] != replica_id:
            self._unlink(key, old[0])
        self._entries[key] = (replica_id, now + self.ttl_s)
        self._entries.move_to_end(key)
        if old is None or old[0] != replica_id:
            self._by_replica.setdefault(replica_id, set()).add(key)
        self._purge(now)
        while len(self._entries) > self.max_sessions:
            head, (rid, _) = next(iter(self._entries.items()))
            self._delete(head, rid)

    def forget(self, key: Hashable) -> bool:
        entry = self._entries.get(key)
        if entry is None:
            return False
        self._delete(key, entry[0])
        return True

    def drop_replica(self, replica_id: str) -> int:
        """Unbind every session on ``replica_id``; returns how many there were."""
        keys = self._by_replica.pop(replica_id, set())
        for key in keys:
            del self._entries[key]
        return len(keys)

    def expire(self) -> int:
        """Delete every expired binding; returns how many."""
        return self._purge(self._clock(), limit=None)

    def sessions_on(self, replica_id: str) -> int:
        return len(self._by_replica.get(replica_id, ()))

    def stats(self) -> dict:
        return {
            "sessions": len(self._entries),
            "per_replica": {rid: len(keys) for rid, keys in self._by_replica.items()},
        }

    def _purge(self, now: float, limit: int | None = 8) -> int:
        """Delete expired entries from the head (at most ``limit`` per call when given)."""
        n = 0
        entries = self._entries
        while entries and (limit is None or n < limit):
            head, (rid, expires) = next(iter(entries.items()))
            if expires > now:
                break
            self._delete(head, rid)
            n += 1
        return n

    def _delete(self, key: Hashable, replica_id: str) -> None:
        del self._entries[key]
        self._unlink(key, replica_id)

    def _unlink(self, key: Hashable, replica_id: str) -> None:
        keys = self._by_replica.get(replica_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_replica[replica_id]
