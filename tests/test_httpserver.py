"""The lean HTTP/1.1 server (gateway/httpserver.py), driven over raw loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib

import orjson
import pytest

from gateway.httpserver import FastServer
from gateway.servers import ServerGroup, ServerSpec, free_port


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        assert msg["type"] == "http.request"
        chunks.append(msg["body"])
        if not msg["more_body"]:
            return b"".join(chunks)


async def echo_app(scope, receive, send):
    """Echoes method, path, query and body; ``/stream`` sends 3 chunks without a length."""
    if scope["type"] != "http":
        raise ValueError("no lifespan here")
    body = await _read_body(receive)
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"1")]})
        for i in range(3):
            await send({"type": "http.response.body", "body": b"part%d" % i, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    out = orjson.dumps({"method": scope["method"], "path": scope["path"],
                        "query": scope["query_string"].decode(), "body": body.decode(),
                        "http_version": scope["http_version"]})
    await send({"type": "http.response.start", "status": 201,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", b"%d" % len(out))]})
    await send({"type": "http.response.body", "body": out})


@contextlib.asynccontextmanager
async def serve(app, **kwargs):
    port = free_port()
    server = FastServer(app, "127.0.0.1", port, **kwargs)
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), task.exception()
        await asyncio.sleep(0.005)  # start-up of a real server, not event ordering
    try:
        yield server, port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if line:
            k, v = line.split(": ", 1)
            headers[k.lower()] = v
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += data[:-2]
    else:
        body = b""
    return status, headers, body


async def test_keep_alive_and_pipelined_requests_are_answered_in_order():
    async with serve(echo_app) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /a?x=1 HTTP/1.1\r\nhost: t\r\ncontent-length: 3\r\n\r\nabc"
                     b"GET /b%20c HTTP/1.1\r\nhost: t\r\n\r\n")
        s1, h1, b1 = await read_response(reader)
        s2, _, b2 = await read_response(reader)
        assert (s1, orjson.loads(b1)) == (201, {"method": "POST", "path": "/a", "query": "x=1",
                                               "body": "abc", "http_version": "1.1"})
        assert "server" not in h1 and "date" not in h1  # nothing added to a proxied response
        assert s2 == 201 and orjson.loads(b2)["path"] == "/b c"
        # The same connection serves a third request.
        writer.write(b"GET /c HTTP/1.1\r\nhost: t\r\n\r\n")
        assert orjson.loads((await read_response(reader))[2])["path"] == "/c"
        writer.close()


async def test_chunked_request_body_and_expect_continue():
    async with serve(echo_app) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /up HTTP/1.1\r\nhost: t\r\nexpect: 100-continue\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        status, _, body = await read_response(reader)
        assert status == 201 and orjson.loads(body)["body"] == "hello world"
        writer.close()


async def test_large_body_arrives_in_order_with_read_backpressure():
    payload = bytes(range(256)) * 40_000  # 10 MB, over the 64 KiB buffering limit below
    got = {}

    async def app(scope, receive, send):
        if scope["type"] != "http":
            raise ValueError
        got["body"] = await _read_body(receive)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async with serve(app, max_buffered_body=64 * 1024) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % len(payload))
        writer.write(payload)
        status, headers, body = await read_response(reader)
        assert status == 204 and body == b"" and "transfer-encoding" not in headers
        assert got["body"] == payload
        writer.close()


async def test_streamed_response_is_chunked_and_head_is_not_held_back():
    release = asyncio.Event()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            raise ValueError
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await release.wait()  # the client must see the head before any body exists
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async with serve(app) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /s HTTP/1.1\r\nhost: t\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert b"transfer-encoding: chunked" in head and b"text/event-stream" in head
        release.set()
        assert await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5) == b"9\r\ndata: 1\n\n\r\n0\r\n\r\n"
        writer.close()


async def test_head_request_has_no_body_and_http10_closes():
    async with serve(echo_app) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"HEAD /h HTTP/1.1\r\nhost: t\r\n\r\nGET /stream HTTP/1.0\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 201") and b"content-length: " in head
        # The next bytes are the second response: the HEAD response had no body.  An HTTP/1.0
        # client gets no chunked encoding: the body runs to the close.
        status, headers, body = await read_response(reader)
        assert status == 200 and headers["connection"] == "close"
        assert "transfer-encoding" not in headers
        assert await asyncio.wait_for(reader.read(), 5) == b"part0part1part2"
        writer.close()


async def test_app_errors_give_500_before_the_response_and_a_close_after():
    async def app(scope, receive, send):
        if scope["type"] != "http":
            raise ValueError
        if scope["path"] == "/late":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
        if scope["path"] == "/split":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"x-evil", b"a\r\nset-cookie: b")]})
        raise RuntimeError("boom")

    async with serve(app) as (_, port):
        for path in (b"/early", b"/split"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET %s HTTP/1.1\r\nhost: t\r\n\r\n" % path)
            status, headers, body = await read_response(reader)
            assert status == 500 and orjson.loads(body)["error"]["type"] == "server_error"
            assert b"set-cookie" not in body
            writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /late HTTP/1.1\r\nhost: t\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), 5)  # EOF: the connection was closed
        assert data.startswith(b"HTTP/1.1 200") and not data.endswith(b"0\r\n\r\n")
        writer.close()


@pytest.mark.parametrize("request_bytes,status", [
    (b"NOT HTTP AT ALL\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
])
async def test_bad_requests_get_a_json_4xx_and_a_close(request_bytes, status):
    async with serve(echo_app) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request_bytes)
        got, headers, body = await read_response(reader)
        assert got == status and headers["connection"] == "close"
        assert "message" in orjson.loads(body)["error"]
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


async def test_client_disconnect_reaches_the_app():
    seen = asyncio.get_running_loop().create_future()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            raise ValueError
        await _read_body(receive)
        seen.set_result(await receive())  # blocks until the client goes away

    async with serve(app) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0)
        writer.close()
        assert await asyncio.wait_for(seen, 5) == {"type": "http.disconnect"}


async def test_graceful_shutdown_finishes_in_flight_and_closes_idle():
    release = asyncio.Event()
    entered = asyncio.Event()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            raise ValueError
        if scope["path"] == "/slow":
            entered.set()
            await release.wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async with serve(app, graceful_timeout=5) as (server, port):
        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
        idle_w.write(b"GET /fast HTTP/1.1\r\nhost: t\r\n\r\n")
        assert (await read_response(idle_r))[0] == 200  # now idle, kept alive
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /slow HTTP/1.1\r\nhost: t\r\n\r\n")
        await asyncio.wait_for(entered.wait(), 5)
        server.should_exit = True
        assert await asyncio.wait_for(idle_r.read(), 5) == b""  # the idle one is closed
        release.set()
        status, headers, body = await read_response(r)
        assert (status, body, headers.get("connection")) == (200, b"ok", "close")
        assert await asyncio.wait_for(r.read(), 5) == b""
        idle_w.close()
        w.close()


async def test_idle_keep_alive_connections_are_closed():
    async with serve(echo_app, keep_alive_s=0.2) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
        assert (await read_response(reader))[0] == 201
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


async def test_lifespan_runs_around_serving_and_failed_startup_raises():
    events = []

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                events.append(msg["type"])
                if msg["type"] == "lifespan.startup":
                    scope["state"]["db"] = "up"
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = scope["state"]["db"].encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    async with serve(app) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
        assert (await read_response(reader))[2] == b"up"  # lifespan state reaches requests
        writer.close()
    assert events == ["lifespan.startup", "lifespan.shutdown"]

    async def failing(scope, receive, send):
        await receive()
        await send({"type": "lifespan.startup.failed", "message": "no database"})

    with pytest.raises(RuntimeError, match="no database"):
        await FastServer(failing, "127.0.0.1", free_port()).serve()


@pytest.mark.parametrize("server", ["fast", "uvicorn"])
async def test_server_group_runs_either_server(server):
    port = free_port()
    group = ServerGroup([ServerSpec(echo_app, "127.0.0.1", port, server=server)])
    await group.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\nhi")
        status, _, body = await read_response(reader)
        assert status == 201 and orjson.loads(body)["body"] == "hi"
        writer.close()
    finally:
        await group.stop()
