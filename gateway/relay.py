"""Relaying a replica's event stream to the client, and what the gateway learns on the way.

Two paths carry the same bytes with the same bookkeeping (time to first token, inter-token
latency, the tail the ``usage`` is read from, ``[DONE]`` as the logical end, and with ``keep``
every piece, from which ``gateway.turns`` reads the answer):

* the task path: ``await resp.read_chunk()`` then ``await send(...)`` per piece, for any
  :class:`~gateway.upstream.UpstreamResponse` and any ASGI server;
* the direct path: when the upstream response takes a *sink* (``gateway.fastclient``) and the
  server offers a write that needs no wait (kvgate's own server, ``scope["extensions"]
  ["kvgate.send_body_nowait"]``), every read from the replica is written to the client inside the
  connection's ``data_received``: no future, no task switch, no ``send`` coroutine per event.
  The relaying task sleeps until the response ends, fails, or the client's writes pause (the sink
  refuses a piece); then the task path takes over the pieces left (with backpressure) and hands
  back to the sink once the client drains.

The last piece always takes the task path, so the end of the replica's body and the end of the
client's stream leave in one write.
"""

from __future__ import annotations

from collections.abc import Callable

from .httpconn import SEND_NOWAIT
from .turns import MAX_CAPTURE_BYTES

SSE_DONE = b"data: [DONE]\n\n"
TAIL_BYTES = 4096


class StreamRelay:
    """One streamed response: ``await StreamRelay(...).run()`` relays it to the end."""

    __slots__ = ("resp", "send", "nowait", "ex", "clock", "itl", "last", "tail", "first", "kept",
                 "kept_bytes")

    def __init__(self, resp, send, scope, ex, clock: Callable[[], float], itl, first=None,
                 keep: bool = False) -> None:  # fmt: skip
        self.resp = resp
        self.send = send
        ext = scope.get("extensions")
        self.nowait = ext.get(SEND_NOWAIT) if ext and hasattr(resp, "sink_until_done") else None
        self.ex = ex
        self.clock = clock
        self.itl = itl  # a histogram child: .observe(seconds)
        self.last: float | None = None
        self.tail = b""
        self.first = first  # called with ``ex`` at the first piece (the first token)
        # With ``keep``: every piece, for the answer (gateway/turns.py); None past the limit.
        self.kept: list[bytes] | None = [] if keep else None
        self.kept_bytes = 0

    def _seen(self, chunk: bytes) -> None:
        """Bookkeeping for one piece about to be written to the client."""
        now = self.clock()
        if self.last is None:
            self.ex.ttft = now - self.ex.started
            if self.first is not None:
                self.first(self.ex)
        else:
            self.itl.observe(now - self.last)
        self.last = now
        kept = self.kept
        if kept is not None:
            self.kept_bytes += len(chunk)
            if self.kept_bytes <= MAX_CAPTURE_BYTES:
                kept.append(chunk)
            else:
                self.kept = None
        tail = self.tail
        self.tail = (tail + chunk)[-TAIL_BYTES:] if tail else chunk[-TAIL_BYTES:]
        if self.tail.endswith(SSE_DONE):
            # The stream's logical end: clients (the openai SDK) hang up on [DONE] without
            # waiting for the replica's chunk terminator; that is no abort to cancel.
            self.ex.finished = True

    def _sink(self, chunk: bytes) -> bool:
        """The direct path: called by the connection with what one read brought."""
        if not self.nowait(chunk):
            return False  # the client's writes are paused: the task path takes this piece
        self._seen(chunk)
        return True

    async def run(self) -> bool:
        """Relay to the end; True when the client's stream was ended with the replica's last
        bytes (False: the caller still has to end it).  Raises the upstream client's errors."""
        resp = self.resp
        send = self.send
        while True:
            if self.nowait is not None and not resp.complete:
                await resp.sink_until_done(self._sink)
            chunk = await resp.read_chunk()
            if not chunk:
                return False
            if resp.complete:  # the replica is done: end the client's stream in the same write
                self._seen(chunk)
                self.ex.finished = True
                await send({"type": "http.response.body", "body": chunk, "more_body": False})
                return True
            self._seen(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
