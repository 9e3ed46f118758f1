"""gateway.fastclient against real loopback servers: a simulated replica (uvicorn) and raw asyncio
servers that send chunked, close-delimited, slow, stalled and broken responses."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import ssl
import subprocess

import orjson
import pytest

from gateway import fastclient as fc
from gateway.servers import ServerGroup, free_port
from gateway.sim.config import SimConfig
from gateway.sim.runner import sim_specs

CHAT = "/v1/chat/completions"


def chat(stream: bool = False, max_tokens: int = 8) -> bytes:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens}
    if stream:
        body["stream"] = True
    return orjson.dumps(body)


JSON = [(b"content-type", b"application/json")]


# ---------------------------------------------------------------------------------- helpers
async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """(head, body) of the next request, or None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = await reader.readexactly(length) if length else b""
    return head, body


def response(body: bytes, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n%s\r\n%s" % (
        status, len(body), extra, body
    )


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@contextlib.asynccontextmanager
async def raw_server(handler):
    """A TCP server running ``handler(reader, writer)`` per connection; yields (url, writers)."""
    writers: list[asyncio.StreamWriter] = []
    tasks: set[asyncio.Task] = set()

    async def on_conn(reader, writer):
        writers.append(writer)
        tasks.add(asyncio.current_task())
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", writers
    finally:
        srv.close()
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def keepalive_handler(reader, writer):
    n = 0
    while (req := await read_request(reader)) is not None:
        n += 1
        writer.write(response(b"answer %d to %d bytes" % (n, len(req[1]))))
        await writer.drain()


async def until(cond, limit: int = 10000) -> None:
    """Yield to the event loop until ``cond()`` holds (no timed sleeps)."""
    for _ in range(limit):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


@pytest.fixture
async def client():
    c = fc.FastClient(connect_timeout=2.0, read_timeout=5.0)
    yield c
    await c.aclose()


# ---------------------------------------------------------------------------------- against the simulator
@pytest.fixture
async def sim_url():
    port = free_port()
    group = ServerGroup(sim_specs(1, "127.0.0.1", port, SimConfig(decode_s_per_token=0.001)))
    await group.start()
    yield f"http://127.0.0.1:{port}"
    await group.stop()


async def test_on_sent_runs_once_before_any_wait(client, sim_url):
    """``on_sent`` (the proxy's policy bookkeeping) runs exactly once per request and before this
    task lets another run: before connecting when no connection is idle, after the write when one is."""
    seen: list[dict] = []

    def sent() -> None:
        stats = client.pool_stats()
        seen.append(next(iter(stats.values())) if stats else {"open": 0, "idle": 0})

    r = await client.request("POST", sim_url, CHAT, JSON, chat(), on_sent=sent)
    await r.aread()
    assert seen == [{"open": 0, "idle": 0}]  # no connection yet: called before connecting
    r = await client.request("POST", sim_url, CHAT, JSON, chat(), on_sent=sent)
    await r.aread()
    assert seen[1] == {"open": 1, "idle": 0}  # the idle connection was taken and written to
    assert len(seen) == 2


async def test_sim_json_and_stream_reuse_one_connection(client, sim_url):
    r = await client.request("POST", sim_url, CHAT, JSON, chat())
    assert r.status == 200 and r.header(b"content-type") == b"application/json"
    body = orjson.loads(await r.aread())
    assert body["usage"]["completion_tokens"] == 8
    r = await client.request("POST", sim_url, CHAT, JSON, chat(stream=True, max_tokens=12))
    assert r.status == 200 and r.header(b"content-type").startswith(b"text/event-stream")
    pieces = []
    while data := await r.read_chunk():
        pieces.append(data)
    assert r.complete
    events = [ln for ln in b"".join(pieces).split(b"\n") if ln.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]" and len(events) == 1 + 12 + 1 + 1  # role, tokens, final, DONE
    assert len(pieces) > 1  # a token every millisecond: the body came in several pieces
    for _ in range(3):
        await (await client.request("GET", sim_url, "/health")).aread()
    assert client.pool_stats()[sim_url.split("://")[1]] == {"open": 1, "idle": 1}


async def test_headers_are_lower_case_and_the_request_is_sent_as_given(client):
    seen = {}

    async def handler(reader, writer):
        req = await read_request(reader)
        seen["head"], seen["body"] = req
        writer.write(b"HTTP/1.1 201 Created\r\nX-Thing: A b\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as (url, _):
        r = await client.request("POST", url + "/base", "/v1/x?q=1", [(b"x-custom", b"v")], b"hello")
        assert (r.status, r.headers, await r.aread()) == (201, [(b"x-thing", b"A b"), (b"content-length", b"2")], b"ok")
    lines = seen["head"].split(b"\r\n")
    assert lines[0] == b"POST /base/v1/x?q=1 HTTP/1.1"
    assert b"x-custom: v" in lines and b"content-length: 5" in lines
    assert any(ln.startswith(b"host: 127.0.0.1:") for ln in lines)
    assert seen["body"] == b"hello"


# ---------------------------------------------------------------------------------- bodies
async def test_chunks_are_yielded_as_they_arrive(client):
    """The server sends the second chunk only after the client got the first one."""
    got_first = asyncio.Event()

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(b"first"))
        await writer.drain()
        await got_first.wait()
        writer.write(chunk(b"second") + b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as (url, _):
        r = await client.request("POST", url, "/", body=b"x")
        assert await r.read_chunk() == b"first"
        assert not r.complete
        got_first.set()
        assert await r.read_chunk() == b"second"
        assert await r.read_chunk() == b""
        assert r.complete


async def test_close_delimited_body(client):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\npart one, ")
        await writer.drain()
        writer.write(b"part two")
        await writer.drain()
        writer.close()

    async with raw_server(handler) as (url, _):
        r = await client.request("GET", url, "/")
        assert await r.aread() == b"part one, part two"
        await until(lambda: client.pool_stats()[url.split("://")[1]]["open"] == 0)


async def test_keep_alive_reuses_the_connection_and_connection_close_does_not(client):
    async with raw_server(keepalive_handler) as (url, writers):
        for i in range(1, 4):
            r = await client.request("POST", url, "/", body=b"abc")
            assert await r.aread() == b"answer %d to 3 bytes" % i
        assert len(writers) == 1

    async def closing(reader, writer):
        await read_request(reader)
        writer.write(response(b"bye", extra=b"Connection: close\r\n"))
        await writer.drain()
        await reader.read()

    async with raw_server(closing) as (url, writers):
        for _ in range(2):
            assert await (await client.request("GET", url, "/")).aread() == b"bye"
        assert len(writers) == 2


async def test_large_body_with_a_slow_reader_is_paused_and_resumed(client):
    blob = bytes(range(256)) * (12 * 1024)  # 3 MiB: over the high-water mark

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(response(blob))
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as (url, _):
        r = await client.request("GET", url, "/")
        await until(lambda: r._paused)  # the client stopped reading the socket
        assert await r.aread() == blob


async def test_interim_1xx_response_is_skipped(client):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + response(b"final"))
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as (url, _):
        r = await client.request("POST", url, "/", body=b"x")
        assert r.status == 200 and await r.aread() == b"final"


# ---------------------------------------------------------------------------------- the pool
async def test_half_read_response_discards_its_connection(client):
    release = asyncio.Event()

    async def handler(reader, writer):
        while await read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(b"one"))
            await writer.drain()
            await release.wait()
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async with raw_server(handler) as (url, writers):
        r = await client.request("GET", url, "/")
        assert await r.read_chunk() == b"one"
        await r.aclose()
        assert client.pool_stats()[url.split("://")[1]] == {"open": 0, "idle": 0}
        release.set()
        r = await client.request("GET", url, "/")
        assert await r.aread() == b"one"
        assert len(writers) == 2


async def test_idle_connection_closed_by_the_server_is_replaced(client):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(response(b"once"))
        await writer.drain()
        writer.close()  # an idle keep-alive connection the server gives up on

    async with raw_server(handler) as (url, writers):
        assert await (await client.request("GET", url, "/")).aread() == b"once"
        await until(lambda: client.pool_stats()[url.split("://")[1]]["open"] == 0)
        assert await (await client.request("GET", url, "/")).aread() == b"once"
        assert len(writers) == 2


async def test_connection_cap_waits_for_a_free_connection_then_times_out():
    client = fc.FastClient(connect_timeout=0.3, read_timeout=5.0, max_connections_per_origin=1)
    release = asyncio.Event()

    async def handler(reader, writer):
        while await read_request(reader) is not None:
            await release.wait()
            writer.write(response(b"done"))
            await writer.drain()

    try:
        async with raw_server(handler) as (url, writers):
            first = asyncio.ensure_future(client.request("GET", url, "/"))
            await until(lambda: client.pool_stats().get(url.split("://")[1], {}).get("open") == 1)
            with pytest.raises(fc.PoolTimeout):
                await client.request("GET", url, "/")
            second = asyncio.ensure_future(client.request("GET", url, "/"))
            release.set()
            assert await (await first).aread() == b"done"
            assert await (await second).aread() == b"done"
            assert len(writers) == 1
    finally:
        await client.aclose()


# ---------------------------------------------------------------------------------- timeouts and errors
async def test_read_timeout_is_the_longest_silence():
    client = fc.FastClient(read_timeout=0.3)
    gaps = asyncio.Event()

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(5):  # 0.5 s in all, never silent for 0.3 s
            writer.write(chunk(b"%d" % i))
            await writer.drain()
            await asyncio.sleep(0.1)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await gaps.wait()  # then silence on the next request: no head at all
        await reader.read()

    try:
        async with raw_server(handler) as (url, _):
            r = await client.request("GET", url, "/")
            assert await r.aread() == b"01234"
            gaps.set()

        async def stall_after_head(reader, writer):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(b"a"))
            await writer.drain()
            await reader.read()

        async with raw_server(stall_after_head) as (url, _):
            r = await client.request("GET", url, "/")
            assert await r.read_chunk() == b"a"
            with pytest.raises(fc.ReadTimeout):
                await r.read_chunk()

        async def no_head(reader, writer):
            await read_request(reader)
            await reader.read()

        async with raw_server(no_head) as (url, _):
            with pytest.raises(fc.ReadTimeout):
                await client.request("GET", url, "/")
            assert client.pool_stats()[url.split("://")[1]]["open"] == 0
    finally:
        await client.aclose()


async def test_read_timeout_on_a_reused_connection():
    client = fc.FastClient(read_timeout=0.2)

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(response(b"first"))
        await writer.drain()
        await read_request(reader)  # the second request on the same connection: no answer
        await reader.read()

    try:
        async with raw_server(handler) as (url, writers):
            assert await (await client.request("GET", url, "/")).aread() == b"first"
            with pytest.raises(fc.ReadTimeout):
                await client.request("GET", url, "/")
            assert len(writers) == 1
    finally:
        await client.aclose()


async def test_connect_errors(client):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(fc.ConnectError):
            await client.request("GET", f"http://127.0.0.1:{port}", "/")
    assert client.pool_stats()[f"127.0.0.1:{port}"]["open"] == 0


async def test_connect_timeout(monkeypatch):
    client = fc.FastClient(connect_timeout=0.05)
    loop = asyncio.get_running_loop()

    async def never(*args, **kwargs):
        await loop.create_future()

    monkeypatch.setattr(loop, "create_connection", never)
    try:
        with pytest.raises(fc.ConnectTimeout):
            await client.request("GET", "http://127.0.0.1:9", "/")
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    "reply",
    [
        b"",  # closed without a word
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",  # body cut short
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",  # no last chunk
        b"NOT HTTP AT ALL\r\n\r\n",  # garbage
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # bad chunk size
    ],
    ids=["no-response", "short-body", "unfinished-chunks", "garbage", "bad-chunk"],
)
async def test_broken_responses_raise_remote_protocol_error(client, reply):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(reply)
        await writer.drain()
        writer.close()

    async with raw_server(handler) as (url, _):
        with pytest.raises(fc.RemoteProtocolError):
            r = await client.request("GET", url, "/")
            await r.aread()
        await until(lambda: client.pool_stats()[url.split("://")[1]]["open"] == 0)


async def test_reset_connection_raises_an_http_error(client):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writer.transport.abort()  # RST

    async with raw_server(handler) as (url, _):
        r = await client.request("GET", url, "/")
        with pytest.raises((fc.ReadError, fc.RemoteProtocolError)):
            await r.aread()


async def test_bad_urls_and_closed_client():
    client = fc.FastClient()
    with pytest.raises(ValueError):
        await client.request("GET", "ftp://x", "/")
    with pytest.raises(ValueError):
        await client.request("HEAD", "http://127.0.0.1:1", "/")
    await client.aclose()
    with pytest.raises(RuntimeError):
        await client.request("GET", "http://127.0.0.1:1", "/")


# ---------------------------------------------------------------------------------- TLS
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_https(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    srv = await asyncio.start_server(keepalive_handler, "127.0.0.1", 0, ssl=server_ctx)
    port = srv.sockets[0].getsockname()[1]
    client = fc.FastClient(ssl_context=ssl.create_default_context(cafile=str(cert)))
    try:
        for i in (1, 2):
            r = await client.request("POST", f"https://127.0.0.1:{port}", "/", body=b"xy")
            assert await r.aread() == b"answer %d to 2 bytes" % i
        assert client.pool_stats()[f"127.0.0.1:{port}"]["open"] == 1
        with pytest.raises(fc.ConnectError):  # the default context does not trust the self-signed cert
            untrusting = fc.FastClient()
            try:
                await untrusting.request("GET", f"https://127.0.0.1:{port}", "/")
            finally:
                await untrusting.aclose()
    finally:
        await client.aclose()
        srv.close()


# ---------------------------------------------------------------------------------- the proxy's two clients
async def test_httpx_upstream_speaks_the_same_interface_and_errors():
    import httpx

    from gateway.upstream import HttpxUpstream, error_kind, translate

    async with httpx.AsyncClient(timeout=httpx.Timeout(5, read=0.3)) as hc:
        up = HttpxUpstream(hc)
        async with raw_server(keepalive_handler) as (url, _):
            r = await up.request("POST", url, "/", [(b"x-a", b"1")], b"abcd")
            assert r.status == 200 and r.header(b"content-type") == b"text/plain"
            assert await r.read_chunk() == b"answer 1 to 4 bytes"
            assert await r.read_chunk() == b"" and r.complete
            await r.aclose()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            with pytest.raises(fc.ConnectError) as info:
                await up.request("GET", f"http://127.0.0.1:{s.getsockname()[1]}", "/")
        assert error_kind(info.value) == "connect"
        assert translate(info.value, "r1").code == "upstream_unreachable"

        async def stall(reader, writer):
            await read_request(reader)
            await reader.read()

        async with raw_server(stall) as (url, _):
            with pytest.raises(fc.ReadTimeout) as info:
                await up.request("GET", url, "/")
        assert error_kind(info.value) == "timeout" and translate(info.value, "r1").status == 504


@pytest.mark.parametrize("kind", ["fast", "httpx"])
async def test_gateway_relays_through_either_upstream_client(kind):
    import httpx

    from tests.topology import running_topology

    async with running_topology(1, upstream_client=kind) as topo:
        assert topo.gateway.state.proxy.client.__class__.__name__ == ("FastClient" if kind == "fast" else "HttpxUpstream")
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(topo.base_url + CHAT, content=chat(), headers={"content-type": "application/json"})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
            assert r.headers["x-kvgate-replica"] == topo.replica_ids[0]
            r = await c.post(topo.base_url + CHAT, content=chat(stream=True), headers={"content-type": "application/json"})
            events = [ln for ln in r.text.split("\n") if ln.startswith("data: ")]
            assert r.status_code == 200 and events[-1] == "data: [DONE]" and len(events) == 11


def test_config_upstream_client_is_validated():
    from gateway.config import load_config
    from gateway.errors import ConfigError

    assert load_config({}, env={}).upstream_client == "fast"
    assert load_config({}, env={"KVGATE_UPSTREAM_CLIENT": "httpx"}).upstream_client == "httpx"
    with pytest.raises(ConfigError, match="upstream_client"):
        load_config({"upstream_client": "curl"}, env={})


async def test_gateway_frees_the_replica_when_a_client_leaves_a_hanging_request():
    """No chunk ever comes: the disconnect watcher (started by the sweep) cancels the request."""
    import httpx

    from tests.topology import running_topology

    async with running_topology(1) as topo:
        async with httpx.AsyncClient() as c:
            assert (await c.post(topo.replica_urls[0] + "/sim/faults", json={"hang": True})).status_code == 200

            async def in_flight() -> int:
                reps = (await c.get(topo.base_url + "/admin/replicas")).json()["replicas"]
                return reps[0]["in_flight"]

            with pytest.raises(httpx.ReadTimeout):
                await c.post(topo.base_url + CHAT, content=chat(), timeout=httpx.Timeout(5, read=0.2))
            for _ in range(500):  # each poll is a round trip through the gateway
                if await in_flight() == 0:
                    break
            assert await in_flight() == 0
            assert not topo.gateway.state.proxy.disconnects.pending
