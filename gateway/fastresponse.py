"""The reading side of :mod:`gateway.fastclient`: its errors and :class:`Response`.

A :class:`Response` is fed by the connection that carries it (head, body chunks, the end or an
error) and read by the caller through :meth:`Response.read_chunk`; it only needs the few
connection methods of :class:`_Conn`, so this module imports nothing of the client's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol

HIGH_WATER = 1 << 20  # unread body bytes above which the socket stops being read
LOW_WATER = 1 << 18


class HTTPError(Exception):
    """Any failure of the client."""


class ConnectError(HTTPError):
    """The TCP (or TLS) connection could not be made."""


class TimeoutException(HTTPError):
    """Some timeout expired."""


class ConnectTimeout(TimeoutException):
    pass


class ReadTimeout(TimeoutException):
    pass


class PoolTimeout(TimeoutException):
    """The origin's connection cap was reached and none became free in time."""


class RemoteProtocolError(HTTPError):
    """The server broke HTTP: closed mid-response, or sent bytes that do not parse."""


class ReadError(HTTPError):
    """The connection failed with an OS error while the response was read."""


class _Conn(Protocol):
    """What a :class:`Response` uses of the connection carrying it (``fastpool._Connection``)."""

    loop: asyncio.AbstractEventLoop

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def abandon(self, resp: Response) -> None: ...


class Response:
    """One response; the body streams in through :meth:`read_chunk`."""

    __slots__ = (
        "status", "headers", "http_version", "_conn", "_chunks", "_buffered", "_done",
        "_error", "_waiter", "_wait_started", "_head_done", "_paused", "_sink",
    )

    def __init__(self, conn: _Conn) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []  # names lower-cased, values as sent
        self.http_version = ""
        self._conn: _Conn | None = conn
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._done = False  # the whole body has arrived
        self._error: HTTPError | None = None
        self._waiter: asyncio.Future | None = None
        self._wait_started = 0.0
        self._head_done = False
        self._paused = False
        self._sink: Callable[[bytes], bool] | None = None  # see sink_until_done

    # -- reading
    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        """The first value of header ``name`` (lower-case bytes)."""
        for k, v in self.headers:
            if k == name:
                return v
        return default

    @property
    def complete(self) -> bool:
        """True when the body has fully arrived and nothing of it is left unread."""
        return self._done and not self._chunks

    async def read_chunk(self) -> bytes:
        """The body bytes that arrived since the last call (waits for some); ``b""`` at the end."""
        chunks = self._chunks
        if not chunks:
            if self._done:
                return b""
            if self._error is None:
                await self._new_waiter()
            if not chunks:
                if self._error is not None:
                    raise self._error
                return b""
        data = self._peek()
        self._taken()
        return data

    async def sink_until_done(self, sink: Callable[[bytes], bool]) -> None:
        """Hand the body to ``sink`` as the connection reads it (one call per socket read, inside
        the connection's ``data_received``), until the body has all arrived, the connection fails,
        or ``sink`` refuses a piece by returning False; what is then left, :meth:`read_chunk`
        returns.  The end of the body is never given to ``sink``: it stays for ``read_chunk``."""
        if self._done or self._error is not None or self._conn is None:
            return
        if self._chunks and not self._give(sink):
            return
        self._sink = sink
        try:
            await self._new_waiter()
        finally:
            self._sink = None

    def _peek(self) -> bytes:
        chunks = self._chunks
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _taken(self) -> None:
        """The queued bytes were handed on: forget them, read the socket again if paused."""
        self._chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            conn = self._conn
            if conn is not None:
                conn.resume_reading()

    def _give(self, sink: Callable[[bytes], bool]) -> bool:
        if not sink(self._peek()):
            return False
        self._taken()
        return True

    async def aread(self) -> bytes:
        """The whole (rest of the) body."""
        parts = []
        while True:
            data = await self.read_chunk()
            if not data:
                return b"".join(parts)
            parts.append(data)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        while True:
            data = await self.read_chunk()
            if not data:
                return
            yield data

    def close(self) -> None:
        """Stop reading: a connection still carrying this response is closed, not reused."""
        conn = self._conn
        if conn is not None and not self._done:
            self._conn = None
            conn.abandon(self)
        self._done = True
        self._chunks.clear()

    async def aclose(self) -> None:
        self.close()

    # -- fed by the connection
    def _new_waiter(self) -> asyncio.Future:
        """A future the connection resolves on news (data, the end, an error); await it."""
        loop = self._conn.loop
        fut = self._waiter = loop.create_future()
        self._wait_started = loop.time()
        return fut

    @property
    def _waiting(self) -> bool:
        w = self._waiter
        return w is not None and not w.done()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._paused and self._conn is not None:
            self._paused = True
            self._conn.pause_reading()
        if self._sink is not None:
            return  # the connection calls _drain once this read is parsed
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _drain(self) -> None:
        """After a read was parsed: give its body to the sink (see :meth:`sink_until_done`)."""
        sink = self._sink
        if sink is None or not self._chunks or self._done:
            return
        if not self._give(sink):
            self._sink = None
            self._wake()

    def _finish(self) -> None:
        self._done = True
        self._conn = None
        self._wake()

    def _fail(self, exc: HTTPError) -> None:
        if self._done:
            return
        self._error = exc
        self._conn = None
        self._wake()

