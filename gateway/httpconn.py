"""One client connection of :class:`gateway.httpserver.FastServer`: HTTP/1.1 parsing (httptools),
the ASGI ``receive``/``send`` of each exchange, keep-alive, pipelining and backpressure."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from http import HTTPStatus
from urllib.parse import unquote

import httptools
import orjson

from .lifespan import ASGI

# An ASGI extension of this server: ``scope["extensions"][SEND_NOWAIT](body) -> bool`` writes a
# part of a started, streamed response without a coroutine (see _Cycle.send_body_nowait).
SEND_NOWAIT = "kvgate.send_body_nowait"

log = logging.getLogger("kvgate.http")

_STATUS_LINES = {
    s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus
}
_NO_BODY_STATUS = frozenset({204, 304}) | frozenset(range(100, 200))
_DISCONNECT = {"type": "http.disconnect"}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status


def _error_response(status: int, message: str, code: str) -> bytes:
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error"
                                   if status < 500 else "server_error", "param": None, "code": code}})
    return b"%scontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (
        _status_line(status), len(body), body)


class _Cycle:
    """One request/response exchange: the app's ``receive`` and ``send``."""

    __slots__ = ("conn", "scope", "body", "body_size", "more_body", "waiter", "started",
                 "complete", "chunked", "keep_alive", "head", "expect_continue", "no_body",
                 "remaining", "delivered")

    def __init__(self, conn: HttpConnection, scope: dict, keep_alive: bool, expect: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.body: list[bytes] = []
        self.body_size = 0
        self.more_body = True
        self.waiter: asyncio.Future | None = None
        self.started = False
        self.complete = False
        self.chunked = False
        self.keep_alive = keep_alive
        self.head: bytes | None = None
        self.expect_continue = expect
        self.no_body = False
        self.remaining: int | None = None  # content-length left to send; None: none declared
        self.delivered = False  # the last http.request message went to the app

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def receive(self) -> dict:
        conn = self.conn
        if self.expect_continue and not conn.closed:
            self.expect_continue = False
            conn.transport.write(_CONTINUE)
        while not conn.closed and not self.complete and not self.body and self.more_body:
            self.waiter = conn.loop.create_future()
            await self.waiter
            self.waiter = None
        if conn.closed or self.complete:
            return _DISCONNECT
        if self.delivered:
            # The whole body was read: wait for the end of the exchange (a disconnect watcher).
            self.waiter = conn.loop.create_future()
            await self.waiter
            return _DISCONNECT
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body.clear()
        self.body_size = 0
        self.delivered = not self.more_body
        conn.resume_reading()
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def send(self, message: dict) -> None:
        conn = self.conn
        if conn.closed or self.complete:
            return  # the client is gone, or the response is done: nothing to write
        if conn.write_paused is not None:
            await conn.write_paused
        kind = message["type"]
        if kind == "http.response.start" and not self.started:
            self._start(message["status"], message.get("headers", ()))
            self.started = True
        elif kind == "http.response.body" and self.started:
            self._body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} (response started: {self.started})")

    def send_body_nowait(self, body: bytes) -> bool:
        """Write a part of a started, streamed response now, if that needs no wait: True when
        written (or dropped: the client is gone), False when writes are paused (use ``send``)."""
        conn = self.conn
        if conn.closed or self.complete:
            return True
        if conn.write_paused is not None or not self.started:
            return False
        self._body(body, True)
        return True

    def _start(self, status: int, headers) -> None:
        parts = [_status_line(status)]
        lines = 2  # the status line and the blank line
        length = None
        for name, value in headers:
            lname = name.lower()
            if lname == b"content-length":
                length = int(value)
            elif lname == b"transfer-encoding":
                continue  # the server frames the body itself
            elif lname == b"connection" and b"close" in value.lower():
                self.keep_alive = False
            parts += (name, b": ", value, b"\r\n")
            lines += 1
        if self.conn.server.should_exit:
            self.keep_alive = False  # shutting down: this connection ends with this response
        self.no_body = self.scope["method"] == "HEAD" or status in _NO_BODY_STATUS
        if self.no_body:
            pass
        elif length is not None:
            self.remaining = length
        elif self.scope["http_version"] == "1.0":
            self.keep_alive = False  # no chunked encoding in HTTP/1.0: the close ends the body
        else:
            self.chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
            lines += 1
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
            lines += 1
        parts.append(b"\r\n")
        head = b"".join(parts)
        if head.count(b"\n") != lines:  # no response splitting through a header value
            raise RuntimeError("a response header contains a line break")
        if length is None:  # streamed: the client sees the head before any event exists
            self.conn.transport.write(head)
        else:  # the body follows (it makes the response): head and body leave in one write
            self.head = head

    def _body(self, body: bytes, more: bool) -> None:
        if self.no_body:
            data = b""
        elif self.chunked:
            data = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
            if not more:
                data += b"0\r\n\r\n"
        else:
            if self.remaining is not None:
                self.remaining -= len(body)
                if self.remaining < 0:
                    raise RuntimeError("response body longer than its content-length")
            data = body
        head = self.head
        if head is not None:
            self.head = None
            data = head + data if data else head
        if data:
            self.conn.transport.write(data)
        if not more:
            if self.remaining:
                raise RuntimeError("response body shorter than its content-length")
            self.complete = True
            self.wake()
            self.conn.response_done(self)


class HttpConnection(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server) -> None:
        self.server = server
        self.app = server.app
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.cycle: _Cycle | None = None  # the exchange being answered
        self.pipeline: deque[_Cycle] = deque()  # parsed, waiting for the one before to finish
        self.parsing: _Cycle | None = None  # the request the parser is reading
        self.task: asyncio.Task | None = None
        self.write_paused: asyncio.Future | None = None
        self.read_paused = False
        self.idle_since = self.loop.time()
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._header_bytes = 0
        self.client: tuple | None = None

    # -- transport events
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.client = transport.get_extra_info("peername")
        self.server.connections.add(self)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.server.connections.discard(self)
        for c in (self.cycle, self.parsing, *self.pipeline):
            if c is not None:
                c.wake()
        if self.write_paused is not None and not self.write_paused.done():
            self.write_paused.set_result(None)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # Upgrade (h2c, websocket) is not offered: the request is answered as HTTP/1.1
        except httptools.HttpParserError as exc:  # also what a raising callback becomes
            if self._header_bytes > self.server.max_header_bytes:
                self._reject(431, "request headers too large", "headers_too_large")
            else:
                self._reject(400, f"malformed HTTP request: {exc}", "bad_request")

    def pause_writing(self) -> None:
        if self.write_paused is None:
            self.write_paused = self.loop.create_future()

    def resume_writing(self) -> None:
        w, self.write_paused = self.write_paused, None
        if w is not None and not w.done():
            w.set_result(None)

    def resume_reading(self) -> None:
        if self.read_paused and not self.closed:
            self.read_paused = False
            self.transport.resume_reading()

    def _reject(self, status: int, message: str, code: str) -> None:
        if not self.closed:
            if self.cycle is None or not self.cycle.started:
                self.transport.write(_error_response(status, message, code))
            self.transport.close()
            self.closed = True

    # -- parser callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._header_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > self.server.max_header_bytes:
            raise ValueError("request headers too large")
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        url = self._url
        if url[:1] == b"/" and b"%" not in url and b"?" not in url:
            raw_path, query = url, b""
        else:
            parsed = httptools.parse_url(url)
            raw_path, query = parsed.path or b"/", parsed.query or b""
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = unquote(raw_path.decode("ascii", "replace"))
        server = self.server
        scope = {
            "type": "http", "asgi": ASGI, "http_version": parser.get_http_version(),
            "server": server.sockname, "client": self.client, "scheme": "http",
            "method": parser.get_method().decode("ascii"), "root_path": "", "path": path,
            "raw_path": raw_path, "query_string": query, "headers": self._headers,
            "state": server.state.copy(),
        }
        expect = any(k == b"expect" and v.lower() == b"100-continue" for k, v in self._headers)
        keep_alive = parser.should_keep_alive() and not server.should_exit
        cycle = _Cycle(self, scope, keep_alive, expect)
        scope["extensions"] = {SEND_NOWAIT: cycle.send_body_nowait}
        self.parsing = cycle
        if self.cycle is None:
            self._run(cycle)
        else:
            self.pipeline.append(cycle)
            if not self.read_paused:  # read no further until the queue moves
                self.read_paused = True
                self.transport.pause_reading()

    def on_body(self, body: bytes) -> None:
        cycle = self.parsing
        if cycle is None or cycle.complete:
            return
        cycle.body.append(body)
        cycle.body_size += len(body)
        if cycle.body_size > self.server.max_buffered_body and not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        cycle = self.parsing
        if cycle is not None:
            cycle.more_body = False
            cycle.wake()
        self.parsing = None

    # -- the app
    def _run(self, cycle: _Cycle) -> None:
        self.cycle = cycle
        self.task = self.loop.create_task(self._run_asgi(cycle))

    async def _run_asgi(self, cycle: _Cycle) -> None:
        try:
            await self.app(cycle.scope, cycle.receive, cycle.send)
        except BaseException as exc:  # noqa: BLE001 - an app error must not kill the connection loop
            if isinstance(exc, asyncio.CancelledError):
                self._close()
                raise
            log.exception("ASGI app failed on %s %s", cycle.scope["method"], cycle.scope["path"])
            if not cycle.started and not self.closed:
                self.transport.write(_error_response(500, "internal server error", "internal_error"))
            self._close()
            return
        finally:
            # The scope's extension is a bound method of the cycle: drop it, or every exchange is a
            # reference cycle (cycle -> scope -> method -> cycle) left for the cyclic GC.
            cycle.scope.pop("extensions", None)
        if not cycle.complete:
            if not cycle.started and not self.closed:
                log.error("ASGI app returned without a response on %s", cycle.scope["path"])
                self.transport.write(_error_response(500, "no response", "internal_error"))
            self._close()

    def response_done(self, cycle: _Cycle) -> None:
        self.cycle = None
        self.task = None
        if not cycle.keep_alive or self.server.should_exit and not self.pipeline:
            self._close()
            return
        self.idle_since = self.loop.time()
        if self.pipeline:
            self._run(self.pipeline.popleft())
        self.resume_reading()

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()

    def close_if_idle(self) -> bool:
        if self.cycle is None and self.parsing is None and not self.pipeline:
            self._close()
            return True
        return False
