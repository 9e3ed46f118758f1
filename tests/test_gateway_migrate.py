"""Migration through the gateway: a spill away from a busy holder carries ``kv_transfer_params``
and the simulated replica pulls the prefix from the holder instead of recomputing it."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from gateway.kvhints import pull_hint_body
from gateway.sim.config import SimConfig
from policies.types import Decision
from tests.topology import running_topology

CHAT = "/v1/chat/completions"
DOC = "A long shared document about caches and replicas. " * 120


def body(question: str, **extra) -> dict:
    msgs = [{"role": "system", "content": DOC}, {"role": "user", "content": question}]
    return {"model": "tiny", "messages": msgs, "max_tokens": 4, **extra}


class Pool:
    def __init__(self, urls: dict[str, str]) -> None:
        self.urls = urls

    def get(self, rid: str):
        url = self.urls.get(rid)
        return None if url is None else type("R", (), {"url": url})()


def test_pull_hint_body_merges_into_kv_transfer_params():
    pool = Pool({"a": "http://a:1/", "b": "http://b:2"})
    parsed = {"model": "m", "kv_transfer_params": {"do_remote_decode": True}}
    out = pull_hint_body(parsed, Decision("b", pull_from="a", pull_tokens=640), pool)
    assert orjson.loads(out)["kv_transfer_params"] == {
        "do_remote_decode": True, "kvgate_pull_from": "http://a:1", "kvgate_pull_tokens": 640,
    }  # fmt: skip
    assert parsed["kv_transfer_params"] == {"do_remote_decode": True}  # not mutated
    assert pull_hint_body({"model": "m"}, Decision("b"), pool) is None  # no hint: body as is
    assert pull_hint_body({"model": "m"}, Decision("b", pull_from="zz"), pool) is None  # unknown
    assert pull_hint_body({"model": "m"}, Decision("b", pull_from="b"), pool) is None  # itself


async def spill_from_a_busy_holder(params: dict, sim: SimConfig):
    """A first request, then its holder kept busy by a request that never ends, then the same
    prefix again: (first, spill) responses, and the replicas as ``/admin/replicas`` had them."""
    async with running_topology(2, sim, policy="cache_aware", policy_params=params) as topo:
        async with httpx.AsyncClient(base_url=topo.base_url, timeout=10) as c:
            reps = (await c.get("/admin/replicas")).json()["replicas"]
            first = await c.post(CHAT, json=body("first?"))
            holder = first.headers["x-kvgate-replica"]
            holder_url = next(u for u in topo.replica_urls if holder in u)
            async with httpx.AsyncClient() as direct:  # the holder's next request never ends
                await direct.post(holder_url + "/sim/faults", json={"hang": True})
            # a long answer (10 s predicted) that never ends: the holder is busy
            busy = asyncio.create_task(c.post(CHAT, json=body("first?", max_tokens=500)))
            for _ in range(500):  # until the gateway counts the hanging request in flight
                now = (await c.get("/admin/replicas")).json()["replicas"]
                if {r["id"]: r["in_flight"] for r in now}[holder] == 1:
                    break
            spill = await c.post(CHAT, json=body("second?"))
            busy.cancel()
    assert first.status_code == 200 and spill.status_code == 200
    assert spill.headers["x-kvgate-replica"] != holder
    return first, spill, reps


SPILL = dict(max_running=1, avg_output_tokens=100, decode_ms_per_token=20, prefill_ms_per_token=0.2,
             migrate_min_tokens=64, load_slack=100)  # fmt: skip
SIM = dict(prefill_s_per_token=0.0002, decode_s_per_token=0.0)


async def test_spill_from_a_busy_holder_pulls_the_prefix():
    # migrate=true: every replica pulls; these advertise their link too, so it prices them
    _, spill, _ = await spill_from_a_busy_holder({**SPILL, "migrate": True}, SimConfig(**SIM))
    assert spill.headers["x-kvgate-reason"] == "migrate"
    pulled = int(spill.headers["x-sim-pulled-tokens"])
    assert pulled > 0
    assert spill.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == pulled


async def test_by_default_pulls_go_only_to_replicas_that_advertise_them():
    # the simulator advertises kvgate:kv_pull_info (128 KiB a token over 100 Gbit/s): auto pulls
    _, spill, reps = await spill_from_a_busy_holder(SPILL, SimConfig(**SIM))
    assert [r["kv_pull_ms_per_token"] for r in reps] == [pytest.approx(131072 * 8 / 100e9 * 1e3)] * 2
    assert spill.headers["x-kvgate-reason"] == "migrate"
    assert int(spill.headers["x-sim-pulled-tokens"]) > 0


async def test_without_advertised_pulls_the_default_recomputes():
    # replicas that cannot pull (no link): the same spill computes the prefix, no hint is sent
    _, spill, reps = await spill_from_a_busy_holder(SPILL, SimConfig(**SIM, kv_bandwidth_gbps=0))
    assert [r["kv_pull_ms_per_token"] for r in reps] == [None, None]
    assert spill.headers["x-kvgate-reason"] != "migrate"
    assert "x-sim-pulled-tokens" not in spill.headers
    assert spill.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
