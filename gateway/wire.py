"""ASGI and OpenAI wire helpers of the request path: body reading, error responses, usage."""

from __future__ import annotations

import asyncio

import orjson

from .errors import KvgateError, PayloadTooLarge

JSON_HEADERS = [(b"content-type", b"application/json")]


async def read_body(receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError("client went away before sending the body")
        body = message.get("body", b"")
        if body:
            size += len(body)
            if size > limit:
                raise PayloadTooLarge(f"request body larger than {limit} bytes")
            chunks.append(body)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def send_error(send, exc: KvgateError, extra: list[tuple[bytes, bytes]] = ()) -> None:
    body = exc.body()
    headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode()), *extra]
    if exc.retry_after is not None:
        headers.append((b"retry-after", b"%d" % exc.retry_after))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def usage_from_json(body: bytes) -> dict | None:
    try:
        usage = orjson.loads(body).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def usage_from_sse_tail(tail: bytes) -> dict | None:
    """The ``usage`` object of the last SSE event that carries one (include_usage chunks)."""
    idx = tail.rfind(b'"usage":{')
    if idx < 0:
        return None
    start = tail.rfind(b"data: ", 0, idx)
    end = tail.find(b"\n", idx)
    if start < 0:
        return None
    return usage_from_json(tail[start + 6 : end if end >= 0 else len(tail)])


def cached_tokens(usage: dict | None) -> int | None:
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) else None
