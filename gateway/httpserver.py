"""A lean HTTP/1.1 server for ASGI apps, on asyncio Protocols and httptools (the gateway's default).

Why not uvicorn: at 32 connections the gateway spent about a quarter of its CPU per request inside
uvicorn (the proxy-headers middleware, a regex pair per response header, a scope with every field
rebuilt, and two ``write`` syscalls per response: the head, then the body).  This server does the
same job for what the gateway needs, and no more:

* HTTP/1.1 and 1.0, keep-alive (idle connections closed after ``keep_alive_s`` by one sweep per
  second, not a timer per request), pipelined requests (answered in order), ``Expect:
  100-continue``, request bodies streamed to ``receive`` with read backpressure (reading pauses
  while more than ``max_buffered_body`` bytes wait), write backpressure (``send`` waits while the
  transport's buffer is above its high-water mark).
* A response with a content-length has its head held until the body and written with it in one
  syscall; a streamed one (no length) has its head written at once, so a stream's headers never
  wait for its first event.  Chunked encoding when the app gives no
  content-length; HEAD, 204 and 304 have no body.
* A client that goes away: ``receive`` returns ``http.disconnect`` at once, and later ``send`` calls
  are ignored.  An app that raises before its response starts gets a 500 with an OpenAI-shaped
  JSON body; after it started, the connection is closed (the client sees a truncated response).
* Bad requests (parse errors, headers over ``max_header_bytes``) get a JSON 400 / 431 and a close.
* Lifespan: ``lifespan.startup`` before listening (a failed startup raises from ``serve``),
  ``lifespan.shutdown`` after the drain.  Shutdown (``should_exit``): stop listening, close idle
  connections, let in-flight requests finish for ``graceful_timeout`` seconds (connections close
  after their current response), then cancel what is left (``force_exit`` skips the wait).

It adds no headers of its own (no ``server``/``date``): a proxied response carries the replica's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from .httpconn import HttpConnection
from .lifespan import Lifespan

log = logging.getLogger("kvgate.http")


class FastServer:
    """Serve one ASGI app on ``host:port``; the interface ``ServerGroup`` uses of uvicorn's."""

    def __init__(self, app, host: str, port: int, graceful_timeout: float = 10.0,
                 keep_alive_s: float = 30.0, max_header_bytes: int = 64 * 1024,
                 max_buffered_body: int = 1 << 20, backlog: int = 2048) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.graceful_timeout = graceful_timeout
        self.keep_alive_s = keep_alive_s
        self.max_header_bytes = max_header_bytes
        self.max_buffered_body = max_buffered_body
        self.backlog = backlog
        self.started = False
        self.should_exit = False
        self.force_exit = False
        self.connections: set[HttpConnection] = set()
        self.state: dict = {}
        self.sockname: tuple | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        lifespan = Lifespan(self.app, self.state)
        await lifespan.startup()
        try:
            server = await self.loop.create_server(
                lambda: HttpConnection(self), self.host, self.port, reuse_address=True,
                backlog=self.backlog)
        except BaseException:
            await lifespan.shutdown()
            raise
        self.sockname = server.sockets[0].getsockname()[:2]
        self.started = True
        try:
            ticks = 0
            while not self.should_exit:
                await asyncio.sleep(0.1)
                ticks += 1
                if ticks % 10 == 0:  # idle keep-alive connections: one sweep a second
                    self._close_idle(self.loop.time() - self.keep_alive_s)
        finally:
            await self._drain(server)
            await lifespan.shutdown()

    def _close_idle(self, before: float) -> None:
        for conn in list(self.connections):
            if conn.cycle is None and conn.idle_since < before:
                conn.close_if_idle()

    async def _drain(self, server: asyncio.AbstractServer) -> None:
        server.close()
        for conn in list(self.connections):
            conn.close_if_idle()
        deadline = self.loop.time() + self.graceful_timeout
        while self.connections and not self.force_exit and self.loop.time() < deadline:
            for conn in list(self.connections):
                conn.close_if_idle()  # a connection that finished its last response
            await asyncio.sleep(0.05)
        tasks = [c.task for c in self.connections if c.task is not None]
        if tasks:
            log.warning("shutdown: cancelling %d request(s) still running", len(tasks))
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for conn in list(self.connections):
            conn._close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 1.0)
