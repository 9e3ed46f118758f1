"""A tiny OpenAI-shaped mock replica on raw asyncio Protocols, for proxy benchmarks.

It answers instantly with fixed bytes so that a benchmark measures the proxy in front of it, not
the replica: ``kvgate sim`` (a uvicorn app with a tokenizer and a prefix cache) costs about
60-80 us of CPU per request here, this one a fraction of that.

* ``POST /v1/chat/completions`` and ``/v1/completions``: a fixed ``chat.completion`` JSON body
  (with ``usage``), or, when the body says ``"stream": true``, a chunked ``text/event-stream`` of
  ``chunks`` SSE events (role, content tokens, finish + ``data: [DONE]``).  With ``spread`` (the
  default) each event is its own ``write`` on its own event-loop iteration, as a real engine sends
  tokens; ``burst`` writes them back to back in one callback.
* ``GET /health`` (200), ``GET /v1/models``, ``GET /metrics`` (empty), anything else 404.

Keep-alive and pipelined requests are honoured (responses go out in request order).

Run: ``python -m gateway.bench.mock_upstream --port 9101 --replicas 2`` (ports 9101, 9102); it
prints ``ready`` when listening and stops on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections import deque
from dataclasses import dataclass

import httptools
import orjson

MODEL = "tiny"
_STREAM_MARKERS = (b'"stream":true', b'"stream": true')


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@dataclass(frozen=True)
class MockResponses:
    """Every response as ready-to-write bytes."""

    json: bytes
    stream_head: bytes
    stream_chunks: tuple[bytes, ...]
    health: bytes
    models: bytes
    metrics: bytes
    not_found: bytes

    @classmethod
    def build(cls, chunks: int = 16, model: str = MODEL) -> MockResponses:
        if chunks < 2:
            raise ValueError("chunks must be >= 2 (role chunk and final chunk)")
        words = [f" tok{i}" for i in range(chunks - 2)]
        body = orjson.dumps(
            {
                "id": "chatcmpl-mock", "object": "chat.completion", "created": 1700000000,
                "model": model,
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "".join(words)},
                     "logprobs": None, "finish_reason": "length"}
                ],
                "usage": {"prompt_tokens": 16, "completion_tokens": len(words),
                          "total_tokens": 16 + len(words), "prompt_tokens_details": {"cached_tokens": 0}},
            }
        )

        def event(delta: dict, finish: str | None = None) -> bytes:
            obj = {
                "id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1700000000,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }
            return b"data: " + orjson.dumps(obj) + b"\n\n"

        events = [event({"role": "assistant", "content": ""})]
        events += [event({"content": w}) for w in words]
        events.append(event({}, "length") + b"data: [DONE]\n\n")
        framed = [_chunk(e) for e in events]
        framed[-1] += b"0\r\n\r\n"
        return cls(
            json=_plain(200, body, b"application/json"),
            stream_head=(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
            ),
            stream_chunks=tuple(framed),
            health=_plain(200, b"", b"application/json"),
            models=_plain(200, orjson.dumps(
                {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "mock"}]}
            ), b"application/json"),
            metrics=_plain(200, b"", b"text/plain; version=0.0.4"),
            not_found=_plain(404, b'{"error":{"message":"not found","type":"invalid_request_error"}}',
                             b"application/json"),
        )


def _plain(status: int, body: bytes, ctype: bytes) -> bytes:
    reason = {200: b"OK", 404: b"Not Found"}[status]
    return b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        status, reason, ctype, len(body), body
    )


class MockProtocol(asyncio.Protocol):
    """One client connection to the mock replica."""

    def __init__(self, responses: MockResponses, spread: bool) -> None:
        self.r = responses
        self.spread = spread
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.pending: deque[tuple[bytes, bytes, bytes]] = deque()  # (method, url, body)
        self.streaming = False
        self.stream_pos = 0
        self.close_after = False
        self.loop = asyncio.get_running_loop()

    # -- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(_plain(404, b"", b"text/plain"))
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.transport = None

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if not self.parser.should_keep_alive():
            self.close_after = True
        self.pending.append((self.parser.get_method(), self.url, b"".join(self.body)))
        if not self.streaming:
            self._serve()

    # -- responses
    def _serve(self) -> None:
        while self.pending and self.transport is not None:
            method, url, body = self.pending.popleft()
            path = url.split(b"?", 1)[0]
            if method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
                if any(m in body for m in _STREAM_MARKERS):
                    self._start_stream()
                    return
                self.transport.write(self.r.json)
            elif path == b"/health":
                self.transport.write(self.r.health)
            elif path == b"/v1/models":
                self.transport.write(self.r.models)
            elif path == b"/metrics":
                self.transport.write(self.r.metrics)
            else:
                self.transport.write(self.r.not_found)
        self._maybe_close()

    def _maybe_close(self) -> None:
        if self.close_after and not self.pending and self.transport is not None:
            self.transport.close()

    def _start_stream(self) -> None:
        self.streaming = True
        self.transport.write(self.r.stream_head)
        if not self.spread:
            for c in self.r.stream_chunks:
                self.transport.write(c)
            self.streaming = False
            self._serve()
            return
        self.stream_pos = 0
        self.loop.call_soon(self._next_chunk)

    def _next_chunk(self) -> None:
        if self.transport is None:
            return
        chunks = self.r.stream_chunks
        self.transport.write(chunks[self.stream_pos])
        self.stream_pos += 1
        if self.stream_pos < len(chunks):
            self.loop.call_soon(self._next_chunk)
            return
        self.streaming = False
        self._serve()


async def serve(
    host: str, ports: list[int], chunks: int = 16, spread: bool = True
) -> list[asyncio.AbstractServer]:
    """Start one mock replica per port on the running loop; returns the servers."""
    responses = MockResponses.build(chunks)
    loop = asyncio.get_running_loop()
    servers = []
    for port in ports:
        srv = await loop.create_server(
            lambda: MockProtocol(responses, spread), host, port, reuse_address=True, backlog=1024
        )
        servers.append(srv)
    return servers


async def _main(args: argparse.Namespace) -> None:
    ports = [args.port + i for i in range(args.replicas)]
    servers = await serve(args.host, ports, args.chunks, args.mode == "spread")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    print("ready " + " ".join(f"http://{args.host}:{p}" for p in ports), flush=True)
    await stop.wait()
    for s in servers:
        s.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.bench.mock_upstream", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9101, help="first port (default 9101)")
    p.add_argument("--replicas", type=int, default=2, help="replicas on consecutive ports (default 2)")
    p.add_argument("--chunks", type=int, default=16, help="SSE events per streamed response (default 16)")
    p.add_argument("--mode", choices=("spread", "burst"), default="spread",
                   help="spread: one event per loop iteration (default); burst: all in one callback")
    args = p.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        uvloop = None
    runner = uvloop.run if uvloop is not None else asyncio.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
