"""StateSync: keeps this gateway's local view (PrefixIndex, SessionTable, remote load) in step with
the shared store, off the request path.

* Request path: :meth:`StateSync.record` appends ``(replica, hashes, session, wall)`` to an in-memory
  outbox and wakes the flusher -- no await, no I/O.  The outbox is bounded (``outbox_max``); when
  full, the oldest entry is dropped and counted.
* Flusher: wakes on the first record, takes up to ``max_batch`` entries, numbers them (``seq``,
  consecutive per process) and publishes them in one round trip.  Publishes start at most every
  ``flush_interval_s`` (the store's own: 10 ms for Redis, 0 in memory): the first decision after a
  quiet spell leaves at once (sparse traffic propagates in about a millisecond), a busy gateway
  sends one batch per interval (at most that much added delay).  A Redis publish and its read-back
  cost a few hundred microseconds of this event loop's CPU whatever the batch size, so batching is
  what keeps the Redis backend's request latency at the memory backend's.  On failure the batch
  goes back to the head of the outbox (bounded; the oldest drop first) and is re-published once
  the store is back, with the same seqs, so receivers can drop duplicates.
* Tailer: reads the stream after the last id it applied (XREAD BLOCK) and applies each entry to the
  local view: ``index.insert`` and ``sessions.bind`` for other gateways' events; only the session
  binding for its own (re-applied in stream order, so every gateway ends with the stream's last
  binding of a session).  Duplicates (seq <= last seen from that process) are skipped; a seq jump
  means entries were trimmed before we read them, so a session snapshot is loaded.
* Catch-up: before tailing, and after every reconnect, :meth:`_resync` reads the stream's info;
  the target is its last id.  If the stream was trimmed past our position (or before a fresh start)
  the session keys are loaded first (the snapshot), then the stream is replayed from our position
  (``0-0`` at start).  ``caught_up`` is set once the target is applied; ``ready`` is caught_up, or the
  store unreachable for longer than ``catchup_timeout_s`` (a gateway must be able to start cold).
* Heartbeat: every ``heartbeat_s`` publish this gateway's in-flight per replica (TTL ``load_ttl_s``)
  and read everyone's; the sum over other live gateways becomes ``Replica.remote_in_flight``.  If
  no read succeeds for ``load_ttl_s`` the remote counts are zeroed (stale load must not pin).
* Failure: any failed store call marks the link down (:class:`StoreLink`); the flusher and the
  tailer then wait, and the heartbeat task probes with ``ping`` on the backoff schedule.  The first
  successful probe marks the link up, schedules a resync and wakes the flusher.  Every store call is
  bounded by ``op_timeout_s`` (plus the block time for reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections import deque
from collections.abc import Callable

from .backoff import StoreLink
from .events import ZERO_ID, Event, parse_id
from .metrics import StateMetrics
from .settings import SyncSettings
from .store import ReadBatch, Store, StoreUnavailable

log = logging.getLogger("kvgate.state")


class StateSync:
    def __init__(
        self,
        store: Store,
        deps,
        pool=None,
        gateway_id: str = "",
        settings: SyncSettings | None = None,
        metrics: StateMetrics | None = None,
        clock: Callable[[], float] | None = None,
        wall: Callable[[], float] = time.time,
        rng: Callable[[], float] = random.random,
        on_apply: Callable[[Event], None] | None = None,
    ) -> None:
        self.store = store
        self.index = deps.index
        self.sessions = deps.sessions
        self.pool = pool
        self.nonce = os.urandom(6).hex()
        self.gateway_id = gateway_id or self.nonce
        self.s = settings or SyncSettings()
        self.m = metrics or StateMetrics()
        self._clock = clock or deps.clock
        self._wall = wall
        self.on_apply = on_apply  # called with each applied event (benchmarks, tests)
        self.link = StoreLink(self.s.backoff, self._clock, rng)
        self._outbox: deque[tuple] = deque()
        self._wake = asyncio.Event()
        self._up = asyncio.Event()
        self._down = asyncio.Event()
        self._down.set()
        self._caught = asyncio.Event()
        self._seq = 0
        self._last_id = ZERO_ID
        self._target = (0, 0)
        self._resync_needed = True
        self._snapshot_needed = False
        self._seqs: dict[str, int] = {}
        self._loads_at: float | None = None
        self._remote_gateways = 0
        self._started = self._clock()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self.stats = dict.fromkeys(
            ("published", "applied", "dropped", "duplicates", "malformed", "gaps", "snapshots"), 0
        )
        self.m.up.labels(store.backend).set(0)

    # ------------------------------------------------------------------ request path
    def record(self, replica: str, hashes: tuple[int, ...], session: str | None) -> None:
        q = self._outbox
        if len(q) >= self.s.outbox_max:
            q.popleft()
            self._drop(1)
        q.append((replica, hashes, session, self._wall()))
        self._wake.set()

    # ------------------------------------------------------------------ lifecycle
    async def start(self, wait_s: float = 0.0) -> None:
        """Start the background tasks; wait up to ``wait_s`` for the catch-up."""
        self._started = self._clock()
        self._stopping = False
        self._tasks = [
            asyncio.create_task(self._heartbeat_loop(), name="kvgate-state-heartbeat"),
            asyncio.create_task(self._tail_loop(), name="kvgate-state-tail"),
            asyncio.create_task(self._flush_loop(), name="kvgate-state-flush"),
        ]
        if wait_s > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._caught.wait(), wait_s)

    async def abort(self) -> None:
        """Stop the tasks and nothing else, as a crash would (the load hash expires by its TTL)."""
        self._stopping = True
        tasks, self._tasks = self._tasks, []
        # Cancel until done: asyncio.wait_for before Python 3.12 can swallow a cancellation that
        # races with its inner call finishing, and the loop would go round once more.
        while tasks:
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks, timeout=0.1)
            tasks = [t for t in tasks if not t.done()]

    async def stop(self, flush_s: float = 1.0) -> None:
        """Cancel the tasks; publish what the outbox holds and withdraw our load (best effort)."""
        await self.abort()
        if not self.link.up:
            return
        try:
            while self._outbox:
                batch, raw = self._take()
                await asyncio.wait_for(self.store.publish(batch, self.sessions.ttl_s), flush_s)
                self._published(batch)
            if self.pool is not None:
                await asyncio.wait_for(self.store.drop_load(self.gateway_id), flush_s)
        except (StoreUnavailable, asyncio.TimeoutError) as exc:
            log.warning("could not flush shared state on shutdown: %r", exc)

    # ------------------------------------------------------------------ status
    @property
    def caught_up(self) -> bool:
        return self._caught.is_set()

    def ready(self) -> bool:
        if self._caught.is_set():
            return True
        return not self.link.up and self._clock() - self._started >= self.s.catchup_timeout_s

    def refresh_gauges(self) -> None:
        self.m.outbox.set(len(self._outbox))
        self.m.caught_up.set(1 if self.caught_up else 0)

    def status(self) -> dict:
        link = self.link
        return {
            "backend": self.store.backend,
            "shared": True,
            "gateway_id": self.gateway_id,
            "up": link.up,
            "status": "ok" if link.up else "degraded",
            "caught_up": self.caught_up,
            "down_for_s": round(link.down_for(), 3),
            "last_error": "" if link.up else link.last_error,
            "outbox": len(self._outbox),
            "last_id": self._last_id,
            "remote_gateways": self._remote_gateways,
            **self.stats,
        }

    # ------------------------------------------------------------------ link state
    async def _call(self, coro, extra_s: float = 0.0):
        try:
            return await asyncio.wait_for(coro, self.s.op_timeout_s + extra_s)
        except asyncio.TimeoutError as exc:
            raise StoreUnavailable("store call timed out") from exc

    def _failed(self, op: str, exc: BaseException) -> None:
        self.m.errors.labels(op).inc()
        if self.link.failed(exc) or not self.link.ever_up and self.link.failures == 1:
            log.warning("shared state store (%s) unreachable: %s", self.store.backend, exc)
        self.m.up.labels(self.store.backend).set(0)
        self._up.clear()
        self._down.set()
        self._resync_needed = True

    def _mark_up(self) -> None:
        again = self.link.ever_up
        if self.link.succeeded() and again:
            log.warning("shared state store (%s) reachable again", self.store.backend)
        self.m.up.labels(self.store.backend).set(1)
        self._resync_needed = True
        self._down.clear()
        self._up.set()
        if self._outbox:
            self._wake.set()

    # ------------------------------------------------------------------ flusher
    def _take(self) -> tuple[list[Event], list[tuple]]:
        q = self._outbox
        raw = [q.popleft() for _ in range(min(len(q), self.s.max_batch))]
        gw, nonce, seq = self.gateway_id, self.nonce, self._seq
        batch = [
            Event(r, h, s, gw, nonce, seq + i, int(w * 1e6))
            for i, (r, h, s, w) in enumerate(raw, 1)
        ]
        return batch, raw

    def _published(self, batch: list[Event]) -> None:
        self._seq += len(batch)
        self.stats["published"] += len(batch)
        self.m.published.inc(len(batch))

    def _put_back(self, raw: list[tuple]) -> None:
        room = self.s.outbox_max - len(self._outbox)
        if room < len(raw):
            self._drop(len(raw) - max(room, 0))
            raw = raw[len(raw) - max(room, 0) :]
        self._outbox.extendleft(reversed(raw))

    def _drop(self, n: int) -> None:
        self.stats["dropped"] += n
        self.m.dropped.inc(n)

    async def _flush_loop(self) -> None:
        interval = self.s.flush_interval_s
        if interval is None:
            interval = getattr(self.store, "flush_interval_s", 0.0)
        last = -interval
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            while self._outbox:
                if not self.link.up:
                    await self._up.wait()
                wait = last + interval - time.monotonic()
                if wait > 0 and len(self._outbox) < self.s.max_batch:
                    await asyncio.sleep(wait)  # a publish went out just now: let a batch gather
                last = time.monotonic()
                batch, raw = self._take()
                try:
                    await self._call(self.store.publish(batch, self.sessions.ttl_s))
                except StoreUnavailable as exc:
                    self._put_back(raw)
                    self._failed("publish", exc)
                    continue
                except asyncio.CancelledError:
                    self._put_back(raw)
                    raise
                self._published(batch)

    # ------------------------------------------------------------------ tailer
    async def _tail_loop(self) -> None:
        while not self._stopping:
            if not self.link.up:
                await self._up.wait()
            try:
                if self._resync_needed:
                    await self._resync()
                if self._snapshot_needed:
                    await self._load_snapshot()
                batch = await self._call(
                    self.store.read(self._last_id, self.s.read_count, self.s.block_s), self.s.block_s
                )
            except StoreUnavailable as exc:
                self._failed("tail", exc)
                continue
            if batch:
                self._apply(batch)
            if not self._caught.is_set() and (not batch or parse_id(self._last_id) >= self._target):
                self._caught.set()
                self.m.caught_up.set(1)

    async def _resync(self) -> None:
        info = await self._call(self.store.info())
        last = parse_id(self._last_id)
        if not info.exists or parse_id(info.last_id) < last:
            # A new stream (the store restarted or was flushed): replay it from its start.
            self._last_id, last = ZERO_ID, (0, 0)
        if last == (0, 0):
            gap = info.trimmed
        else:  # our position was trimmed away: entries after it may be lost
            gap = info.first_id is not None and parse_id(info.first_id) > last
        self._snapshot_needed = self._snapshot_needed or gap
        self._target = parse_id(info.last_id) if info.exists else (0, 0)
        self._resync_needed = False

    async def _load_snapshot(self) -> None:
        n = 0
        async for key, replica in self.store.sessions():
            self.sessions.bind(key, replica)
            n += 1
        self._snapshot_needed = False
        self.stats["snapshots"] += 1
        self.m.snapshots.inc()
        log.info("loaded %d session bindings from the shared store", n)

    def _apply(self, batch: ReadBatch) -> None:
        now = self._clock()
        wall_us = self._wall() * 1e6
        ttl_us = self.sessions.ttl_s * 1e6
        seqs = self._seqs
        nonce = self.nonce
        applied = 0
        for _, ev in batch:
            if ev is None:
                self.stats["malformed"] += 1
                continue
            if ev.origin == nonce:
                if ev.session is not None:
                    self.sessions.bind(ev.session, ev.replica)
                continue
            last = seqs.get(ev.origin)
            if last is not None:
                if ev.seq <= last:
                    self.stats["duplicates"] += 1
                    continue
                if ev.seq > last + 1:
                    self.stats["gaps"] += 1
                    self._snapshot_needed = True
            seqs[ev.origin] = ev.seq
            if ev.hashes:
                self.index.insert(ev.replica, ev.hashes, now)
            if ev.session is not None and wall_us - ev.wall_us < ttl_us:
                self.sessions.bind(ev.session, ev.replica)
            applied += 1
            self.m.lag.observe(max(0.0, wall_us - ev.wall_us) / 1e6)
            if self.on_apply is not None:
                self.on_apply(ev)
        self._last_id = batch[-1][0]
        if len(seqs) > 4096:  # processes come and go; forget the oldest half
            for key in list(seqs)[:2048]:
                del seqs[key]
        self.stats["applied"] += applied
        self.m.applied.inc(applied)

    # ------------------------------------------------------------------ heartbeat / probe
    async def _heartbeat_loop(self) -> None:
        while not self._stopping:
            if not self.link.up:
                await asyncio.sleep(self.link.probe_in())
                try:
                    await self._call(self.store.ping())
                except StoreUnavailable as exc:
                    self._failed("probe", exc)
                    self._expire_loads()
                    continue
                self._mark_up()
            if self.pool is not None:
                await self._beat()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._down.wait(), self.s.heartbeat_s)

    async def _beat(self) -> None:
        counts = {r.id: r.in_flight for r in self.pool}
        try:
            await self._call(self.store.publish_load(self.gateway_id, counts, self.s.load_ttl_s))
            loads = await self._call(self.store.read_load())
        except StoreUnavailable as exc:
            self._failed("heartbeat", exc)
            self._expire_loads()
            return
        self._loads_at = self._clock()
        totals: dict[str, int] = {}
        others = 0
        for gw, per_replica in loads.items():
            if gw == self.gateway_id:
                continue
            others += 1
            for rid, n in per_replica.items():
                totals[rid] = totals.get(rid, 0) + n
        self._remote_gateways = others
        self._set_remote(totals)

    def _expire_loads(self) -> None:
        if self._loads_at is not None and self._clock() - self._loads_at >= self.s.load_ttl_s:
            self._loads_at = None
            self._remote_gateways = 0
            self._set_remote({})

    def _set_remote(self, totals: dict[str, int]) -> None:
        if self.pool is None:
            return
        self.pool.set_remote_in_flight(totals)
        for rep in self.pool:
            self.m.remote_in_flight.labels(rep.id).set(rep.remote_in_flight)
