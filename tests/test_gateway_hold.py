"""A follower of a prefill in flight waits at the gateway and finds the prefix (real simulated
replicas, a real gateway): ``cache_aware``'s ``wait_for_prefill`` against the same script without."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from gateway.sim.config import SimConfig
from tests.topology import running_topology

CHAT = "/v1/chat/completions"
DOC = "a long shared manual about key value caches and the replicas that hold them " * 20


def body(question: str) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "system", "content": DOC}, {"role": "user", "content": question}],
        "max_tokens": 2,
    }


async def dispatched(c: httpx.AsyncClient, base: str) -> None:
    """Until the gateway has sent a request to a replica (the leader's prefill has started)."""
    for _ in range(1000):
        reps = (await c.get(base + "/admin/replicas")).json()["replicas"]
        if any(r["in_flight"] for r in reps):
            return
    raise AssertionError("the leader was never dispatched")


class SkewedClock:
    """The gateway's clock: real time plus a jump the test makes."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.ahead


@pytest.mark.parametrize("wait, stream", [(True, False), (True, True), (False, False)])
async def test_a_follower_of_a_prefill_in_flight_waits_for_its_first_token_and_hits(
    wait: bool, stream: bool
) -> None:
    """The leader's prompt (~330 tokens) prefills for ~0.5 s on the replica (1.5 ms/token), and
    the gateway is told 40 ms/token: it predicts ~15 s.  The follower comes "8 s later" by the
    gateway's clock (it jumps ahead: no sleeping), so waiting (~7.6 s + its suffix) beats
    recomputing (~15.6 s) and the gateway holds it -- until the leader's first token comes back
    (streamed or not), well before the client's 5 s timeout.  Without waiting it goes at once."""
    sim = SimConfig(prefill_s_per_token=0.0015, decode_s_per_token=0.001)
    params = {"prefill_ms_per_token": 40.0, "max_running": 8, "wait_for_prefill": wait}
    clock = SkewedClock()
    leader_body = body("first?") | ({"stream": True} if stream else {})
    async with running_topology(2, sim, {"clock": clock}, policy_params=params) as topo:
        async with httpx.AsyncClient(timeout=5) as c:
            leader = asyncio.ensure_future(c.post(topo.base_url + CHAT, json=leader_body))
            await dispatched(c, topo.base_url)
            clock.ahead = 8.0
            follower = await c.post(topo.base_url + CHAT, json=body("second?"))
            first = await leader
            metrics = (await c.get(topo.base_url + "/metrics")).text
    assert first.status_code == follower.status_code == 200
    cached = follower.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    predicted = int(follower.headers["x-kvgate-predicted-cached-tokens"])
    waits = [x for x in metrics.splitlines() if 'reason="prefill-wait"' in x and x[0] != "#"]
    if wait:  # held until the document existed on the leader's replica, then hit it
        assert follower.headers["x-kvgate-replica"] == first.headers["x-kvgate-replica"]
        assert predicted > 250 and cached > 250  # the document (the sim caches 16-token blocks)
        assert len(waits) == 1 and waits[0].endswith(" 1.0")
    else:  # sent at once: it recomputes the document beside the leader
        assert predicted == 0 and cached == 0
        assert not waits
