"""Several real gateways sharing state (one Redis, or one in-process store) in front of sims."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from gateway.state import Backoff, MemoryStore, SyncSettings
from tests.test_state_store import until
from tests.topology import free_port, running_gateways

CHAT = "/v1/chat/completions"
FAST = SyncSettings(
    heartbeat_s=0.1, load_ttl_s=1.0, block_s=0.3, op_timeout_s=0.5, catchup_timeout_s=2.0,
    backoff=Backoff(base_s=0.05, cap_s=0.3),
)


def chat(messages: list[dict], max_tokens: int = 6) -> dict:
    return {"model": "tiny", "messages": messages, "max_tokens": max_tokens}


async def drain_on(c: httpx.AsyncClient, base: str, replica_id: str) -> None:
    """Drain a replica on one gateway only: its view now differs from the other gateways'."""
    r = await c.post(f"{base}/admin/replicas/{replica_id}/drain")
    assert r.status_code == 200 and r.json()["draining"]


def cluster_kwargs(kind: str, redis) -> dict:
    if kind == "redis":
        return {"redis_url": redis.url, "sync_settings": FAST}
    return {"store": MemoryStore(), "sync_settings": FAST}


@pytest.fixture(params=["redis", "memory"])
def shared(request):
    redis = request.getfixturevalue("redis_fixture") if request.param == "redis" else None
    return cluster_kwargs(request.param, redis)


@pytest.mark.parametrize("policy", ["cache_aware", "session"])
async def test_a_session_alternating_between_gateways_stays_on_one_replica(shared, policy):
    """Gateway A has replica 0 drained, B does not: B can only agree with A through the store."""
    async with running_gateways(2, policy=policy, **shared) as cl, httpx.AsyncClient(timeout=10) as c:
        a, b = cl.base_urls
        await drain_on(c, a, cl.replica_ids[0])
        placements: dict[str, list[str]] = {}
        reasons: dict[str, list[str]] = {}
        for s in range(16):
            sid = f"sess-{policy}-{s}"
            messages = [{"role": "system", "content": f"You are helper number {s}. " * 20}]
            for turn in range(6):
                messages.append({"role": "user", "content": f"question {turn} of session {s}"})
                base = (a, b)[turn % 2]
                r = await c.post(base + CHAT, json=chat(messages), headers={"x-session-id": sid})
                assert r.status_code == 200, r.text
                placements.setdefault(sid, []).append(r.headers["x-kvgate-replica"])
                reasons.setdefault(sid, []).append(r.headers["x-kvgate-reason"])
                messages.append(r.json()["choices"][0]["message"])
        split = {sid: (reps, reasons[sid]) for sid, reps in placements.items() if len(set(reps)) != 1}
        assert not split, split
        assert cl.replica_ids[0] not in {reps[0] for reps in placements.values()}


async def test_a_prefix_routed_by_one_gateway_is_routed_the_same_by_the_other(redis_fixture):
    lags: list[float] = []
    async with running_gateways(2, policy="cache_aware", redis_url=redis_fixture.url,
                                sync_settings=FAST) as cl, httpx.AsyncClient(timeout=10) as c:
        a, b = cl.base_urls
        cl.apps[1].state.sync.on_apply = lambda ev: lags.append(time.time() - ev.wall_us / 1e6)
        await drain_on(c, a, cl.replica_ids[0])
        same = 0
        for i in range(60):
            body = chat([{"role": "user", "content": f"document {i}: " + "lorem ipsum " * 60}])
            ra = await c.post(a + CHAT, json=body)
            rb = await c.post(b + CHAT, json=body)
            assert ra.status_code == rb.status_code == 200
            same += ra.headers["x-kvgate-replica"] == rb.headers["x-kvgate-replica"]
            assert int(rb.headers["x-kvgate-predicted-cached-tokens"]) > 0
        assert same == 60
    lags.sort()
    assert len(lags) >= 60
    p99 = lags[int(0.99 * (len(lags) - 1))]
    assert p99 < 0.25, f"propagation p50 {lags[len(lags) // 2] * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms"


async def test_a_late_gateway_is_ready_only_with_the_shared_view(redis_fixture):
    async with running_gateways(1, policy="cache_aware", redis_url=redis_fixture.url,
                                sync_settings=FAST) as cl, httpx.AsyncClient(timeout=10) as c:
        for i in range(30):
            body = chat([{"role": "user", "content": f"early {i} " * 40}])
            assert (await c.post(cl.base_urls[0] + CHAT, json=body)).status_code == 200
        await until(lambda: cl.apps[0].state.sync.stats["published"] == 30, what="published")
        async with running_gateways(1, policy="cache_aware", redis_url=redis_fixture.url,
                                    sync_settings=FAST) as late:
            r = await c.get(late.base_urls[0] + "/ready")
            assert r.status_code == 200 and r.json()["state_caught_up"] is True
            assert late.apps[0].state.sync.stats["applied"] == 30
            health = (await c.get(late.base_urls[0] + "/health")).json()
            assert health["status"] == "ok" and health["store"]["backend"] == "redis"


def _serve(port: int, replica_urls: list[str], redis_url: str, gateway_id: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--policy",
           "cache_aware", "--redis", redis_url, "--gateway-id", gateway_id, "--log-level", "warning"]
    for u in replica_urls:
        cmd += ["--replica", u]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})


async def _load(c, pick_base, docs, stop: asyncio.Event, results: list, worker: int) -> None:
    i = worker
    while not stop.is_set():
        sid = i % len(docs)
        body = chat([{"role": "system", "content": docs[sid]},
                     {"role": "user", "content": f"question {i}"}])
        try:
            r = await c.post(pick_base(sid) + CHAT, json=body, headers={"x-session-id": f"doc{sid}"})
        except httpx.HTTPError:
            results.append(None)
        else:
            usage = r.json().get("usage", {}) if r.status_code == 200 else {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            results.append((r.status_code, cached, usage.get("prompt_tokens", 0)))
        i += 4


def _hit_rate(results) -> float:
    ok = [r for r in results if r and r[0] == 200]
    return sum(r[1] for r in ok) / max(1, sum(r[2] for r in ok))


async def test_killing_one_gateway_keeps_the_hit_rate_on_the_other(redis_fixture):
    """A runs as its own process (with replica 0 drained) and is SIGKILLed under load."""
    docs = [f"Reference document {d}. " + f"fact {d} " * 150 for d in range(12)]
    async with running_gateways(1, policy="cache_aware", redis_url=redis_fixture.url,
                                sync_settings=FAST) as cl, httpx.AsyncClient(timeout=10) as c:
        b = cl.base_urls[0]
        port = free_port()
        a = f"http://127.0.0.1:{port}"
        proc = _serve(port, cl.replica_urls, redis_fixture.url, "gw-killed")
        try:
            await until(lambda: _ready(c, a), timeout=30, what="gateway A ready")
            await drain_on(c, a, cl.replica_ids[0])
            alive = {"a": True}
            stop, before = asyncio.Event(), []
            pick = lambda sid: a if alive["a"] and sid % 2 == 0 else b  # noqa: E731
            warm = [asyncio.create_task(_load(c, pick, docs, stop, [], w)) for w in range(4)]
            await until(lambda: cl.apps[0].state.sync.stats["applied"] >= 24, what="warm-up")
            stop.set()
            await asyncio.gather(*warm)
            stop = asyncio.Event()
            tasks = [asyncio.create_task(_load(c, pick, docs, stop, before, w)) for w in range(4)]
            await until(lambda: len(before) >= 120, timeout=30, what="traffic before")
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            alive["a"] = False
            await until(lambda: len(before) >= 130, timeout=30, what="in-flight settled")
            mark = len(before)
            await until(lambda: len(before) - mark >= 120, timeout=30, what="traffic after")
            stop.set()
            await asyncio.gather(*tasks)
            hr_before = _hit_rate(before[:mark - 10])
            hr_after = _hit_rate(before[mark:])
            assert hr_before > 0.5
            assert hr_after >= 0.95 * hr_before, (hr_before, hr_after)
            # The dead gateway's in-flight counts vanish from B's view once their TTL passes.
            pool = cl.apps[0].state.pool
            await until(lambda: all(r.remote_in_flight == 0 for r in pool), what="load expiry")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


async def _ready(c, base) -> bool:
    try:
        return (await c.get(base + "/ready")).status_code == 200
    except httpx.HTTPError:
        return False


async def _status(c, base) -> str:
    return (await c.get(base + "/health")).json()["status"]


async def test_redis_outage_under_load_fails_no_request(redis_fixture):
    docs = [f"Manual {d}. " + f"step {d} " * 100 for d in range(8)]
    async with running_gateways(2, policy="cache_aware", redis_url=redis_fixture.url,
                                sync_settings=FAST) as cl, httpx.AsyncClient(timeout=10) as c:
        a, b = cl.base_urls
        stop, results = asyncio.Event(), []
        pick = lambda sid: (a, b)[sid % 2]  # noqa: E731
        tasks = [asyncio.create_task(_load(c, pick, docs, stop, results, w)) for w in range(4)]
        try:
            await until(lambda: len(results) >= 40, what="traffic before")
            redis_fixture.stop()
            down_at = time.monotonic()
            for base in (a, b):
                await until(lambda base=base: _is(c, base, "degraded"), what="degraded health")
            metrics = (await c.get(a + "/metrics")).text
            assert 'kvgate_store_up{backend="redis"} 0.0' in metrics
            served_during = len(results)
            await until(lambda: time.monotonic() - down_at >= 2.0, what="a 2 s outage")
            assert len(results) > served_during  # requests kept flowing meanwhile
            redis_fixture.start()
            for base in (a, b):
                await until(lambda base=base: _is(c, base, "ok"), what="recovered health")
            mark = len(results)
            await until(lambda: len(results) - mark >= 40, what="traffic after")
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        failures = [r for r in results if r is None or r[0] != 200]
        assert failures == [] and len(results) > 80
        # After the outage, routing outcomes flow between the gateways again.
        body = chat([{"role": "user", "content": "after the outage " * 40}])
        applied = cl.apps[1].state.sync.stats["applied"]
        r = await c.post(a + CHAT, json=body)
        await until(lambda: cl.apps[1].state.sync.stats["applied"] > applied, what="sync resumed")
        assert (await c.post(b + CHAT, json=body)).headers["x-kvgate-replica"] == r.headers["x-kvgate-replica"]
        assert 'kvgate_store_sync_errors_total' in (await c.get(a + "/metrics")).text


async def _is(c, base, status) -> bool:
    return await _status(c, base) == status


def test_demo_with_two_gateways_shares_state_and_stops_cleanly():
    from gateway.state.redis_server import find_redis_server
    from tests.topology import free_port_block, wait_ready

    port, sim_port = free_port_block(2), free_port_block(3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "demo", "--gateways", "2", "--port", str(port),
         "--sim-port", str(sim_port), "--policy", "session"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    bases = [f"http://127.0.0.1:{port + i}" for i in range(2)]
    try:
        for base in bases:
            wait_ready(base + "/ready", timeout=60)
        stores = [httpx.get(b + "/health").json()["store"] for b in bases]
        expected = "redis" if find_redis_server() else "memory"
        assert {s["backend"] for s in stores} == {expected} and all(s["up"] for s in stores)
        served = set()
        for turn in range(6):
            r = httpx.post(bases[turn % 2] + CHAT, headers={"x-session-id": "demo-session"},
                           json=chat([{"role": "user", "content": f"turn {turn}"}]))
            served.add(r.headers["x-kvgate-replica"])
        assert len(served) == 1
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "2 gateways share sessions" in out and "kvgate demo stopped" in out


async def test_a_lone_gateway_without_a_store_runs_no_sync_and_still_keeps_sessions():
    """No Redis URL and no store passed in: nobody else can read its embedded store, so the gateway
    publishes nothing and tails nothing, and its own view still keeps sessions and prefixes."""
    from gateway.state import SharedPolicy, SoloSync
    from tests.topology import running_topology

    async with running_topology(3, policy="cache_aware") as topo, httpx.AsyncClient(timeout=10) as c:
        sync = topo.gateway.state.sync
        assert isinstance(sync, SoloSync)
        assert not isinstance(topo.gateway.state.proxy.policy, SharedPolicy)
        placed = set()
        messages = [{"role": "system", "content": "You are a lone gateway's helper. " * 30}]
        for turn in range(5):
            messages.append({"role": "user", "content": f"question {turn}"})
            r = await c.post(topo.base_url + CHAT, headers={"x-session-id": "lone"}, json=chat(messages))
            assert r.status_code == 200
            placed.add(r.headers["x-kvgate-replica"])
            if turn:
                assert int(r.headers["x-kvgate-predicted-cached-tokens"]) > 0
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        assert len(placed) == 1
        store = (await c.get(topo.base_url + "/health")).json()["store"]
        assert (store["backend"], store["shared"], store["up"], store["published"]) == ("memory", False, True, 0)
        ready = await c.get(topo.base_url + "/ready")
        assert ready.status_code == 200 and ready.json()["state_caught_up"] is True
        metrics = (await c.get(topo.base_url + "/metrics")).text
        assert 'kvgate_store_up{backend="memory"} 1.0' in metrics
        assert "kvgate_store_caught_up 1.0" in metrics


async def test_gateways_handed_one_memory_store_share_it():
    async with running_gateways(2, policy="session", store=MemoryStore(), sync_settings=FAST) as cl, \
            httpx.AsyncClient(timeout=10) as c:
        for base in cl.base_urls:
            store = (await c.get(base + "/health")).json()["store"]
            assert (store["backend"], store["shared"]) == ("memory", True)
        r = await c.post(cl.base_urls[0] + CHAT, headers={"x-session-id": "s"},
                         json=chat([{"role": "user", "content": "hi"}]))
        assert r.status_code == 200
        await until(lambda: cl.apps[0].state.sync.stats["published"] == 1, what="published")
