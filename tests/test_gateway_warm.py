"""A hot prefix copied by a prefill of its own (``cache_aware`` with ``warm_copies``): real
simulated replicas and a real gateway; the client that shows the demand stays with the holder,
and the gateway sends the copy in the background."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from gateway.features import CHAT, COMPLETION, EMBEDDINGS, RESPONSES
from gateway.sim.config import SimConfig
from gateway.warms import warm_body
from tests.topology import running_topology

DOC = "a long shared manual about key value caches and the replicas that hold them " * 20
PARAMS = {
    # 2 output tokens at a predicted 1 s each: a request holds its (only) slot ~2 s, so four
    # requests that hit it inside a second show a demand of several slots (the first, cold,
    # is no demand for a prefix held), and the sixth asks for a copy.
    "max_running": 1, "decode_ms_per_token": 1000.0, "prefill_ms_per_token": 1.0,
    "busy_ms_per_request": 0.0, "warm_copies": True,
}


def body(question: str, **extra) -> dict:
    return {
        "model": "tiny", "max_tokens": 2, **extra,
        "messages": [{"role": "system", "content": DOC}, {"role": "user", "content": question}],
    }


def _warms(metrics: str) -> dict[tuple[str, str], float]:
    """kvgate_warm_requests_total by (replica, outcome)."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith("kvgate_warm_requests_total{"):
            labels, value = line[len("kvgate_warm_requests_total{"):].rsplit("} ", 1)
            kv = dict(part.split("=", 1) for part in labels.split(","))
            out[(kv["replica"].strip('"'), kv["outcome"].strip('"'))] = float(value)
    return out


def _cached(reply: httpx.Response, stream: bool) -> int:
    if stream:
        last = [x for x in reply.text.splitlines() if x.startswith("data: {")][-1]
        usage = json.loads(last[6:])["usage"]
    else:
        usage = reply.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_a_warm_body_asks_for_one_token_of_the_same_prompt() -> None:
    b = body("q?", stream=True, stream_options={"include_usage": True}, max_completion_tokens=50, n=2)
    w = warm_body(CHAT, b)
    assert w is not None
    assert w["messages"] == b["messages"] and w["model"] == "tiny"
    assert w["max_tokens"] == 1 and w["stream"] is False
    assert not {"stream_options", "max_completion_tokens", "n"} & set(w)
    assert b["stream"] is True and b["n"] == 2  # the client's body is not touched
    assert warm_body(COMPLETION, {"model": "m", "prompt": "x", "max_tokens": 9})["max_tokens"] == 1
    assert warm_body(EMBEDDINGS, {"model": "m", "input": "x"}) is None
    assert warm_body(RESPONSES, {"model": "m", "input": "x"}) is None


@pytest.mark.parametrize("stream", [False, True])
async def test_the_request_that_shows_demand_stays_and_a_warm_copies_the_prefix(stream: bool) -> None:
    sim = SimConfig(prefill_s_per_token=0.0, decode_s_per_token=0.0)
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    async with running_topology(2, sim, policy_params=PARAMS) as topo:
        async with httpx.AsyncClient(timeout=10) as c:
            replies = []
            for i in range(6):
                r = await c.post(topo.base_url + "/v1/chat/completions", json=body(f"q{i}?", **extra))
                assert r.status_code == 200, r.text
                replies.append(r)
            holder = replies[0].headers["x-kvgate-replica"]
            doc_cached = _cached(replies[-1], stream)
            other = next(rid for rid in topo.replica_ids if rid != holder)
            # every client request went to the holder; the second on hit the document there
            assert {r.headers["x-kvgate-replica"] for r in replies} == {holder}
            assert all(int(r.headers["x-kvgate-predicted-cached-tokens"]) > 250 for r in replies[1:])
            # the warm runs in the background: wait for it (the gateway runs in this loop)
            warms = list(topo.gateway.state.proxy.warms.tasks)
            assert len(warms) <= 1
            await asyncio.gather(*warms)
            metrics = (await c.get(topo.base_url + "/metrics")).text
            states = {u.split("://", 1)[1]: (await c.get(u + "/sim/state")).json() for u in topo.replica_urls}
            replicas = (await c.get(topo.base_url + "/admin/replicas")).json()["replicas"]
    assert _warms(metrics) == {(other, "ok"): 1.0}  # one copy, not one each
    assert states[other]["requests_served"] == 1  # the warm, and no client request
    # the document's blocks are there now: as many as a client request found cached on the holder
    assert states[other]["cache_blocks_used"] * sim.block_size >= doc_cached > 250
    assert states[holder]["requests_served"] == 6
    assert all(r["in_flight"] == 0 for r in replicas)  # the warm's load was released
    assert 'reason="warm-copy"' not in metrics  # a warm is no client decision


async def test_a_warm_pulls_the_prefix_where_the_replicas_advertise_pulls() -> None:
    """The simulated replicas advertise KV pulls (migrate=auto): the copy's warm carries the pull
    hint, and the other replica pulls the document from the holder instead of computing it."""
    sim = SimConfig(prefill_s_per_token=0.0002, decode_s_per_token=0.0)  # pulling beats computing
    async with running_topology(2, sim, policy_params={**PARAMS, "migrate_min_tokens": 64}) as topo:
        async with httpx.AsyncClient(timeout=10) as c:
            replies = [await c.post(topo.base_url + "/v1/chat/completions", json=body(f"q{i}?"))
                       for i in range(6)]  # fmt: skip
            await asyncio.gather(*topo.gateway.state.proxy.warms.tasks)
            holder = replies[0].headers["x-kvgate-replica"]
            states = {u.split("://", 1)[1]: (await c.get(u + "/sim/state")).json() for u in topo.replica_urls}
            metrics = (await c.get(topo.base_url + "/metrics")).text
    other = next(rid for rid in states if rid != holder)
    assert {r.headers["x-kvgate-replica"] for r in replies} == {holder}
    assert all("x-sim-pulled-tokens" not in r.headers for r in replies)  # no client pulled
    assert _warms(metrics) == {(other, "ok"): 1.0}
    assert states[other]["requests_served"] == 1 and states[other]["kv_pulls"] == 1
    assert states[other]["kv_pulled_tokens"] >= 240  # the document, from the holder
    assert states[holder]["kv_lookups"] == 1  # asked what it holds, by the puller


async def _warms_to_a_failing_replica(requests: int, **settings) -> tuple[str, str, str, dict]:
    """One request makes a holder, the other replica starts answering 503, then ``requests``
    more on the document, each warm answered before the next request: (metrics, holder, other,
    health by replica)."""
    sim = SimConfig(prefill_s_per_token=0.0, decode_s_per_token=0.0)
    async with running_topology(2, sim, policy_params=PARAMS, **settings) as topo:
        async with httpx.AsyncClient(timeout=10) as c:
            proxy = topo.gateway.state.proxy
            first = await c.post(topo.base_url + "/v1/chat/completions", json=body("q0?"))
            holder = first.headers["x-kvgate-replica"]
            other_url = next(u for u in topo.replica_urls if not u.endswith(holder))
            other = other_url.split("://", 1)[1]
            await c.post(other_url + "/sim/faults", json={"error_rate": 1.0})
            for i in range(1, requests + 1):
                r = await c.post(topo.base_url + "/v1/chat/completions", json=body(f"q{i}?"))
                assert r.status_code == 200 and r.headers["x-kvgate-replica"] == holder
                await asyncio.gather(*proxy.warms.tasks)
            metrics = (await c.get(topo.base_url + "/metrics")).text
            health = {r: proxy.pool.get(r).healthy for r in (holder, other)}
    return metrics, holder, other, health


async def test_a_failed_warm_is_forgotten_and_the_next_request_asks_for_the_copy_again() -> None:
    """The replica meant for the copy answers 503: the warm is not retried elsewhere, the client
    never sees it, and the index forgets the copy (it was never computed), so the next request
    still finds one holder and asks again."""
    metrics, _, other, _ = await _warms_to_a_failing_replica(6, eject_after_failures=10)
    warms = _warms(metrics)
    assert set(warms) == {(other, "status_503")} and warms[(other, "status_503")] >= 2


def _ejections(metrics: str, replica: str) -> float:
    line = f'kvgate_replica_ejections_total{{replica="{replica}"}} '
    return sum(float(x[len(line):]) for x in metrics.splitlines() if x.startswith(line))


async def test_failed_warms_count_toward_the_replicas_passive_ejection() -> None:
    """Warms are the only traffic the copy's replica gets (the clients stay with the holder), so
    its failures are the only sign it is broken: two 503s in a row eject it like two failed
    client requests would, and no copy is asked of it after that."""
    metrics, holder, other, health = await _warms_to_a_failing_replica(8, eject_after_failures=2)
    assert health == {holder: True, other: False}
    assert _warms(metrics) == {(other, "status_503"): 2.0}
    assert _ejections(metrics, other) == 1.0
