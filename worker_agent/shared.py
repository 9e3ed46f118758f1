"""Publish what an agent holds into the gateways' shared store (only when a Redis URL is set).

The shared store (:mod:`gateway.state`) carries index-change events ``Event(replica, hashes)``
that every gateway applies as ``PrefixIndex.insert(replica, hashes)``: ``hashes`` must be a chain
from the root (hash ``i`` names the prefix ``0..i``).  KV events name blocks one run at a time with
a parent link, so :class:`ChainTracker` keeps the parent of every block the agent holds and turns
each ``BlockStored`` run that makes a block newly held into the whole chain from its root.  A run
whose ancestry is incomplete (an ancestor was evicted) is not published: a gateway can only use a
prefix from its first block.  A move between tiers (``BlockRemoved`` then ``BlockStored``) does not
make a block newly held and publishes nothing.

Entries therefore use the stream layout of :mod:`gateway.state.events` (fields ``r`` replica id,
``h`` the chain as little-endian uint64s, ``g`` = ``agent:<name>``, ``n`` a per-process nonce,
``q`` a consecutive seq, ``w`` wall ms) on ``{namespace}:events``.  The store's events have no
removal: a gateway learns that an agent dropped a block from its own capacity model, or from the
agent's ZMQ events.  The hashes are the agent's token-block hashes: they match a gateway's only in
exact (tokenizer) mode.

:class:`SharedStoreSink` is a publisher listener: ``__call__`` is quick (it runs on the loop) and
queues chains; a task sends them in batches and, when the store is unreachable, keeps them (past
``outbox_max`` the oldest are dropped) and retries the batch, with the same seqs (receivers drop
duplicates), on a doubling delay.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable

from .events import AllBlocksCleared, BlockRemoved, BlockStored, Event

log = logging.getLogger(__name__)


class ChainTracker:
    """Parent links of held blocks; stored runs -> root-anchored chains (see module header)."""

    def __init__(self, max_depth: int = 1 << 16) -> None:
        self.max_depth = max_depth
        self._parent: dict[int, int | None] = {}
        self._copies: dict[int, int] = {}  # block -> tiers holding it (1 in an exclusive store)

    def __len__(self) -> int:
        return len(self._copies)

    def chain_to(self, key: int) -> tuple[int, ...] | None:
        """The chain from the root to ``key``, or None when an ancestor is not held."""
        out = [key]
        parent = self._parent.get(key)
        while parent is not None:
            if parent not in self._copies or len(out) >= self.max_depth:
                return None
            out.append(parent)
            parent = self._parent.get(parent)
        out.reverse()
        return tuple(out)

    def apply(self, events: Iterable[Event]) -> list[tuple[int, ...]]:
        """Apply one batch; returns the chains of its runs that made some block newly held.

        "Newly" compares the end of the batch with its start, so a tier move inside the batch
        (removed, then stored) is not news.  A chain that is a prefix of another is left out.
        """
        before: dict[int, bool] = {}
        runs: list[tuple[int, ...]] = []
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                for key in self._copies:
                    before.setdefault(key, True)
                self._copies.clear()
                self._parent.clear()
                continue
            if not isinstance(ev, BlockStored | BlockRemoved):
                continue
            for key in ev.block_hashes:
                before.setdefault(key, key in self._copies)
            if isinstance(ev, BlockStored):
                parent = ev.parent_block_hash
                for key in ev.block_hashes:
                    self._parent[key] = parent
                    self._copies[key] = self._copies.get(key, 0) + 1
                    parent = key
                if ev.block_hashes:
                    runs.append(ev.block_hashes)
            else:
                for key in ev.block_hashes:
                    n = self._copies.get(key, 0) - 1
                    if n > 0:
                        self._copies[key] = n
                    else:
                        self._copies.pop(key, None)
                        self._parent.pop(key, None)
        chains: list[tuple[int, ...]] = []
        for run in runs:
            if any(not before[k] and k in self._copies for k in run):
                chain = self.chain_to(run[-1])
                if chain is not None and chain not in chains:
                    chains.append(chain)
        longest = set()
        for c in chains:
            longest.update(c[:-1])  # every proper prefix's last hash
        return [c for c in chains if c[-1] not in longest]


class SharedStoreSink:
    """Queue chains from KV events and publish them to a ``gateway.state`` store."""

    def __init__(
        self,
        store,
        replica_id: str,
        *,
        name: str = "agent",
        max_batch: int = 256,
        outbox_max: int = 10_000,
        retry_s: float = 0.2,
        max_retry_s: float = 5.0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        from gateway.state.events import Event as StateEvent  # redis/gateway only when configured

        self._event_type = StateEvent
        self.store = store
        self.replica_id = replica_id
        self.gateway = f"agent:{name}"
        self.origin = os.urandom(6).hex()
        self.max_batch = max_batch
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self._wall = wall
        self.tracker = ChainTracker()
        self._outbox: deque[tuple[int, ...]] = deque(maxlen=outbox_max)
        self._seq = 0
        self.published = 0
        self.failures = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set while nothing is queued or in flight
        self._idle.set()
        self._task: asyncio.Task | None = None

    def __call__(self, events: list[Event]) -> None:
        chains = self.tracker.apply(events)
        if chains:
            self._outbox.extend(chains)
            self._idle.clear()
            self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._outbox)

    async def drain(self) -> None:
        """Wait until every queued chain is published (tests, shutdown)."""
        await self._idle.wait()

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.store.close()

    async def _run(self) -> None:
        from gateway.state.store import StoreUnavailable

        delay = self.retry_s
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._outbox:
                n = min(self.max_batch, len(self._outbox))
                chains = [self._outbox.popleft() for _ in range(n)]
                wall_ms = int(self._wall() * 1000)
                events = [
                    self._event_type(
                        self.replica_id, chain, None, self.gateway, self.origin,
                        self._seq + i + 1, wall_ms,
                    )  # fmt: skip
                    for i, chain in enumerate(chains)
                ]
                try:
                    await self.store.publish(events, 0.0)
                except StoreUnavailable as exc:
                    self.failures += 1
                    self._outbox.extendleft(reversed(chains))  # same seqs on the retry
                    log.warning("shared store unavailable (%s); retrying in %.1fs", exc, delay)
                    await asyncio.sleep(delay)  # backoff between retries, not event ordering
                    delay = min(self.max_retry_s, delay * 2)
                    continue
                delay = self.retry_s
                self._seq += len(chains)
                self.published += len(chains)
            self._idle.set()
