"""The stream relay (gateway/relay.py) through kvgate's own server, against raw loopback replicas:
the direct path (bytes written to the client inside the upstream read) and the task path it falls
back to when the client reads slowly must deliver the same bytes, in order, with backpressure
reaching the replica."""

from __future__ import annotations

import asyncio
import socket

import orjson

from gateway import relay
from tests.sse_replica import gateway_in_front_of, send_event

CHAT = b"/v1/chat/completions"
USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12,
         "prompt_tokens_details": {"cached_tokens": 4}}


def events(n: int, pad: int) -> list[bytes]:
    out = [b"data: " + orjson.dumps({"i": i, "choices": [{"delta": {"content": "x" * pad}}]}) + b"\n\n"
           for i in range(n)]
    out.append(b"data: " + orjson.dumps({"choices": [], "usage": USAGE}) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def request() -> bytes:
    body = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                         "stream": True})
    return (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (CHAT, len(body), body))


def dechunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response (asserting its framing)."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    out = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert rest == b"\r\n"
            return b"".join(out)
        out.append(rest[:size])
        assert rest[size : size + 2] == b"\r\n"
        rest = rest[size + 2 :]


async def read_response(reader: asyncio.StreamReader, raw: bytes = b"") -> bytes:
    """``raw`` and what follows it, up to the end of a chunked body."""
    while not raw.endswith(b"\r\n0\r\n\r\n"):
        data = await reader.read(1 << 16)
        assert data, "the gateway closed the connection mid-response"
        raw += data
    return raw


class Counting:
    """Wraps StreamRelay._sink: how many pieces it took and refused."""

    def __init__(self, monkeypatch) -> None:
        self.took = self.refused = 0
        original = relay.StreamRelay._sink

        def sink(inner, chunk: bytes) -> bool:
            ok = original(inner, chunk)
            if ok:
                self.took += 1
            else:
                self.refused += 1
            return ok

        monkeypatch.setattr(relay.StreamRelay, "_sink", sink)


async def test_events_written_one_by_one_take_the_direct_path_unchanged(monkeypatch):
    counting = Counting(monkeypatch)
    sse = events(40, 16)
    step = asyncio.Event()

    async def replica(writer):
        for e in sse:
            await send_event(writer, e)
            await step.wait()  # one event per read on the gateway's side
            step.clear()

    async with gateway_in_front_of(replica) as (port, app):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request())
        got = b""
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        for e in sse:  # each event reaches the client before the replica sends the next
            while e not in got:
                data = await reader.read(1 << 16)
                assert data
                got += data
            step.set()
        got = await read_response(reader, got)
        writer.close()
        body = dechunk(head + got)
        assert body == b"".join(sse)
        assert counting.took >= len(sse) - 2  # all but the end went the direct way
        assert counting.refused == 0


async def test_a_slow_client_pauses_the_replica_and_still_gets_every_byte_in_order(monkeypatch):
    counting = Counting(monkeypatch)
    sse = events(3000, 2000)  # ~6 MB: far beyond the socket buffers and the 1 MiB read limit
    sent = asyncio.Event()
    stalled = asyncio.Event()

    async def replica(writer):
        for e in sse:
            writer.write(b"%x\r\n%s\r\n" % (len(e), e))
            transport = writer.transport
            if transport.get_write_buffer_size() >= transport.get_write_buffer_limits()[1]:
                stalled.set()  # the socket is full: the gateway stopped reading the replica
            await writer.drain()
        sent.set()

    async with gateway_in_front_of(replica) as (port, _app):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 14)
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(request())
        await asyncio.wait_for(stalled.wait(), 30)  # nobody reads the client's socket yet
        assert not sent.is_set()
        raw = await asyncio.wait_for(read_response(reader), 60)
        writer.close()
        assert sent.is_set()
        assert dechunk(raw) == b"".join(sse)
        assert counting.refused >= 1  # the client's pause moved the relay to the task path
        assert counting.took >= 1


async def test_direct_path_feeds_usage_and_time_to_first_token_to_the_metrics(monkeypatch):
    counting = Counting(monkeypatch)
    sse = events(5, 8)
    step = asyncio.Event()

    async def replica(writer):
        for e in sse:
            await send_event(writer, e)
        await step.wait()  # the terminator in a read of its own: every event went directly

    async with gateway_in_front_of(replica) as (port, app):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request())
        raw = b""
        while b"[DONE]" not in raw:
            raw += await reader.read(1 << 16)
        step.set()
        raw = await read_response(reader, raw)
        assert dechunk(raw) == b"".join(sse)
        writer.write(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        metrics = (await reader.readexactly(length)).decode()
        writer.close()
        assert counting.refused == 0 and counting.took >= 1
        assert 'kvgate_requests_total{route="/v1/chat/completions",status="200"} 1.0' in metrics
        assert 'kvgate_actual_cached_tokens_total{policy="round_robin"} 4.0' in metrics
        assert 'kvgate_time_to_first_token_seconds_count{route="/v1/chat/completions"} 1.0' in metrics
        assert app.state.proxy.open_streams == 0
