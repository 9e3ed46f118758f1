"""Runtime pool management through the admin API, against real simulated replicas."""

from __future__ import annotations

import asyncio

import httpx

from gateway.runner import sim_specs
from gateway.servers import ServerGroup
from gateway.sim.config import SimConfig
from tests.test_gateway_proxy import CHAT, body, set_faults
from tests.topology import free_port, running_topology


async def replicas(c: httpx.AsyncClient, base: str) -> dict[str, dict]:
    return {r["id"]: r for r in (await c.get(base + "/admin/replicas")).json()["replicas"]}


async def test_add_drain_undrain_remove():
    port = free_port()
    extra = ServerGroup(sim_specs(1, "127.0.0.1", port, SimConfig()))
    await extra.start()
    try:
        async with running_topology(1, policy="round_robin") as topo, httpx.AsyncClient(timeout=10) as c:
            new_id = f"127.0.0.1:{port}"
            r = await c.post(topo.base_url + "/admin/replicas", json={"url": f"http://{new_id}"})
            assert r.status_code == 201 and r.json()["healthy"] and r.json()["models"] == ["tiny"]
            r = await c.post(topo.base_url + "/admin/replicas", json={"url": f"http://{new_id}"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "replica_exists"
            served = {(await c.post(topo.base_url + CHAT, json=body(f"{i}"))).headers["x-kvgate-replica"]
                      for i in range(4)}
            assert served == {topo.replica_ids[0], new_id}

            assert (await c.post(topo.base_url + f"/admin/replicas/{new_id}/drain")).json()["draining"]
            served = {(await c.post(topo.base_url + CHAT, json=body(f"d{i}"))).headers["x-kvgate-replica"]
                      for i in range(4)}
            assert served == {topo.replica_ids[0]}
            await c.post(topo.base_url + f"/admin/replicas/{new_id}/undrain")
            served = {(await c.post(topo.base_url + CHAT, json=body(f"u{i}"))).headers["x-kvgate-replica"]
                      for i in range(4)}
            assert new_id in served

            r = await c.delete(topo.base_url + f"/admin/replicas/{new_id}")
            assert r.status_code == 200 and r.json()["removed"]
            assert new_id not in await replicas(c, topo.base_url)
            r = await c.delete(topo.base_url + f"/admin/replicas/{new_id}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "replica_not_found"
            r = await c.post(topo.base_url + "/admin/replicas", json={"url": "ftp://nope"})
            assert r.status_code == 400
    finally:
        await extra.stop()


async def test_remove_waits_for_in_flight_requests():
    async with running_topology(2, policy="round_robin") as topo, httpx.AsyncClient(timeout=10) as c:
        busy = topo.replica_ids[0]
        await set_faults(topo.replica_urls[0], stall_after_chunks=1)
        # Round robin starts with the lowest id; open a stream there that stalls.
        first = await replicas(c, topo.base_url)
        assert sorted(first) == sorted(topo.replica_ids)
        stream_cm = c.stream("POST", topo.base_url + CHAT, json=body(stream=True))
        resp = await stream_cm.__aenter__()
        lines = resp.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        holder = resp.headers["x-kvgate-replica"]
        assert holder == busy
        r = await c.delete(topo.base_url + f"/admin/replicas/{busy}")
        assert r.status_code == 202 and r.json()["in_flight"] == 1
        state = await replicas(c, topo.base_url)
        assert state[busy]["draining"] and state[busy]["removing"]
        # New requests avoid the draining replica.
        assert (await c.post(topo.base_url + CHAT, json=body("x"))).headers["x-kvgate-replica"] != busy
        await stream_cm.__aexit__(None, None, None)  # client leaves: the in-flight request ends
        for _ in range(200):
            if busy not in await replicas(c, topo.base_url):
                break
            await asyncio.sleep(0)
        assert busy not in await replicas(c, topo.base_url)


async def test_admin_token_is_required_when_configured():
    async with running_topology(1, admin_token="adm") as topo, httpx.AsyncClient(timeout=10) as c:
        rid = topo.replica_ids[0]
        r = await c.post(topo.base_url + f"/admin/replicas/{rid}/drain")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = await c.post(topo.base_url + f"/admin/replicas/{rid}/drain", headers={"authorization": "Bearer adm"})
        assert r.status_code == 200 and r.json()["draining"]
        r = await c.get(topo.base_url + "/ready")
        assert r.status_code == 503 and r.json()["models_without_replica"] == ["tiny"]


async def test_removed_replica_leaves_the_prefix_index_and_sessions():
    long = "a long shared system prompt for the index " * 40
    async with running_topology(2, policy="cache_aware") as topo, httpx.AsyncClient(timeout=10) as c:
        r = await c.post(topo.base_url + CHAT, json=body(long), headers={"x-session-id": "s1"})
        holder = r.headers["x-kvgate-replica"]
        deps = topo.gateway.policy_deps
        assert deps.index.blocks(holder) > 0 and deps.sessions.peek("s1") == holder
        # the session's next turn is warmed there (warm_turns): removing waits for that to end
        await asyncio.gather(*topo.gateway.state.proxy.warms.tasks)
        assert (await c.delete(topo.base_url + f"/admin/replicas/{holder}")).status_code == 200
        assert deps.index.blocks(holder) == 0 and deps.sessions.peek("s1") is None
        r = await c.post(topo.base_url + CHAT, json=body(long), headers={"x-session-id": "s1"})
        assert r.status_code == 200 and r.headers["x-kvgate-replica"] != holder
