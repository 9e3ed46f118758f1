"""A conversation's next turn prefilled before it is asked (``cache_aware`` with ``warm_turns``):
real simulated replicas and a real gateway; once a turn is answered, the gateway prefills the
prompt and its answer where the turn ran, and the next turn finds the answer cached there."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from gateway.sim.config import SimConfig
from tests.test_gateway_warm import _warms
from tests.topology import running_topology

CHAT = "/v1/chat/completions"
SYSTEM = "You are the helper of a long conversation about caches and replicas. " * 12
PARAMS = {"max_running": 8, "decode_ms_per_token": 0.0, "prefill_ms_per_token": 0.1}


def _reply(r: httpx.Response, stream: bool) -> tuple[str, dict]:
    """(the answer's text, usage)."""
    if not stream:
        data = r.json()
        return data["choices"][0]["message"]["content"], data["usage"]
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    return text, events[-1]["usage"]


async def _conversation(c: httpx.AsyncClient, topo, turns: int, stream: bool, headers: dict) -> list:
    """Run ``turns`` turns; after each, wait for the gateway's warms (the gateway runs in this
    loop). Returns (replica, answer, usage) per turn."""
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"question number {t}: how do blocks move? " * 3})
        r = await c.post(topo.base_url + CHAT, headers=headers,
                         json={"model": "tiny", "max_tokens": 24, "messages": messages, **extra})
        assert r.status_code == 200, r.text
        answer, usage = _reply(r, stream)
        out.append((r.headers["x-kvgate-replica"], answer, usage))
        messages.append({"role": "assistant", "content": answer})
        await asyncio.gather(*topo.gateway.state.proxy.warms.tasks)
    return out


@pytest.mark.parametrize("stream", [False, True])
async def test_the_next_turn_finds_the_answer_cached_where_the_turn_ran(stream: bool) -> None:
    sim = SimConfig(prefill_s_per_token=0.0, decode_s_per_token=0.0)
    runs = {}
    for warm in (True, False):
        async with running_topology(2, sim, policy_params={**PARAMS, "warm_turns": warm}) as topo:
            async with httpx.AsyncClient(timeout=10) as c:
                turns = await _conversation(c, topo, 3, stream, {"x-session-id": "conv"})
                metrics = (await c.get(topo.base_url + "/metrics")).text
                states = [(await c.get(u + "/sim/state")).json() for u in topo.replica_urls]
        runs[warm] = (turns, metrics, states)
    (warm_turns, warm_metrics, warm_states), (cold_turns, cold_metrics, _) = runs[True], runs[False]
    replica = warm_turns[0][0]
    assert {t[0] for t in warm_turns} == {replica}  # the session stayed
    # One warm per answered turn, on the replica that served it; none without warm_turns.
    assert _warms(warm_metrics) == {(replica, "ok"): 3.0}
    assert _warms(cold_metrics) == {}
    assert sum(s["requests_served"] for s in warm_states) == 6
    # The answers are the same either way (the simulator's are deterministic) ...
    assert [t[1] for t in warm_turns] == [t[1] for t in cold_turns]
    # ... but with the warms the next turns find the answer cached: only the new message and
    # what is left of the last block are computed (cold: the answer as well).
    for t in (1, 2):
        warm_usage, cold_usage = warm_turns[t][2], cold_turns[t][2]
        assert warm_usage["prompt_tokens"] == cold_usage["prompt_tokens"]
        warm_cached = warm_usage["prompt_tokens_details"]["cached_tokens"]
        cold_cached = cold_usage["prompt_tokens_details"]["cached_tokens"]
        assert warm_cached >= cold_cached + 16  # at least one more block: the answer's
        previous = warm_turns[t - 1][2]
        assert warm_cached >= previous["prompt_tokens"] + previous["completion_tokens"] - 16


async def test_a_single_question_is_not_followed() -> None:
    """No session header, no user, no earlier answer: a one-off question (shared-prefix traffic)
    gets no warm."""
    sim = SimConfig(prefill_s_per_token=0.0, decode_s_per_token=0.0)
    async with running_topology(2, sim, policy_params=PARAMS) as topo:
        async with httpx.AsyncClient(timeout=10) as c:
            for i in range(3):
                r = await c.post(topo.base_url + CHAT, json={"model": "tiny", "max_tokens": 8, "messages": [
                    {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"one-off {i}"}]})
                assert r.status_code == 200
            assert not topo.gateway.state.proxy.warms.tasks
            metrics = (await c.get(topo.base_url + "/metrics")).text
    assert _warms(metrics) == {}


async def test_no_warm_where_half_the_replicas_slots_are_taken() -> None:
    """A warm leaves half a replica's slots free for real requests: with one of two slots taken,
    none is sent."""
    sim = SimConfig(prefill_s_per_token=0.0, decode_s_per_token=0.0, max_running=2)
    params = {**PARAMS, "max_running": 2}
    async with running_topology(1, sim, policy_params=params) as topo:
        proxy = topo.gateway.state.proxy
        async with httpx.AsyncClient(timeout=10) as c:
            replica = proxy.pool.get(topo.replica_ids[0])
            replica.in_flight += 1  # another request is running there
            try:
                await _conversation(c, topo, 1, False, {"x-session-id": "busy"})
            finally:
                replica.in_flight -= 1
            metrics = (await c.get(topo.base_url + "/metrics")).text
    assert _warms(metrics) == {}


def _sse(*events: object) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def _delta(**delta) -> dict:
    return {"choices": [{"index": 0, "delta": delta}]}


def test_the_answer_of_a_stream_is_its_deltas_and_only_a_plain_complete_one_counts() -> None:
    from gateway.turns import answer_from_json, answer_from_sse

    done = b"data: [DONE]\n\n"
    role = _delta(role="assistant", content="")
    usage = {"choices": [], "usage": {"prompt_tokens": 3}}
    assert answer_from_sse(_sse(role, _delta(content="Hel"), _delta(content="lo"), usage) + done) == "Hello"
    # split across reads anywhere: the caller joins the pieces first
    assert answer_from_sse(_sse(_delta(content="a b"), _delta(content=" c")) + done) == "a b c"
    assert answer_from_sse(_sse(_delta(content="cut")) ) is None  # no [DONE]: cut short
    assert answer_from_sse(_sse(_delta(content="x"), {"error": {"message": "boom"}}) + done) is None
    assert answer_from_sse(_sse(_delta(tool_calls=[{"index": 0, "id": "t"}])) + done) is None
    assert answer_from_sse(_sse({"choices": [{"index": 1, "delta": {"content": "n=2"}}]}) + done) is None
    assert answer_from_sse(_sse(role) + done) is None  # no text
    assert answer_from_sse(b"data: {not json\n\n" + done) is None
    assert answer_from_json(json.dumps({"choices": [{"message": {"content": "Hi"}}]}).encode()) == "Hi"
    calls = {"choices": [{"message": {"content": None, "tool_calls": [{"id": "t"}]}}]}
    assert answer_from_json(json.dumps(calls).encode()) is None
    two = {"choices": [{"message": {"content": "a"}}, {"message": {"content": "b"}}]}
    assert answer_from_json(json.dumps(two).encode()) is None
    assert answer_from_json(b"[1]") is None and answer_from_json(b"{") is None


def test_which_requests_are_followed_by_a_next_turn() -> None:
    from gateway.features import CHAT, COMPLETION
    from gateway.turns import continues, next_turn_body

    one = {"messages": [{"role": "user", "content": "q"}]}
    assert not continues(CHAT, one, explicit_session=False)
    assert continues(CHAT, one, explicit_session=True)
    assert continues(CHAT, {**one, "user": "u1"}, explicit_session=False)
    later = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                          {"role": "user", "content": "q2"}]}
    assert continues(CHAT, later, explicit_session=False)
    assert not continues(CHAT, {**later, "n": 2}, explicit_session=True)
    assert not continues(COMPLETION, {"prompt": "x"}, explicit_session=True)
    nxt = next_turn_body(later, "a2")
    assert nxt["messages"][-1] == {"role": "assistant", "content": "a2"} and len(later["messages"]) == 3


def test_the_policy_warms_a_turn_only_on_a_free_healthy_replica_and_when_asked() -> None:
    from policies import PolicyDeps, default_registry
    from policies.types import ClusterView, ReplicaState, RequestFeatures

    def policy(**params):
        return default_registry().build("cache_aware", {"max_running": 2, **params}, PolicyDeps())

    req = RequestFeatures(model="m", prefix_hashes=(1, 2, 3), tokens_per_hash=64, prompt_tokens=200)
    view = ClusterView((ReplicaState("a"), ReplicaState("b", in_flight=2), ReplicaState("c", draining=True)))
    p = policy()
    assert p.warms_turns
    d = p.warm_turn(req, "a", view)
    assert d is not None and (d.replica, d.reason, d.alternates) == ("a", "warm-turn", ())
    assert d.scores["ttft_ms"] == pytest.approx(200 * 0.1)  # nothing held yet: all computed
    p.on_dispatch(req, d, view)
    again = p.warm_turn(req, "a", view)
    assert again.predicted_cached_tokens == 192  # the three blocks it now holds
    assert p.warm_turn(req, "b", view) is None  # its slots are taken
    one = ClusterView((ReplicaState("a", in_flight=1),))
    assert p.warm_turn(req, "a", one) is None  # it would leave less than half the slots free
    assert p.warm_turn(req, "c", view) is None  # draining
    assert p.warm_turn(req, "gone", view) is None
    assert p.warm_turn(RequestFeatures(model="m"), "a", view) is None  # nothing to warm
    off = policy(warm_turns=False)
    assert not off.warms_turns and off.warm_turn(req, "a", view) is None
