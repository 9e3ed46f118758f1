"""The shared-state ``Store`` contract and its embedded backend, :class:`MemoryStore`.

A store holds what gateways share (DESIGN.md section 4):

* an append-only, trimmed **stream of index-change events** (:mod:`gateway.state.events`) that every
  gateway tails into its local view;
* **session bindings** (session key -> replica) with a TTL, refreshed by every publish that names
  the session -- the snapshot a late gateway loads when the stream no longer holds their events;
* **per-gateway load**: each gateway's in-flight count per replica, published with a heartbeat and
  gone once its TTL passes without one (a dead gateway's counts expire).

Every method may raise :class:`StoreUnavailable` (the backend's own errors are translated at the
boundary); none is ever awaited on the request path.  ``MemoryStore`` keeps everything in this
process: one object can be shared by several gateways running in one event loop (``kvgate demo
--gateways 2`` without Redis, and the tests).  ``RedisStore`` (:mod:`gateway.state.redis_store`)
shares it between processes and hosts.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .events import ZERO_ID, Event, format_id, parse_id


class StoreUnavailable(Exception):
    """The shared store could not be reached (or answered garbage); the local view still works."""


@dataclass(frozen=True, slots=True)
class StreamInfo:
    exists: bool = False
    length: int = 0
    first_id: str | None = None
    last_id: str = ZERO_ID  # the last id ever generated (Redis: last-generated-id)
    added: int = 0  # entries ever added (Redis 7: entries-added); -1 when unknown

    @property
    def trimmed(self) -> bool:
        """True when entries were removed from the head (a reader from 0 misses some)."""
        return self.added > self.length if self.added >= 0 else self.first_id not in (None, ZERO_ID)


ReadBatch = list[tuple[str, Event | None]]  # (stream id, event or None when malformed)


@runtime_checkable
class Store(Protocol):
    backend: str

    async def ping(self) -> None: ...

    async def publish(self, events: Sequence[Event], session_ttl_s: float) -> None:
        """Append ``events`` to the stream, in order, and (re)bind their sessions for ``session_ttl_s``."""

    async def read(self, after: str, count: int, block_s: float) -> ReadBatch:
        """Up to ``count`` entries after id ``after``; waits up to ``block_s`` when there are none."""

    async def info(self) -> StreamInfo: ...

    def sessions(self, batch: int = 1000) -> AsyncIterator[tuple[str, str]]:
        """Every live (session key, replica) binding: the snapshot for catch-up."""

    async def get_session(self, key: str) -> str | None: ...

    async def publish_load(self, gateway: str, counts: Mapping[str, int], ttl_s: float) -> None: ...

    async def read_load(self) -> dict[str, dict[str, int]]:
        """Live gateways' in-flight counts: gateway id -> replica id -> count."""

    async def drop_load(self, gateway: str) -> None: ...

    async def close(self) -> None: ...


class MemoryStore:
    """The embedded backend: the same semantics as Redis, in this process, with an injected clock.

    ``available = False`` (see :meth:`set_available`) makes every call raise ``StoreUnavailable``,
    as an unreachable Redis would: the tests run one failure suite against both backends.
    """

    backend = "memory"
    flush_interval_s = 0.0  # publishing is a list append: no batching needed

    def __init__(self, maxlen: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        if maxlen < 1:
            raise ValueError("maxlen must be >= 1")
        self.maxlen = maxlen
        self._clock = clock
        self._entries: list[tuple[int, Event]] = []  # (id number, event); id "n-0"
        self._head = 0  # index of the first live entry in _entries
        self._next = 1
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._load: dict[str, tuple[dict[str, int], float]] = {}
        self._changed: asyncio.Event | None = None
        self.available = True

    def set_available(self, up: bool) -> None:
        self.available = up
        if not up:
            self._notify()  # blocked readers fail now, as a dropped connection would

    def _check(self) -> None:
        if not self.available:
            raise StoreUnavailable("memory store marked unavailable")

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def ping(self) -> None:
        self._check()

    async def publish(self, events: Sequence[Event], session_ttl_s: float) -> None:
        self._check()
        now = self._clock()
        for ev in events:
            self._entries.append((self._next, ev))
            self._next += 1
            if ev.session is not None:
                self._sessions[ev.session] = (ev.replica, now + session_ttl_s)
                self._sessions.move_to_end(ev.session)
        live = len(self._entries) - self._head
        if live > self.maxlen:
            self._head += live - self.maxlen
            if self._head > self.maxlen:
                del self._entries[: self._head]
                self._head = 0
        self._purge_sessions(now)
        self._notify()

    def _slice(self, after: str, count: int) -> ReadBatch:
        after_n = parse_id(after)[0]
        first_n = self._next - (len(self._entries) - self._head)
        start = self._head + max(0, after_n + 1 - first_n)
        return [(format_id(n), ev) for n, ev in self._entries[start : start + count]]

    async def read(self, after: str, count: int, block_s: float) -> ReadBatch:
        self._check()
        out = self._slice(after, count)
        if out or block_s <= 0:
            return out
        if self._changed is None:
            self._changed = asyncio.Event()
        try:
            await asyncio.wait_for(self._changed.wait(), block_s)
        except asyncio.TimeoutError:
            return []
        self._check()
        return self._slice(after, count)

    async def info(self) -> StreamInfo:
        self._check()
        live = len(self._entries) - self._head
        added = self._next - 1
        if not added:
            return StreamInfo()
        first = format_id(self._entries[self._head][0]) if live else None
        return StreamInfo(True, live, first, format_id(added), added)

    async def sessions(self, batch: int = 1000) -> AsyncIterator[tuple[str, str]]:
        self._check()
        now = self._clock()
        for key, (replica, expires) in list(self._sessions.items()):
            if expires > now:
                yield key, replica

    async def get_session(self, key: str) -> str | None:
        self._check()
        entry = self._sessions.get(key)
        return entry[0] if entry is not None and entry[1] > self._clock() else None

    async def publish_load(self, gateway: str, counts: Mapping[str, int], ttl_s: float) -> None:
        self._check()
        self._load[gateway] = (dict(counts), self._clock() + ttl_s)

    async def read_load(self) -> dict[str, dict[str, int]]:
        self._check()
        now = self._clock()
        for gw in [g for g, (_, exp) in self._load.items() if exp <= now]:
            del self._load[gw]
        return {gw: dict(counts) for gw, (counts, _) in self._load.items()}

    async def drop_load(self, gateway: str) -> None:
        self._check()
        self._load.pop(gateway, None)

    async def close(self) -> None:
        self._notify()

    def _purge_sessions(self, now: float) -> None:
        sessions = self._sessions
        while sessions:
            key, (_, expires) = next(iter(sessions.items()))
            if expires > now:
                break
            del sessions[key]
