"""Talking to replicas: header filtering, the upstream clients, and error translation.

The proxy talks to replicas through :class:`UpstreamClient` (``request`` -> :class:`UpstreamResponse`
with ``status``, lower-cased raw ``headers``, ``read_chunk()``, ``aread()``, ``aclose()``), and
catches only :class:`gateway.fastclient.HTTPError`.  Two implementations:

* ``fast`` (default): :class:`gateway.fastclient.FastClient`, asyncio Protocols + httptools.
* ``httpx``: :class:`HttpxUpstream`, httpx with its errors translated into fastclient's hierarchy
  (also what tests with an injected ``httpx`` transport get).

The health checker keeps using a plain ``httpx.AsyncClient`` (:func:`make_client`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import httpx

from . import fastclient as fc
from .errors import KvgateError, UpstreamError, UpstreamTimeout

UPSTREAM_CLIENTS = ("fast", "httpx")

HOP_BY_HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
        b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"host", b"content-length",
    }
)
# Response headers we do not copy: hop-by-hop ones (content-length is kept: bodies pass unchanged).
RESPONSE_DROP = HOP_BY_HOP - {b"content-length"}
RETRYABLE_STATUS = frozenset({502, 503, 504})


def make_client(
    connect_timeout: float,
    read_timeout: float,
    max_connections: int,
    transport: httpx.AsyncBaseTransport | None = None,
) -> httpx.AsyncClient:
    timeout = httpx.Timeout(connect=connect_timeout, read=read_timeout, write=read_timeout, pool=connect_timeout)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max_connections, keepalive_expiry=30)
    return httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport, follow_redirects=False)


class UpstreamResponse(Protocol):
    status: int
    headers: list[tuple[bytes, bytes]]  # names lower-case

    def header(self, name: bytes, default: bytes | None = None) -> bytes | None: ...
    @property
    def complete(self) -> bool: ...  # the whole body has been read
    async def read_chunk(self) -> bytes: ...  # b"" at the end
    async def aread(self) -> bytes: ...
    async def aclose(self) -> None: ...


class UpstreamClient(Protocol):
    async def request(
        self, method: str, base_url: str, target: str = "",
        headers: Iterable[tuple[bytes, bytes]] = (), body: bytes = b"",
        on_sent: Callable[[], None] | None = None,
    ) -> UpstreamResponse: ...
    async def aclose(self) -> None: ...


def _from_httpx(exc: httpx.HTTPError) -> fc.HTTPError:
    msg = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, httpx.ConnectTimeout):
        return fc.ConnectTimeout(msg)
    if isinstance(exc, httpx.PoolTimeout):
        return fc.PoolTimeout(msg)
    if isinstance(exc, httpx.TimeoutException):
        return fc.ReadTimeout(msg)
    if isinstance(exc, httpx.ConnectError):
        return fc.ConnectError(msg)
    if isinstance(exc, httpx.RemoteProtocolError | httpx.LocalProtocolError):
        return fc.RemoteProtocolError(msg)
    return fc.ReadError(msg)


class _HttpxResponse:
    """An ``httpx.Response`` opened with ``stream=True``, seen as an :class:`UpstreamResponse`."""

    __slots__ = ("_resp", "_it", "status", "headers", "_done")

    def __init__(self, resp: httpx.Response) -> None:
        self._resp = resp
        self._it = resp.aiter_raw()
        self.status = resp.status_code
        self.headers = [(k.lower(), v) for k, v in resp.headers.raw]
        self._done = False

    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return default

    @property
    def complete(self) -> bool:
        return self._done

    async def read_chunk(self) -> bytes:
        if self._done:
            return b""
        try:
            while True:
                data = await self._it.__anext__()
                if data:
                    return data
        except StopAsyncIteration:
            self._done = True
            return b""
        except httpx.HTTPError as exc:
            raise _from_httpx(exc) from exc

    async def aread(self) -> bytes:
        parts = []
        while data := await self.read_chunk():
            parts.append(data)
        return b"".join(parts)

    async def aclose(self) -> None:
        self._done = True
        await self._resp.aclose()


class HttpxUpstream:
    """:class:`UpstreamClient` on an ``httpx.AsyncClient`` (which it does not own)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def request(
        self, method: str, base_url: str, target: str = "",
        headers: Iterable[tuple[bytes, bytes]] = (), body: bytes = b"",
        on_sent: Callable[[], None] | None = None,
    ) -> _HttpxResponse:
        if on_sent is not None:
            on_sent()
        try:
            req = self.client.build_request(method, base_url + target, headers=list(headers), content=body)
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise _from_httpx(exc) from exc
        return _HttpxResponse(resp)

    async def aclose(self) -> None:
        """The httpx client belongs to the caller."""


def make_upstream(
    kind: str,
    connect_timeout: float,
    read_timeout: float,
    max_connections: int,
    httpx_client: httpx.AsyncClient | None = None,
) -> UpstreamClient:
    """The proxy's client: ``fast`` or ``httpx`` (the latter wraps ``httpx_client``, or a new one)."""
    if kind == "fast":
        return fc.FastClient(
            connect_timeout=connect_timeout, read_timeout=read_timeout,
            max_idle_per_origin=max_connections, keepalive_expiry=30.0,
        )
    if kind == "httpx":
        return HttpxUpstream(httpx_client or make_client(connect_timeout, read_timeout, max_connections))
    raise ValueError(f"unknown upstream client {kind!r}; use one of {', '.join(UPSTREAM_CLIENTS)}")


def request_headers(raw: list[tuple[bytes, bytes]], request_id: str) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in raw if k not in HOP_BY_HOP and k != b"x-request-id"]
    out.append((b"x-request-id", request_id.encode()))
    return out


def response_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in raw if k.lower() not in RESPONSE_DROP]


_TIMEOUTS = (fc.TimeoutException, httpx.TimeoutException)
_CONNECT = (fc.ConnectError, httpx.ConnectError)
_PROTOCOL = (fc.RemoteProtocolError, httpx.RemoteProtocolError)


def translate(exc: Exception, replica_id: str) -> KvgateError:
    """Turn an upstream client failure (fastclient or httpx) into the gateway's error hierarchy."""
    if isinstance(exc, _TIMEOUTS):
        return UpstreamTimeout(f"replica {replica_id} timed out ({type(exc).__name__})")
    if isinstance(exc, _CONNECT):
        return UpstreamError(f"cannot connect to replica {replica_id}", code="upstream_unreachable")
    return UpstreamError(f"replica {replica_id} failed: {type(exc).__name__}: {exc}")


def error_kind(exc: Exception) -> str:
    if isinstance(exc, _TIMEOUTS):
        return "timeout"
    if isinstance(exc, _CONNECT):
        return "connect"
    if isinstance(exc, _PROTOCOL):
        return "protocol"
    return "io"
