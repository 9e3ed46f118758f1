"""A raw loopback replica streaming SSE through kvgate's gateway (tests of the stream path)."""

from __future__ import annotations

import asyncio
import contextlib

from gateway.config import GatewayConfig, ReplicaConfig
from gateway.runner import gateway_spec
from gateway.servers import ServerGroup, free_port


async def read_head(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)
    return head


async def send_event(writer: asyncio.StreamWriter, event: bytes) -> None:
    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
    await writer.drain()


def replica_streaming(stream):
    """A replica answering health checks and scrapes with ``{}`` and each POST with ``stream``
    (``await stream(writer)``: the chunked SSE body; the head is written here)."""

    async def serve(reader, writer):
        while True:
            try:
                head = await read_head(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if not head.startswith(b"POST"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            await stream(writer)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    return serve


@contextlib.asynccontextmanager
async def gateway_in_front_of(stream):
    upstream = await asyncio.start_server(replica_streaming(stream), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{upstream.sockets[0].getsockname()[1]}"
    cfg = GatewayConfig(port=free_port(), replicas=(ReplicaConfig(url, models=("tiny",)),),
                        log_level="warning", policy="round_robin").validate()
    spec = gateway_spec(cfg)
    group = ServerGroup([spec])
    await group.start()
    try:
        yield cfg.port, spec.app
    finally:
        await group.stop()
        upstream.close()
