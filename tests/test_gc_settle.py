"""Cyclic GC kept out of the measurements and the serving path: the load generator pauses it while
it measures, and a server process freezes what its start-up built once every server is up."""

from __future__ import annotations

import asyncio
import gc
import os
import signal

import pytest

from gateway.bench.loadgen import run_workload
from gateway.bench.workloads import BenchRequest, Workload
from gateway.servers import ServerGroup, free_port_block
from gateway.sim.config import SimConfig
from gateway.sim.runner import sim_specs


@pytest.fixture
def gc_restored():
    was = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if was else gc.disable)()


async def test_the_load_generator_pauses_the_gc_while_it_measures(gc_restored) -> None:
    gc.enable()
    port = free_port_block(1)
    group = ServerGroup(sim_specs(1, "127.0.0.1", port, SimConfig(prefill_s_per_token=0.0,
                                                                   decode_s_per_token=0.0)))
    msgs = ({"role": "user", "content": "hello there"},)
    work = Workload("tiny", [BenchRequest(i, 0.0, msgs, 2, key="k") for i in range(3)])
    seen = []

    def route(req: BenchRequest) -> str:
        seen.append(gc.isenabled())
        return f"http://127.0.0.1:{port}"

    await group.start()
    try:
        results, _ = await run_workload(work, route)
    finally:
        await group.stop()
    assert [r.ok for r in results] == [True, True, True]
    assert seen == [False, False, False] and gc.isenabled()


async def test_a_server_group_calls_back_once_every_server_is_up(gc_restored) -> None:
    group = ServerGroup(sim_specs(2, "127.0.0.1", free_port_block(2)))
    calls = []

    def started() -> None:
        calls.append([s.started for s in group.servers])
        os.kill(os.getpid(), signal.SIGTERM)  # handled by the group: it stops serving

    await asyncio.wait_for(group.run_until_signal(started), timeout=30)
    assert calls == [[True, True]]
