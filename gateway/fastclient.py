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

Layout: the errors and :class:`Response` live in :mod:`gateway.fastresponse`, the connection and
the per-origin pool in :mod:`gateway.fastpool`; every public name is importable from here.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from .fastpool import _OriginPool
from .fastresponse import (
    HIGH_WATER,  # noqa: F401  (re-exported, as are the errors and Response)
    LOW_WATER,  # noqa: F401
    ConnectError,
    ConnectTimeout,
    HTTPError,
    PoolTimeout,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    Response,
    TimeoutException,
)

__all__ = [
    "FastClient", "Response", "HTTPError", "ConnectError", "TimeoutException", "ConnectTimeout",
    "ReadTimeout", "PoolTimeout", "RemoteProtocolError", "ReadError",
]


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
        on_sent: Callable[[], None] | None = None,
    ) -> Response:
        """Send a request to ``base_url + target``; returns once the response head is in.

        ``headers`` are sent as given, after ``host`` and ``content-length`` (do not pass those).
        ``on_sent`` is called once the request is written, or before the first wait for a
        connection, whichever comes first: never after another task has run.
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
            if on_sent is not None:
                on_sent()
                on_sent = None
            conn = await pool.acquire()
        resp = Response(conn)
        conn.start(resp, data, self.read_timeout)
        if on_sent is not None:  # the bytes are on their way: bookkeeping off the critical path
            on_sent()
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
