"""Talking to replicas: header filtering, the httpx client, and error translation."""

from __future__ import annotations

import httpx

from .errors import KvgateError, UpstreamError, UpstreamTimeout

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


def request_headers(raw: list[tuple[bytes, bytes]], request_id: str) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in raw if k not in HOP_BY_HOP and k != b"x-request-id"]
    out.append((b"x-request-id", request_id.encode()))
    return out


def response_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in raw if k.lower() not in RESPONSE_DROP]


def translate(exc: Exception, replica_id: str) -> KvgateError:
    """Turn an httpx failure into the gateway's error hierarchy."""
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"replica {replica_id} timed out ({type(exc).__name__})")
    if isinstance(exc, httpx.ConnectError):
        return UpstreamError(f"cannot connect to replica {replica_id}", code="upstream_unreachable")
    return UpstreamError(f"replica {replica_id} failed: {type(exc).__name__}: {exc}")


def error_kind(exc: Exception) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.ConnectError):
        return "connect"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "protocol"
    return "io"
