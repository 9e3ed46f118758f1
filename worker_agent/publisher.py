"""Publish a store's KV events exactly as vLLM's ``ZmqEventPublisher`` does.

* PUB socket (``endpoint``): one message per batch, three frames ``(topic, seq, payload)`` with
  ``seq`` an 8-byte big-endian counter from 0 and ``payload`` the msgpack batch of
  :func:`worker_agent.events.encode_batch` (``[ts, [event, ...], dp_rank]``).
* Optional ROUTER replay socket (``replay_endpoint``): a DEALER sends ``(b"", start_seq)``; the
  publisher answers ``(b"", seq, payload)`` for every batch it still buffers (the last
  ``buffer_steps``) with ``seq >= start_seq``, then ``(b"", END_SEQ, b"")`` with ``END_SEQ`` = -1 as
  8 signed big-endian bytes.
* ``endpoint=None``: no PUB socket; batches are still numbered, buffered and given to listeners.
* An endpoint containing ``*`` binds (``tcp://*:5557``, ``tcp://127.0.0.1:*`` for a free port),
  any other connects -- vLLM's rule.  ``endpoint`` / ``replay_endpoint`` report what was bound.

``sink(events)`` is the store's ``on_events`` callback: thread-safe and non-blocking (the store
calls it under its lock, from the loop or from worker threads).  One flusher task drains what
arrived into batches of at most ``max_batch`` events (coalesced), publishes them in order and then
hands each batch to the ``listeners`` (e.g. the shared-store sink).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

import zmq
import zmq.asyncio

from .events import Event, coalesce, encode_batch, zmq_frames

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
Listener = Callable[[list[Event]], None]


class KvEventPublisher:
    def __init__(
        self,
        endpoint: str | None = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        topic: str = "kv-events",
        buffer_steps: int = 10_000,
        max_batch: int = 1024,
        hwm: int = 100_000,
        dp_rank: int = 0,
        wall: Callable[[], float] = time.time,
        listeners: Sequence[Listener] = (),
    ) -> None:
        if max_batch < 1 or buffer_steps < 1:
            raise ValueError("max_batch and buffer_steps must be >= 1")
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.max_batch = max_batch
        self.hwm = hwm
        self.dp_rank = dp_rank
        self._wall = wall
        self.listeners: list[Listener] = list(listeners)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._pending: deque[list[Event]] = deque()
        self._seq = 0
        self.events_published = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []

    # -- addresses and counters --------------------------------------------------------------
    @property
    def endpoint(self) -> str | None:
        return None if self._endpoint is None else self._bound(self._pub, self._endpoint)

    @property
    def replay_endpoint(self) -> str | None:
        if self._replay_endpoint is None:
            return None
        return self._bound(self._replay, self._replay_endpoint)

    @staticmethod
    def _bound(sock: zmq.asyncio.Socket | None, configured: str) -> str:
        if sock is None or "*" not in configured:
            return configured
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def next_seq(self) -> int:
        return self._seq

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> KvEventPublisher:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._ctx = zmq.asyncio.Context()
        try:
            if self._endpoint is not None:
                self._pub = self._open(zmq.PUB, self._endpoint)
                self._pub.setsockopt(zmq.SNDHWM, self.hwm)
            if self._replay_endpoint is not None:
                self._replay = self._open(zmq.ROUTER, self._replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._tasks.append(asyncio.ensure_future(self._flush_loop()))
        if self._replay is not None:
            self._tasks.append(asyncio.ensure_future(self._replay_loop()))
        if self._pending:
            self._wake.set()
        return self

    def _open(self, kind: int, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if "*" in endpoint:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
        return sock

    async def close(self) -> None:
        """Publish what is pending, then stop and close the sockets."""
        if self._wake is not None and self._pending and self._tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.flush(), 1.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # -- intake --------------------------------------------------------------------------------
    def sink(self, events: list[Event]) -> None:
        """The store's ``on_events``: enqueue and wake the flusher (any thread, never blocks)."""
        if not events:
            return
        self._pending.append(list(events))
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # flushed once started
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._wake.set()
        else:
            loop.call_soon_threadsafe(self._wake.set)

    async def flush(self) -> None:
        """Wait until everything enqueued so far is published (for shutdown and tests)."""
        while self._pending or (self._wake is not None and self._wake.is_set()):
            await asyncio.sleep(0)

    # -- tasks ---------------------------------------------------------------------------------
    def _take_batch(self) -> list[Event]:
        out: list[Event] = []
        while self._pending and len(out) < self.max_batch:
            out.extend(self._pending.popleft())
        return coalesce(out)

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            while self._pending:
                events = self._take_batch()
                payload = encode_batch(self._wall(), events, self.dp_rank)
                seq = self._seq
                self._seq += 1
                self._buffer.append((seq, payload))
                if self._pub is not None:
                    try:
                        await self._pub.send_multipart(zmq_frames(self.topic, seq, payload))
                    except zmq.ZMQError as exc:  # PUB drops on HWM: this is a socket failure
                        log.warning("kv event publish failed (seq %d): %s", seq, exc)
                self.events_published += len(events)
                for listener in self.listeners:
                    try:
                        listener(events)
                    except Exception:
                        log.exception("kv event listener failed")
            self._wake.clear()

    async def _replay_loop(self) -> None:
        sock = self._replay
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("ignoring a malformed replay request (%d frames)", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await sock.send_multipart((client, b"", END_SEQ, b""))
