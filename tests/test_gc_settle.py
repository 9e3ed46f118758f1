"""Cyclic GC kept out of the measurements and the serving path: the load generator pauses it while
it measures, a server process freezes what its start-up built once every server is up, and a
proxied exchange leaves no reference cycle behind for the collector to find."""

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


async def test_a_proxied_exchange_leaves_no_reference_cycle(gc_restored) -> None:
    """Every request through the gateway (JSON and streamed, each with a disconnect watcher) is
    freed by reference counting: nothing of the server's, the proxy's or the watcher's is left
    in a cycle (each used to leave ~45 objects a request for the cyclic GC)."""
    import httpx

    from tests.topology import running_topology

    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    async with running_topology(1) as topo:
        topo.gateway.state.proxy.disconnects.after_s = 0.0  # every request gets a watcher
        async with httpx.AsyncClient(timeout=10) as c:
            url = topo.base_url + "/v1/chat/completions"
            assert (await c.post(url, json=body)).status_code == 200
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                watchers = []
                for stream in (False, True, False, True):
                    async with c.stream("POST", url, json=body | {"stream": stream}) as r:
                        assert r.status_code == 200
                        watchers += [t for t in asyncio.all_tasks()
                                     if t.get_coro().__qualname__ == "_watch_disconnect"]
                        await r.aread()
                    assert r.content.endswith(b"data: [DONE]\n\n") if stream else r.json()["usage"]["completion_tokens"] == 8
                await asyncio.sleep(0)  # the last watcher wakes on its response's end
                gc.collect()
                leaked = sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
                                 if type(o).__module__.startswith(("gateway.", "policies."))
                                 or isinstance(o, asyncio.Task)})
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
    assert leaked == []
    # the streams were watched (a JSON response arrives whole, once its watcher is gone), and their
    # watchers returned on the response's end rather than being cancelled
    assert len(set(watchers)) == 2 and all(w.done() and not w.cancelled() for w in watchers)
