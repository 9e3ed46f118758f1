"""ASGI plumbing for the simulated replica: read a body, wait for the client to go, run work
that stops when the client does."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or ``None`` when the client disconnected first."""
    msg = await receive()
    if msg["type"] != "http.request":
        return None
    body = msg.get("body", b"")
    if not msg.get("more_body", False):
        return body
    parts = [body]
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        parts.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            return b"".join(parts)


async def wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def forever() -> None:
    await asyncio.get_running_loop().create_future()


async def until_disconnect(work: Coroutine[Any, Any, None], receive: Receive) -> None:
    """Run ``work``; if the client disconnects first, cancel it and return quietly."""
    loop = asyncio.get_running_loop()
    task = loop.create_task(work)
    watch = loop.create_task(wait_disconnect(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return
    task.result()  # re-raise SimulatedDisconnect and the like
