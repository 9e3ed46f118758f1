"""The gateway in front of real simulated replicas on loopback: streaming, faults, retries, errors."""

from __future__ import annotations

import httpx
import orjson
import pytest

from gateway.sim.config import SimConfig
from tests.topology import running_topology

CHAT = "/v1/chat/completions"


def body(content: str = "hello", **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 6, **extra}


async def set_faults(url: str, **faults) -> None:
    async with httpx.AsyncClient() as c:
        r = await c.post(url + "/sim/faults", json=faults)
        assert r.status_code == 200, r.text


def sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


async def in_flight(base: str) -> dict[str, int]:
    async with httpx.AsyncClient() as c:
        reps = (await c.get(base + "/admin/replicas")).json()["replicas"]
    return {r["id"]: r["in_flight"] for r in reps}


async def test_stream_is_forwarded_before_the_replica_finishes():
    """The replica stalls after 2 chunks: those chunks still reach the client (no buffering)."""
    async with running_topology(1) as topo:
        await set_faults(topo.replica_urls[0], stall_after_chunks=2)
        async with httpx.AsyncClient(timeout=10) as c:
            async with c.stream("POST", topo.base_url + CHAT, json=body(stream=True)) as resp:
                assert resp.status_code == 200
                assert resp.headers["x-kvgate-replica"] == topo.replica_ids[0]
                events = []
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        events.append(orjson.loads(line[6:]))
                    if len(events) == 2:
                        break
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert events[1]["choices"][0]["delta"]["content"]
        # The client left mid-stream: the gateway must release the replica.
        async with httpx.AsyncClient() as c:
            for _ in range(200):
                if (await in_flight(topo.base_url))[topo.replica_ids[0]] == 0:
                    break
                await c.get(topo.base_url + "/health")  # yields to the server between polls
        assert (await in_flight(topo.base_url))[topo.replica_ids[0]] == 0


async def test_replica_dying_mid_stream_ends_the_client_stream_with_an_error_event():
    async with running_topology(1) as topo:
        await set_faults(topo.replica_urls[0], close_after_chunks=3)
        async with httpx.AsyncClient(timeout=10) as c:
            resp = await c.post(topo.base_url + CHAT, json=body(stream=True))
        events = sse_events(resp.text)
        assert resp.status_code == 200
        assert events[-1] == "[DONE]"
        err = orjson.loads(events[-2])["error"]
        assert err["type"] == "upstream_error" and err["message"]
        assert len(events) == 3 + 2  # three relayed chunks, the error, [DONE]


async def test_replica_stalling_mid_stream_times_out_with_an_error_event():
    async with running_topology(1, read_timeout_s=0.3) as topo:
        await set_faults(topo.replica_urls[0], stall_after_chunks=2)
        async with httpx.AsyncClient(timeout=10) as c:
            resp = await c.post(topo.base_url + CHAT, json=body(stream=True))
        events = sse_events(resp.text)
        assert events[-1] == "[DONE]"
        assert orjson.loads(events[-2])["error"]["code"] == "upstream_timeout"


async def test_failing_replica_is_retried_on_an_alternate_then_ejected():
    async with running_topology(3, eject_after_failures=2, policy="round_robin") as topo:
        bad = topo.replica_ids[0]
        await set_faults(topo.replica_urls[0], error_rate=1.0)
        attempts = []
        async with httpx.AsyncClient(timeout=10) as c:
            for i in range(9):
                r = await c.post(topo.base_url + CHAT, json=body(f"q{i}"))
                assert r.status_code == 200, r.text
                assert r.headers["x-kvgate-replica"] != bad
                attempts.append(int(r.headers["x-kvgate-attempts"]))
            reps = {x["id"]: x for x in (await c.get(topo.base_url + "/admin/replicas")).json()["replicas"]}
            metrics = (await c.get(topo.base_url + "/metrics")).text
        assert attempts.count(2) == 2  # retried twice, then the replica was ejected
        assert not reps[bad]["healthy"]
        assert f'kvgate_replica_ejections_total{{replica="{bad}"}} 1.0' in metrics


async def test_unreachable_replica_is_skipped():
    cfg = SimConfig()
    async with running_topology(2, sim_config=cfg) as topo:
        app = topo.gateway
        # Point the first replica at a closed port: a connect error, retried on the other.
        app.state.pool.get(topo.replica_ids[0]).url = "http://127.0.0.1:9"
        async with httpx.AsyncClient(timeout=10) as c:
            codes = [(await c.post(topo.base_url + CHAT, json=body(f"x{i}"))).status_code for i in range(4)]
        assert codes == [200] * 4


async def test_all_replicas_failing_gives_openai_shaped_502_or_503():
    async with running_topology(2, max_retries=1) as topo:
        for url in topo.replica_urls:
            await set_faults(url, error_rate=1.0)
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(topo.base_url + CHAT, json=body())
        assert r.status_code == 503
        assert r.json()["error"]["message"]


async def test_auth_size_limit_and_request_id():
    async with running_topology(1, api_keys=("sekret",), max_body_bytes=2000) as topo:
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(topo.base_url + CHAT, json=body())
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            auth = {"authorization": "Bearer sekret", "x-request-id": "req-123"}
            r = await c.post(topo.base_url + CHAT, json=body(), headers=auth)
            assert r.status_code == 200 and r.headers["x-request-id"] == "req-123"
            r = await c.post(topo.base_url + CHAT, json=body("x" * 5000), headers=auth)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            r = await c.get(topo.base_url + CHAT)
            assert r.status_code == 405 and "error" in r.json()


@pytest.mark.parametrize("stream", [False, True])
async def test_prediction_metrics_count_actual_cached_tokens(stream):
    long = "a shared document about caches " * 100
    async with running_topology(1) as topo:
        async with httpx.AsyncClient(timeout=10) as c:
            for _ in range(2):
                extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
                r = await c.post(topo.base_url + CHAT, json=body(long, **extra))
                assert r.status_code == 200
            metrics = (await c.get(topo.base_url + "/metrics")).text
        line = next(x for x in metrics.splitlines() if x.startswith("kvgate_actual_cached_tokens_total"))
        assert float(line.rsplit(" ", 1)[1]) > 0


@pytest.mark.parametrize("http_server", ["fast", "uvicorn"])
async def test_max_in_flight_sheds_load_with_an_openai_429(http_server):
    """One request held open on a stalled replica fills ``max_in_flight=1``: the next is refused
    with an OpenAI 429 and ``retry-after``; once the first ends, requests are admitted again."""
    async with running_topology(1, max_in_flight=1, http_server=http_server) as topo:
        await set_faults(topo.replica_urls[0], stall_after_chunks=1)
        async with httpx.AsyncClient(timeout=10) as c:
            async with c.stream("POST", topo.base_url + CHAT, json=body(stream=True)) as held:
                assert held.status_code == 200
                async for line in held.aiter_lines():
                    if line.startswith("data: "):
                        break  # the first chunk arrived: the request is in flight
                refused = await c.post(topo.base_url + CHAT, json=body())
                assert refused.status_code == 429
                assert refused.headers["retry-after"] == "1" and refused.headers["x-request-id"]
                assert refused.json()["error"]["type"] == "rate_limit_error"
            await set_faults(topo.replica_urls[0], stall_after_chunks=None)
            for _ in range(200):  # the gateway notices the client left and frees the slot
                ok = await c.post(topo.base_url + CHAT, json=body())
                if ok.status_code == 200:
                    break
            assert ok.status_code == 200
            metrics = (await c.get(topo.base_url + "/metrics")).text
        assert 'kvgate_requests_total{route="/v1/chat/completions",status="429"}' in metrics


async def test_shutdown_finishes_open_streams_and_refuses_new_connections():
    """Stop requested mid-stream: the stream still ends with [DONE]; the listener is closed."""
    sim = SimConfig(decode_s_per_token=0.02)  # 20 tokens: ~0.4 s of streaming
    async with running_topology(1, sim_config=sim, shutdown_grace_s=10) as topo:
        gateway_group = topo.groups[0]
        async with httpx.AsyncClient(timeout=10) as c:
            async with c.stream("POST", topo.base_url + CHAT, json=body(stream=True, max_tokens=20)) as r:
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        break  # streaming has begun
                gateway_group.request_stop()
                rest = [line async for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]" and len(rest) >= 10
            await gateway_group.wait()
            with pytest.raises(httpx.ConnectError):
                await c.post(topo.base_url + CHAT, json=body())


async def test_shutdown_cuts_a_stalled_stream_at_the_grace_deadline():
    async with running_topology(1, shutdown_grace_s=0.5) as topo:
        await set_faults(topo.replica_urls[0], stall_after_chunks=1)
        gateway_group = topo.groups[0]
        async with httpx.AsyncClient(timeout=10) as c:
            async with c.stream("POST", topo.base_url + CHAT, json=body(stream=True)) as r:
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        break
                gateway_group.request_stop()
                with pytest.raises(httpx.RemoteProtocolError):  # cut, not hung
                    async for _ in lines:
                        pass
            await gateway_group.wait()


async def test_a_client_hanging_up_on_done_is_not_an_abort():
    """The openai SDK closes the connection on ``data: [DONE]`` without reading the replica's chunk
    terminator.  The gateway must count that stream as complete (200, usage and cached tokens),
    not as a client abort (499, nothing learned)."""
    import asyncio

    from tests.sse_replica import gateway_in_front_of, send_event

    release = asyncio.Event()
    usage = {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41,
             "prompt_tokens_details": {"cached_tokens": 32}}
    events = [{"choices": [{"index": 0, "delta": {"content": "hi"}}]},
              {"choices": [], "usage": usage}]
    sse = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"

    async def stream(writer):
        await send_event(writer, sse)
        await release.wait()  # the terminator comes late, after the client has hung up

    async with gateway_in_front_of(stream) as (port, app):
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(timeout=10) as c:
            async with c.stream("POST", base + CHAT, json=body(stream=True)) as resp:
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        break
                watch = app.state.proxy.disconnects
                for _ in range(500):  # until the gateway watches this request for a hang-up
                    if not watch.pending:
                        break
                    await asyncio.sleep(0.01)
                assert not watch.pending
            # the client closed the connection without the terminator
            release.set()
            for _ in range(500):
                metrics = (await c.get(base + "/metrics")).text
                if 'route="/v1/chat/completions",status="' in metrics:
                    break
                await asyncio.sleep(0.01)
        assert 'kvgate_requests_total{route="/v1/chat/completions",status="200"} 1.0' in metrics
        assert 'status="499"' not in metrics
        assert 'kvgate_actual_cached_tokens_total{policy="round_robin"} 32.0' in metrics
