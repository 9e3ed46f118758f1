"""The connections of :mod:`gateway.fastclient`: one keep-alive connection (an asyncio Protocol
fed to httptools) and the pool of them per origin.  Behaviour as :mod:`gateway.fastclient`'s
module doc describes it.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
from collections import deque
from typing import TYPE_CHECKING

import httptools

from .fastresponse import (
    ConnectError,
    ConnectTimeout,
    HTTPError,
    PoolTimeout,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    Response,
)

if TYPE_CHECKING:  # annotations only: fastclient imports this module, not the reverse
    from .fastclient import FastClient


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
        resp = self.response
        if resp is None:  # bytes on an idle connection: not HTTP we can use
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._broken(RemoteProtocolError(f"invalid HTTP response from {self.pool.name}: {exc}"))
            return
        if resp._sink is not None:
            resp._drain()

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

