"""Active health checks against a real simulated replica: what takes a replica out, and when."""

from __future__ import annotations

import httpx

from gateway.config import ReplicaConfig
from gateway.health import check_all, check_replica
from gateway.replicas import Replica, ReplicaPool
from gateway.runner import sim_specs
from gateway.servers import ServerGroup
from gateway.sim.config import SimConfig
from tests.test_gateway_proxy import set_faults
from tests.topology import free_port

TIMEOUT = 0.3  # the probes' timeout; the slow replica answers 30 s late


async def start_sim() -> tuple[ServerGroup, str]:
    port = free_port()
    group = ServerGroup(sim_specs(1, "127.0.0.1", port, SimConfig()))
    await group.start()
    return group, f"http://127.0.0.1:{port}"


async def test_probes_that_time_out_take_a_replica_out_only_after_patience_runs_out():
    """A busy engine answers its probes late while serving fine: one late probe is not a death."""
    group, url = await start_sim()
    try:
        rep = Replica(ReplicaConfig(url))
        async with httpx.AsyncClient() as client:
            assert await check_replica(client, rep, TIMEOUT, patience=3)
            assert rep.metrics_ok and rep.models == frozenset({"tiny"}) and rep.failures == 0
            bad = await client.post(url + "/sim/faults", json={"probe_delay_s": -1})
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


async def test_a_replica_that_says_it_is_unhealthy_or_cannot_be_reached_is_out_at_once():
    group, url = await start_sim()
    rep = Replica(ReplicaConfig(url))
    try:
        async with httpx.AsyncClient() as client:
            await set_faults(url, unhealthy=True)
            assert not await check_replica(client, rep, TIMEOUT, patience=3)
            await set_faults(url, unhealthy=False)
            assert await check_replica(client, rep, TIMEOUT, patience=3)
    finally:
        await group.stop()
    async with httpx.AsyncClient() as client:  # the process is gone: connection refused
        assert not await check_replica(client, rep, TIMEOUT, patience=3)
        assert not rep.healthy and rep.failures == 1


async def test_check_all_gives_every_replica_the_pools_patience():
    group, url = await start_sim()
    try:
        pool = ReplicaPool([ReplicaConfig(url)], eject_after_failures=2)
        async with httpx.AsyncClient() as client:
            await set_faults(url, probe_delay_s=30)
            await check_all(client, pool, TIMEOUT)
            assert pool.snapshot().replicas[0].healthy
            await check_all(client, pool, TIMEOUT)
            assert not pool.snapshot().replicas[0].healthy
    finally:
        await group.stop()
