"""A small async HTTP/1.1 client for the proxy's hot path: asyncio Protocols + httptools.

Why: with httpx/httpcore the gateway spent most of its CPU in the client (httpcore's pool checks
every idle connection for readability on every request, plus anyio/h11 layers).  This client
does one thing: send a request on a pooled keep-alive connection and hand the response body over
chunk by chunk as it arrives.

* One pool per origin (scheme, host, port): idle connections are reused last-in first-out; at most
  ``max_idle_per_origin`` are kept, and ones idle longer than ``keepalive_expiry`` are closed
  when next looked at.  ``max_connections_per_origin`` (``None``: unbounded) caps open
  connections; a request that finds the cap reached waits up to ``connect_timeout`` for one.
* A connection goes back to the pool as soon as its response is complete (the body may still
  sit, unread, in the response object); a response closed half-read closes its connection, and
  so does any error.
* Bodies: content-length, chunked (de-chunked, as httpx's ``aiter_raw`` gives them) and
  close-delimited.  ``Response.read_chunk()`` returns whatever has arrived since the last call
  (joined), ``b""`` at the end; reading pauses the socket when more than ``HIGH_WATER`` bytes
  are buffered unread.
* Timeouts: ``connect_timeout`` for TCP (+TLS) set-up; ``read_timeout`` is the longest silence
  allowed while the caller waits for the head or the next chunk (one timer per connection, re-armed
  lazily: not one per request or per chunk).
* Errors (all :class:`HTTPError`): :class:`ConnectError`, :class:`ConnectTimeout`,
  :class:`ReadTimeout`, :class:`PoolTimeout`, :class:`RemoteProtocolError` (the server closed
  the connection mid-response, or sent something that is not HTTP), :class:`ReadError`
  (the connection failed with an OS error).
* A pooled connection found closed before the request is written is dropped and another one is
  used (the request was never sent).  Once a request is written it is not retried here: POST is
  not idempotent, and the proxy decides about retries.

Not supported (not needed by the proxy): HEAD requests, ``Expect: 100-continue``, upgrades,
HTTP/2, proxies, redirects, cookies, compression (bytes pass through untouched).
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
from collections import deque
from collections.abc import AsyncIterator, Iterable
from urllib.parse import urlsplit

import httptools

__all__ = [
    "FastClient", "Response", "HTTPError", "ConnectError", "TimeoutException", "ConnectTimeout",
    "ReadTimeout", "PoolTimeout", "RemoteProtocolError", "ReadError",
]

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


class Response:
    """One response; the body streams in through :meth:`read_chunk`."""

    __slots__ = (
        "status", "headers", "http_version", "_conn", "_chunks", "_buffered", "_done",
        "_error", "_waiter", "_wait_started", "_head_done", "_paused",
    )

    def __init__(self, conn: _Connection) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []  # names lower-cased, values as sent
        self.http_version = ""
        self._conn: _Connection | None = conn
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._done = False  # the whole body has arrived
        self._error: HTTPError | None = None
        self._waiter: asyncio.Future | None = None
        self._wait_started = 0.0
        self._head_done = False
        self._paused = False

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
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            conn = self._conn
            if conn is not None:
                conn.resume_reading()
        return data

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
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

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


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one response at a time."""

    def __init__(self, pool: _OriginPool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.counted = False  # counted in the pool's ``total``
        self.idle_since = 0.0
        self.last_data = 0.0
        self.reading_paused = False
        self._timer: asyncio.TimerHandle | None = None
        self._header_names: list[bytes] = []
        self._framed = False  # content-length or chunked: the body does not end with the connection

    # -- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.last_data = self.loop.time()
        if self.response is None:  # bytes on an idle connection: not HTTP we can use
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._broken(RemoteProtocolError(f"invalid HTTP response from {self.pool.name}: {exc}"))

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost does the rest

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        resp = self.response
        self.response = None
        if resp is not None and not resp._done:
            if exc is None and resp._head_done and not self._framed:
                resp._finish()  # close-delimited body: the end of the connection ends it
            elif exc is not None:
                resp._fail(ReadError(f"connection to {self.pool.name} failed: {exc!r}"))
            else:
                resp._fail(RemoteProtocolError(
                    f"{self.pool.name} closed the connection before the response was complete"
                ))
        self.pool.lost(self)

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        if self.response is None:
            raise RemoteProtocolError("unexpected bytes after the response")

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self._framed = True
        self.response.headers.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self.response
        status = self.parser.get_status_code()
        if status < 200:  # 1xx: an interim response, the real one follows
            resp.headers = []
            self._framed = False
            return
        resp.status = status
        resp.http_version = self.parser.get_http_version()
        if status in (204, 304):
            self._framed = True
        resp._head_done = True
        resp._wake()

    def on_body(self, body: bytes) -> None:
        self.response._feed(body)

    def on_message_complete(self) -> None:
        resp = self.response
        if resp is None or not resp._head_done:
            return  # end of a 1xx response
        self.response = None
        resp._finish()  # the read timer stays armed: it does nothing on an idle connection
        if self.reading_paused:
            self.resume_reading()
        if self.parser.should_keep_alive() and not self.closed:
            self.pool.release(self)
        else:
            self.close()

    # -- used by the client and the response
    def start(self, resp: Response, data: bytes, read_timeout: float) -> None:
        self.response = resp
        self._framed = False
        self.last_data = self.loop.time()
        if self._timer is None:  # one timer per connection, re-armed lazily (not one per request)
            self._timer = self.loop.call_later(read_timeout, self._on_timer, read_timeout)
        self.transport.write(data)

    def _on_timer(self, timeout: float) -> None:
        self._timer = None
        resp = self.response
        if resp is None or self.closed:
            return
        now = self.loop.time()
        if resp._head_done and not resp._waiting:
            # The caller is busy elsewhere (e.g. a slow client): not the server's silence.
            self._timer = self.loop.call_later(timeout, self._on_timer, timeout)
            return
        since = max(self.last_data, resp._wait_started) if resp._head_done else self.last_data
        left = since + timeout - now
        if left > 0:
            self._timer = self.loop.call_later(left, self._on_timer, timeout)
            return
        what = "the next body chunk" if resp._head_done else "the response head"
        self._broken(ReadTimeout(f"{self.pool.name} sent nothing for {timeout:g}s (waiting for {what})"))

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _broken(self, exc: HTTPError) -> None:
        resp = self.response
        self.response = None
        if resp is not None:
            resp._fail(exc)
        self.close()

    def abandon(self, resp: Response) -> None:
        if self.response is resp:
            self.response = None
            self.close()

    def pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()

    @property
    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._cancel_timer()
        if self.transport is not None:
            self.transport.close()
        self.pool.lost(self)


class _OriginPool:
    """Connections to one origin."""

    def __init__(self, client: FastClient, scheme: str, host: str, port: int) -> None:
        self.client = client
        self.loop = client._loop
        self.host = host
        self.port = port
        self.ssl = client._ssl_context() if scheme == "https" else None
        self.name = f"{host}:{port}"
        default_port = 443 if scheme == "https" else 80
        self.host_header = (host if port == default_port else f"{host}:{port}").encode("idna")
        if ":" in host and not host.startswith("["):  # IPv6 literal
            self.host_header = (f"[{host}]" if port == default_port else f"[{host}]:{port}").encode()
        self.idle: list[_Connection] = []
        self.total = 0  # open connections, idle or busy
        self.waiters: deque[asyncio.Future] = deque()

    def take_idle(self) -> _Connection | None:
        """The most recently used idle connection still fit for use, if any."""
        idle = self.idle
        if not idle:
            return None
        now = self.loop.time()
        expiry = self.client.keepalive_expiry
        while idle:
            conn = idle.pop()
            if conn.usable and now - conn.idle_since <= expiry:
                return conn
            conn.close()
        return None

    async def acquire(self) -> _Connection:
        """An idle connection, a new one, or (at the cap) the next one freed."""
        client = self.client
        while True:
            conn = self.take_idle()
            if conn is not None:
                return conn
            cap = client.max_connections_per_origin
            if cap is None or self.total < cap:
                return await self._connect()
            fut = self.loop.create_future()
            self.waiters.append(fut)
            try:
                await asyncio.wait_for(fut, client.connect_timeout)
            except asyncio.TimeoutError:
                raise PoolTimeout(
                    f"no free connection to {self.name} within {client.connect_timeout:g}s "
                    f"({cap} open)"
                ) from None
            finally:
                if fut in self.waiters:
                    self.waiters.remove(fut)

    async def _connect(self) -> _Connection:
        client = self.client
        conn = _Connection(self)
        conn.counted = True
        self.total += 1
        try:
            await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: conn, self.host, self.port, ssl=self.ssl,
                    server_hostname=self.host if self.ssl is not None else None,
                ),
                client.connect_timeout,
            )
        except asyncio.TimeoutError:
            self.lost(conn)
            raise ConnectTimeout(f"connecting to {self.name} took over {client.connect_timeout:g}s") from None
        except (OSError, _ssl.SSLError) as exc:
            self.lost(conn)
            raise ConnectError(f"cannot connect to {self.name}: {exc}") from exc
        except BaseException:
            conn.close()
            self.lost(conn)
            raise
        return conn

    def release(self, conn: _Connection) -> None:
        if len(self.idle) >= self.client.max_idle_per_origin or self.client._closed:
            conn.close()
            return
        conn.idle_since = self.loop.time()
        self.idle.append(conn)
        self._wake_waiter()

    def lost(self, conn: _Connection) -> None:
        """``conn`` closed (by us or the server); idempotent."""
        if conn.counted:
            conn.counted = False
            self.total -= 1
            self._wake_waiter()
        if self.idle and conn in self.idle:
            self.idle.remove(conn)

    def _wake_waiter(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def close(self) -> None:
        for conn in list(self.idle):
            conn.close()
        self.idle.clear()


class FastClient:
    """Pooled HTTP/1.1 client; create and use it inside one running event loop."""

    def __init__(
        self,
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 300.0,
        max_idle_per_origin: int = 256,
        max_connections_per_origin: int | None = None,
        keepalive_expiry: float = 30.0,
        ssl_context: _ssl.SSLContext | None = None,
    ) -> None:
        if connect_timeout <= 0 or read_timeout <= 0 or keepalive_expiry < 0:
            raise ValueError("timeouts must be positive")
        if max_idle_per_origin < 0 or (max_connections_per_origin is not None and max_connections_per_origin < 1):
            raise ValueError("bad pool limits")
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle_per_origin = max_idle_per_origin
        self.max_connections_per_origin = max_connections_per_origin
        self.keepalive_expiry = keepalive_expiry
        self._ssl = ssl_context
        self._loop = asyncio.get_running_loop()
        self._pools: dict[tuple[str, str, int], _OriginPool] = {}
        self._bases: dict[str, tuple[_OriginPool, bytes]] = {}
        self._closed = False

    def _ssl_context(self) -> _ssl.SSLContext:
        if self._ssl is None:
            self._ssl = _ssl.create_default_context()
        return self._ssl

    def _resolve(self, base_url: str) -> tuple[_OriginPool, bytes]:
        hit = self._bases.get(base_url)
        if hit is not None:
            return hit
        parts = urlsplit(base_url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        port = parts.port or (443 if scheme == "https" else 80)
        key = (scheme, parts.hostname, port)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _OriginPool(self, scheme, parts.hostname, port)
        prefix = parts.path.encode()
        if parts.query:
            prefix += b"?" + parts.query.encode()
        if len(self._bases) > 1024:
            self._bases.clear()
        hit = self._bases[base_url] = (pool, prefix)
        return hit

    def pool_stats(self) -> dict[str, dict[str, int]]:
        """Open and idle connections per origin (for tests and debugging)."""
        return {p.name: {"open": p.total, "idle": len(p.idle)} for p in self._pools.values()}

    async def request(
        self,
        method: str,
        base_url: str,
        target: str = "",
        headers: Iterable[tuple[bytes, bytes]] = (),
        body: bytes = b"",
    ) -> Response:
        """Send a request to ``base_url + target``; returns once the response head is in.

        ``headers`` are sent as given, after ``host`` and ``content-length`` (do not pass those).
        """
        if self._closed:
            raise RuntimeError("the client is closed")
        if method == "HEAD":
            raise ValueError("HEAD is not supported")
        pool, prefix = self._resolve(base_url)
        path = prefix + target.encode("latin-1") if target else prefix
        head = [
            b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n"
            % (method.encode(), path or b"/", pool.host_header, len(body))
        ]
        for k, v in headers:
            head += (k, b": ", v, b"\r\n")
        head.append(b"\r\n")
        if body:
            head.append(body)
        data = b"".join(head)
        conn = pool.take_idle()
        if conn is None:
            conn = await pool.acquire()
        resp = Response(conn)
        conn.start(resp, data, self.read_timeout)
        try:
            while not resp._head_done:
                if resp._error is not None:
                    raise resp._error
                await resp._new_waiter()
        except BaseException:
            resp.close()
            raise
        return resp

    async def aclose(self) -> None:
        self._closed = True
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._bases.clear()
