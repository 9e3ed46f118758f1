"""Active health checks against a real simulated replica: what takes a replica out, and when.
The probes go out on the proxy's upstream client: each test runs on both (fast, httpx)."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from gateway.config import ReplicaConfig
from gateway.fastclient import FastClient
from gateway.health import check_all, check_replica
from gateway.replicas import Replica, ReplicaPool
from gateway.runner import sim_specs
from gateway.servers import ServerGroup
from gateway.sim.config import SimConfig
from gateway.upstream import HttpxUpstream
from tests.test_gateway_proxy import CHAT, body, set_faults
from tests.topology import free_port, running_topology

TIMEOUT = 0.3  # the probes' timeout; the slow replica answers 30 s late


@pytest.fixture(params=["fast", "httpx"])
def probes(request):
    """Opens the upstream client the probes use, of each kind."""

    @contextlib.asynccontextmanager
    async def open_client():
        if request.param == "fast":
            client = FastClient(connect_timeout=1.0)
            try:
                yield client
            finally:
                await client.aclose()
        else:
            async with httpx.AsyncClient() as raw:
                yield HttpxUpstream(raw)

    return open_client


async def start_sim() -> tuple[ServerGroup, str]:
    port = free_port()
    group = ServerGroup(sim_specs(1, "127.0.0.1", port, SimConfig()))
    await group.start()
    return group, f"http://127.0.0.1:{port}"


async def test_probes_that_time_out_take_a_replica_out_only_after_patience_runs_out(probes):
    """A busy engine answers its probes late while serving fine: one late probe is not a death."""
    group, url = await start_sim()
    try:
        rep = Replica(ReplicaConfig(url))
        async with probes() as client, httpx.AsyncClient() as other:
            assert await check_replica(client, rep, TIMEOUT, patience=3)
            assert rep.metrics_ok and rep.models == frozenset({"tiny"}) and rep.failures == 0
            assert rep.running == 0 and rep.kv_tokens > 0  # from its /metrics
            bad = await other.post(url + "/sim/faults", json={"probe_delay_s": -1})
            assert bad.status_code == 400 and "probe_delay_s" in bad.text
            await set_faults(url, probe_delay_s=30)
            assert await check_replica(client, rep, TIMEOUT, patience=3)
            assert await check_replica(client, rep, TIMEOUT, patience=3)
            assert rep.healthy and rep.failures == 2
            assert not await check_replica(client, rep, TIMEOUT, patience=3)
            assert not rep.healthy and rep.failures == 3
            assert not await check_replica(client, rep, TIMEOUT, patience=3)  # stays out
            await set_faults(url, probe_delay_s=0)
            assert await check_replica(client, rep, TIMEOUT, patience=3)  # back at once
            assert rep.healthy and rep.failures == 0
    finally:
        await group.stop()


async def test_a_replica_that_says_it_is_unhealthy_or_cannot_be_reached_is_out_at_once(probes):
    group, url = await start_sim()
    rep = Replica(ReplicaConfig(url))
    try:
        async with probes() as client:
            await set_faults(url, unhealthy=True)
            assert not await check_replica(client, rep, TIMEOUT, patience=3)
            await set_faults(url, unhealthy=False)
            assert await check_replica(client, rep, TIMEOUT, patience=3)
    finally:
        await group.stop()
    async with probes() as client:  # the process is gone: connection refused
        assert not await check_replica(client, rep, TIMEOUT, patience=3)
        assert not rep.healthy and rep.failures == 1


async def test_models_are_asked_every_few_rounds_and_when_a_replica_comes_back(probes):
    """An engine's models do not change while it runs: /v1/models is asked at the first round,
    then every ``models_every`` rounds, and at once when the replica comes back up."""
    group, url = await start_sim()
    try:
        rep = Replica(ReplicaConfig(url))
        async with probes() as client:
            assert await check_replica(client, rep, TIMEOUT, models_every=3)
            assert rep.models == frozenset({"tiny"})
            rep.models = frozenset({"stale"})  # what a probe would replace
            for _ in range(2):  # rounds 2 and 3: /health and /metrics only
                assert await check_replica(client, rep, TIMEOUT, models_every=3)
                assert rep.models == frozenset({"stale"}) and rep.metrics_ok
            assert await check_replica(client, rep, TIMEOUT, models_every=3)  # round 4: asked
            assert rep.models == frozenset({"tiny"})
            rep.models = frozenset({"stale"})
            await set_faults(url, unhealthy=True)
            assert not await check_replica(client, rep, TIMEOUT, models_every=3)
            await set_faults(url, unhealthy=False)
            assert await check_replica(client, rep, TIMEOUT, models_every=3)  # back: asked at once
            assert rep.models == frozenset({"tiny"})
    finally:
        await group.stop()


async def test_check_all_gives_every_replica_the_pools_patience(probes):
    group, url = await start_sim()
    try:
        pool = ReplicaPool([ReplicaConfig(url)], eject_after_failures=2)
        async with probes() as client:
            await set_faults(url, probe_delay_s=30)
            await check_all(client, pool, TIMEOUT)
            assert pool.snapshot().replicas[0].healthy
            await check_all(client, pool, TIMEOUT)
            assert not pool.snapshot().replicas[0].healthy
    finally:
        await group.stop()


async def test_the_index_takes_each_replicas_capacity_from_the_cache_size_its_engine_reports():
    """The simulator reports its cache as vLLM does (vllm:cache_config_info); the gateway's index
    then forgets what the engine must have evicted, instead of predicting hits on it."""
    sim = SimConfig(cache_blocks=64)  # 1,024 tokens: prompts of 400 tokens, three fit at most
    async with running_topology(1, sim_config=sim, policy="cache_aware") as topo:
        rid = topo.replica_ids[0]
        index = topo.gateway.policy_deps.index
        assert index.configured_capacity(rid) == 64 * sim.block_size // 64  # 64 tokens a hash
        async with httpx.AsyncClient(timeout=10) as c:

            async def ask(topic: str) -> tuple[int, int]:
                text = " ".join(f"{topic}{i}" for i in range(400))  # a token a word here
                r = await c.post(topo.base_url + CHAT, json=body(text))
                assert r.status_code == 200, r.text
                cached = r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
                return int(r.headers["x-kvgate-predicted-cached-tokens"]), cached

            await ask("alpha")
            predicted, cached = await ask("alpha")
            assert predicted > 0 and cached >= 384  # it fits: cached, and predicted so
            for topic in ("beta", "gamma", "delta"):
                await ask(topic)
            # The engine evicted alpha for the others; the index, at the engine's capacity, too
            # (at its default of 65,536 blocks it would still predict the whole prompt).
            assert await ask("alpha") == (0, 0)
