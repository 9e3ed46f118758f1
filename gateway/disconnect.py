"""Client-disconnect watching for the proxy's requests, started only for requests that run a while.

A disconnect is watched for (a task reading ASGI ``receive``) only once a request has run
``after_s``: most short requests finish first, and skip the task.  One timer sweeps the running
requests (in start order) instead of a timer per request.  A request is any object with the
``finished`` and ``watcher`` attributes of a ``gateway.exchange.Exchange``, used as a dict key.

The proxy registers and forgets each request inline (``Proxy._forward``), on :attr:`pending`,
:attr:`sweeper` and :attr:`loop`: no method call per request on the hot path.

A watcher is never cancelled: ASGI's ``receive`` returns ``http.disconnect`` once the response is
complete or the connection is closed (kvgate's server, uvicorn), and one of the two ends every
request, so the watcher sees ``finished`` and returns.  Cancelling it instead left a reference
cycle per request (the task keeps its ``CancelledError``, whose traceback holds the watcher's
frame, which holds the exchange, which holds the task) for the cyclic GC to find: about 45
objects a request, and the gateway's gen-1 collections.
"""

from __future__ import annotations

import asyncio


class DisconnectWatch:
    """The running requests not watched yet, and the timer that starts their watchers."""

    __slots__ = ("after_s", "pending", "sweeper", "loop")

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        # Running, no watcher yet: exchange -> (receive, task, t0), in start order.  A request is
        # added with ``pending[ex] = (receive, task, loop.time())`` (and, when ``sweeper`` is None,
        # ``sweeper = loop.call_later(after_s, sweep)``); once over, it is set ``finished`` and
        # popped (its ``watcher``, if any, returns on the response's end).
        self.pending: dict = {}
        self.sweeper: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def bind_loop(self) -> asyncio.AbstractEventLoop:
        self.loop = asyncio.get_running_loop()
        return self.loop

    def sweep(self) -> None:
        """Timer: start a disconnect watcher for each request running longer than the threshold."""
        self.sweeper = None
        loop = self.loop
        cutoff = loop.time() - self.after_s
        due = []
        for ex, (_, _, t0) in self.pending.items():  # oldest first
            if t0 > cutoff:
                break
            due.append(ex)
        for ex in due:
            receive, task, _ = self.pending.pop(ex)
            if not ex.finished and ex.watcher is None:
                ex.watcher = loop.create_task(_watch_disconnect(receive, task, ex))
        if self.pending:
            first = next(iter(self.pending.values()))[2]
            delay = max(first + self.after_s - loop.time(), 0.001)
            self.sweeper = loop.call_later(delay, self.sweep)


def client_gone(ex) -> bool:
    """True when ``ex``'s watcher saw the client disconnect and cancelled the request."""
    watcher = ex.watcher
    return watcher is not None and watcher.done() and not watcher.cancelled() and watcher.result() is True


async def _watch_disconnect(receive, task: asyncio.Task, ex) -> bool:
    """Cancel ``task`` when the client disconnects mid-request; returns True if it did."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if ex.finished:
                return False
            task.cancel()
            return True
