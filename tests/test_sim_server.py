"""Simulated replicas as real uvicorn servers on loopback, driven with httpx."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.servers import ServerGroup, free_port
from gateway.sim import (
    SimConfig,
    SimFaults,
    expected_text,
    render_chat_prompt,
    sim_specs_for_ports,
    start_sims,
)

FAST = SimConfig(prefill_s_per_token=0.0, decode_s_per_token=0.0)
LONG = [{"role": "user", "content": "Summarise the history of the printing press. " * 40}]


@pytest.fixture
async def sim(request):
    """One replica on a free port; parametrize indirectly with a SimConfig to change it."""
    config = getattr(request, "param", FAST)
    port = free_port()
    specs = sim_specs_for_ports([port], config=config)
    group = ServerGroup(specs)
    await group.start()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        client.app = specs[0].app  # the in-process SimApp, for inspection
        yield client
    await group.stop()


def sse_events(text: str) -> list[str]:
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] for e in events]


async def test_chat_json(sim):
    body = {"model": "tiny", "messages": LONG, "max_tokens": 7}
    resp = await sim.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/json"
    data = resp.json()
    assert data["object"] == "chat.completion" and data["model"] == "tiny"
    assert data["id"].startswith("chatcmpl-")
    choice = data["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": expected_text(render_chat_prompt(LONG), 7),
    }
    assert choice["finish_reason"] == "length"
    usage = data["usage"]
    assert usage["completion_tokens"] == 7
    assert usage["total_tokens"] == usage["prompt_tokens"] + 7
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    no_limit = (await sim.post("/v1/chat/completions", json={"messages": LONG})).json()
    assert no_limit["choices"][0]["finish_reason"] == "stop"
    assert no_limit["usage"]["completion_tokens"] == 16


async def test_repeated_long_prompt_is_cached(sim):
    body = {"model": "tiny", "messages": LONG, "max_tokens": 2}
    first = (await sim.post("/v1/chat/completions", json=body)).json()["usage"]
    second = (await sim.post("/v1/chat/completions", json=body)).json()["usage"]
    n = first["prompt_tokens"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16 > 0
    longer = {**body, "messages": LONG + [{"role": "assistant", "content": "ok"}]}
    third = (await sim.post("/v1/chat/completions", json=longer)).json()["usage"]
    assert third["prompt_tokens_details"]["cached_tokens"] >= n - 32
    state = (await sim.get("/sim/state")).json()
    assert state["prefix_hits"] == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in (first, second, third)
    )
    assert state["requests_served"] == 3 and state["cache_blocks_used"] > 0


async def test_chat_stream_exact_chunks(sim):
    body = {
        "model": "tiny",
        "messages": LONG,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = await sim.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 1 + 4 + 1 + 1
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    for c in chunks:
        assert c["object"] == "chat.completion.chunk" and c["model"] == "tiny"
    assert chunks[0]["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    pieces = [c["choices"][0]["delta"]["content"] for c in chunks[1:5]]
    assert "".join(pieces) == expected_text(render_chat_prompt(LONG), 4)
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:5])
    assert all(c["usage"] is None for c in chunks[:6])
    assert chunks[5]["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    ]
    assert chunks[6]["choices"] == []
    usage = chunks[6]["usage"]
    assert usage["completion_tokens"] == 4 and usage["prompt_tokens"] > 0
    assert "cached_tokens" in usage["prompt_tokens_details"]


async def test_stream_without_usage_has_no_usage_field(sim):
    body = {"messages": LONG, "max_tokens": 2, "stream": True}
    events = sse_events((await sim.post("/v1/chat/completions", json=body)).text)
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 4 and all("usage" not in c for c in chunks)


async def test_completions_json_and_stream(sim):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 3}
    data = (await sim.post("/v1/completions", json=body)).json()
    assert data["object"] == "text_completion"
    assert data["choices"][0]["text"] == expected_text("Once upon a time", 3)
    events = sse_events((await sim.post("/v1/completions", json={**body, "stream": True})).text)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text("Once upon a time", 3)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    ids = (await sim.post("/v1/completions", json={"prompt": list(range(40))})).json()
    assert ids["usage"]["prompt_tokens"] == 40


async def test_same_answer_on_every_replica():
    port = next(p for p in iter(free_port, None) if p < 65000 and _free(p + 1))
    group = await start_sims(2, base_port=port, config=FAST)
    try:
        body = {"messages": LONG, "max_tokens": 5}
        async with httpx.AsyncClient(timeout=10) as client:
            answers = [
                (await client.post(f"http://127.0.0.1:{p}/v1/chat/completions", json=body)).json()
                for p in (port, port + 1)
            ]
            names = [
                (await client.get(f"http://127.0.0.1:{p}/sim/state")).json()["name"]
                for p in (port, port + 1)
            ]
    finally:
        await group.stop()
    texts = {a["choices"][0]["message"]["content"] for a in answers}
    assert len(texts) == 1 and names == [f"sim-{port}", f"sim-{port + 1}"]


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def test_metrics_models_health(sim):
    await sim.post("/v1/chat/completions", json={"messages": LONG, "max_tokens": 3})
    await sim.post("/v1/chat/completions", json={"messages": LONG, "max_tokens": 3})
    resp = await sim.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples = {s.name: s for fam in text_string_to_metric_families(resp.text) for s in fam.samples}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert samples[name].labels == {"model_name": "tiny"}
    assert samples["vllm:num_requests_running"].value == 0
    assert 0 <= samples["vllm:kv_cache_usage_perc"].value <= 1
    queries = samples["vllm:prefix_cache_queries_total"].value
    assert queries == samples["vllm:prompt_tokens_total"].value > 0
    assert 0 < samples["vllm:prefix_cache_hits_total"].value < queries
    assert samples["vllm:generation_tokens_total"].value == 6
    assert samples["vllm:prefix_cache_hits_total"].value == sim.app.engine.stats.prefix_hits
    models = (await sim.get("/v1/models")).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert (await sim.get("/health")).status_code == 200


async def test_errors_are_openai_shaped_never_500(sim):
    cases = [
        ({"json": {"model": "nope", "messages": LONG}}, 404),
        ({"content": b"{broken"}, 400),
        ({"json": {"model": "tiny"}}, 400),
        ({"content": b'{"messages": [{"role": "user", "content": "\\ud800"}]}'}, 400),
        ({"json": {"messages": LONG, "max_tokens": -1}}, 400),
    ]
    for kwargs, status in cases:
        resp = await sim.post("/v1/chat/completions", **kwargs)
        assert resp.status_code == status, (kwargs, resp.text)
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (
        await sim.post("/v1/chat/completions", json={"model": "nope", "messages": LONG})
    ).json()["error"]["code"] == "model_not_found"
    assert (await sim.get("/v1/chat/completions")).status_code == 405
    assert (await sim.get("/nowhere")).status_code == 404
    assert (await sim.post("/v1/completions", json={"prompt": ""})).status_code == 400


async def test_error_rate_fault_at_runtime(sim):
    resp = await sim.post("/sim/faults", json={"error_rate": 1.0})
    assert resp.status_code == 200 and resp.json()["faults"]["error_rate"] == 1.0
    resp = await sim.post("/v1/chat/completions", json={"messages": LONG})
    assert resp.status_code == 503
    assert resp.json()["error"]["type"] == "server_error"
    bad = await sim.post("/sim/faults", json={"error_rate": "lots"})
    assert bad.status_code == 400
    await sim.post("/sim/faults", json={"error_rate": 0.0})
    assert (await sim.post("/v1/chat/completions", json={"messages": LONG})).status_code == 200
    state = (await sim.get("/sim/state")).json()
    assert state["requests_failed"] == 1 and state["requests_served"] == 1


@pytest.mark.parametrize("sim", [SimConfig(faults=SimFaults(close_after_chunks=3))], indirect=True)
async def test_close_after_chunks_breaks_the_stream(sim):
    received: list[str] = []
    body = {"messages": LONG, "max_tokens": 10, "stream": True}
    with pytest.raises(httpx.RemoteProtocolError):
        async with sim.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line:
                    received.append(line)
    assert len(received) == 3 and "[DONE]" not in received[-1]
    with pytest.raises(httpx.RemoteProtocolError):  # non-streaming: a truncated body
        await sim.post("/v1/chat/completions", json={"messages": LONG})
    await sim.post("/sim/faults", json={"close_after_chunks": None})
    assert (await sim.post("/v1/chat/completions", json=body)).text.endswith("data: [DONE]\n\n")


async def test_stall_after_chunks_leaves_the_client_waiting(sim):
    await sim.post("/sim/faults", json={"stall_after_chunks": 2})
    received: list[str] = []
    body = {"messages": LONG, "max_tokens": 10, "stream": True}
    with pytest.raises(httpx.ReadTimeout):
        async with sim.stream(
            "POST", "/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.3)
        ) as resp:
            async for line in resp.aiter_lines():
                if line:
                    received.append(line)
    assert len(received) == 2


async def test_hang_and_unhealthy_faults(sim):
    await sim.post("/sim/faults", json={"hang": True, "unhealthy": True})
    assert (await sim.get("/health")).status_code == 503
    with pytest.raises(httpx.ReadTimeout):
        await sim.post(
            "/v1/chat/completions", json={"messages": LONG}, timeout=httpx.Timeout(10, read=0.3)
        )
    assert (await sim.get("/sim/faults")).json()["faults"]["hang"] is True
    await sim.post("/sim/faults", json={"hang": False, "unhealthy": False})
    assert (await sim.post("/v1/chat/completions", json={"messages": LONG})).status_code == 200


async def test_reset_clears_cache_and_counters(sim):
    body = {"messages": LONG, "max_tokens": 2}
    await sim.post("/v1/chat/completions", json=body)
    await sim.post("/sim/faults", json={"error_rate": 0.5})
    state = (await sim.post("/sim/reset")).json()
    assert state["cache_blocks_used"] == 0 and state["prefix_queries"] == 0
    assert state["requests_served"] == 0 and state["faults"]["error_rate"] == 0.5
    await sim.post("/sim/faults", json={"error_rate": 0})
    again = (await sim.post("/v1/chat/completions", json=body)).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
