"""Hot-prefix replication run by real agents on loopback (HTTP control APIs and TCP data ports).

Rounds are driven with ``replicate_once(now)`` (or a trigger the test owns) and hits are timed
with an injected clock: nothing sleeps.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("zmq")

from gateway.cli import build_parser  # noqa: E402
from gateway.servers import ServerGroup, ServerSpec  # noqa: E402
from tests.test_agent_service import chain, config, same, tensors  # noqa: E402
from worker_agent.api import build_app  # noqa: E402
from worker_agent.blockfmt import Block  # noqa: E402
from worker_agent.cli_args import agent_config_from_args  # noqa: E402
from worker_agent.errors import PeerGone  # noqa: E402
from worker_agent.events import BlockStored  # noqa: E402
from worker_agent.migration import Version, rendezvous  # noqa: E402
from worker_agent.replication import ReplicationConfig  # noqa: E402
from worker_agent.service import AgentService  # noqa: E402
from worker_agent.shared import ChainTracker  # noqa: E402

BLOCK_BYTES = tensors(0, 1)[0].nbytes


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Cluster:
    """Agents that all list each other (themselves included) as peers, each served by its own
    uvicorn, so that one can be stopped for real while the others run."""

    def __init__(self, names: str, clock: Clock, **replication) -> None:
        configs = [config(n, events_endpoint=None, replay_endpoint=None) for n in names]
        peers = tuple(f"http://127.0.0.1:{c.port}" for c in configs)
        rep = ReplicationConfig(**{"interval_s": 0, "min_rate": 3.0, **replication})
        self.agents = {
            c.name: AgentService(replace(c, peers=peers, replication=rep), clock=clock)
            for c in configs
        }
        self.groups = {
            name: ServerGroup([ServerSpec(build_app(a), "127.0.0.1", a.config.port)])
            for name, a in self.agents.items()
        }
        self.http = httpx.AsyncClient(timeout=10)

    def url(self, name: str, path: str) -> str:
        return f"http://127.0.0.1:{self.agents[name].config.port}{path}"

    async def lookup(self, name: str, keys: list[int], times: int = 1) -> dict:
        for _ in range(times):
            resp = await self.http.post(self.url(name, "/v1/lookup"), json={"hashes": keys})
        return resp.json()

    def holders(self, keys: list[int]) -> set[str]:
        return {n for n, a in self.agents.items() if a.store.contains_prefix(keys) == len(keys)}

    async def __aenter__(self) -> Cluster:
        for group in self.groups.values():
            await group.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()
        for group in self.groups.values():
            await group.stop()


async def hit_on_a(cl: Cluster, seed: int, n: int, *, hits: int) -> list[int]:
    """A chain of ``n`` blocks written on agent a and looked up there ``hits`` times."""
    keys = chain(seed, n)
    write(cl.agents["a"], keys, tensors(seed, n))
    await cl.lookup("a", keys, times=hits)
    return keys


async def after_round(agent: AgentService, done) -> None:
    """Wait (10 s at most) until ``done()`` holds after one of the agent's loop rounds."""

    async def wait() -> None:
        async with agent.replicator.round_done:
            await agent.replicator.round_done.wait_for(done)

    await asyncio.wait_for(wait(), 10)


def write(agent: AgentService, keys: list[int], values: list[torch.Tensor]) -> None:
    agent.write([Block(k, v) for k, v in zip(keys, values, strict=True)])


async def test_a_hot_prefix_reaches_k_nodes_and_survives_its_first_holder():
    clock = Clock()
    hot_keys, hot = chain(1, 4), tensors(1, 4)
    cold_keys, cold = chain(2, 3), tensors(2, 3)
    async with Cluster("abc", clock, k=2) as cl:
        a = cl.agents["a"]
        write(a, hot_keys, hot)
        write(a, cold_keys, cold)
        stored_events: dict[str, list] = {n: [] for n in "bc"}
        for n in "bc":
            cl.agents[n].publisher.listeners.append(stored_events[n].extend)
        assert (await cl.lookup("a", hot_keys, times=5))["prefix_blocks"] == 4  # hot: 5 hits
        await cl.lookup("a", cold_keys)  # cold: one hit
        clock.now += 1.0
        report = (await cl.http.post(cl.url("a", "/v1/replicate"))).json()
        assert sorted(report["alive"]) == ["a", "b", "c"] and report["hot"] == 1
        dst = next(n for n in rendezvous(hot_keys[-1], "abc") if n != "a")  # rendezvous order
        assert report["pushed"] == [{"prefix": hex(hot_keys[-1]), "dst": dst, "blocks": 4}]
        assert cl.holders(hot_keys) == {"a", dst}  # k = 2 after one round
        assert cl.holders(cold_keys) == {"a"}  # the cold prefix stays where it was
        b = cl.agents[dst]
        assert {b.blocks.version(k) for k in hot_keys} == {Version(1, "a")}
        await b.publisher.flush()
        stored = [k for ev in stored_events[dst] if isinstance(ev, BlockStored)
                  for k in ev.block_hashes]  # fmt: skip
        assert stored == hot_keys  # the receiver announces the copies as any stored block
        tracker = ChainTracker()
        tracker.apply(stored_events[dst])
        assert tracker.chain_to(hot_keys[-1]) == tuple(hot_keys)  # with their parent links
        # a second round: already on k nodes, nothing moves
        again = await a.replicator.replicate_once(clock.now)
        assert again.pushed == [] and again.plan.copies == ()
        assert not b.replicator.chains  # a's probes of what b holds (count_hit: false): no hits
        stats = (await cl.http.get(cl.url("a", "/v1/stats"))).json()["replication"]
        assert stats["rounds"] == 2 and stats["prefixes_pushed"] == 1
        assert stats["blocks_pushed"] == 4 and stats["bytes_pushed"] == 4 * BLOCK_BYTES
        assert stats["blocks_stored_by_peers"] == 4 and stats["lost"] == 0

        a_data = a.data_address
        await cl.groups["a"].stop()  # the first holder goes away for real
        with pytest.raises(PeerGone):  # its data port is closed
            await a.transport.fetch(a_data, hot_keys)
        other = ({"b", "c"} - {dst}).pop()
        look = await cl.lookup(dst, hot_keys, times=4)  # the prefix is still served, by dst
        assert look["prefix_blocks"] == 4
        pull = {"peer": b.data_address, "hashes": hot_keys}
        pulled = (await cl.http.post(cl.url(other, "/v1/pull"), json=pull)).json()
        assert pulled["stored"] == 4
        got = cl.agents[other].load(hot_keys)
        assert len(got) == 4 and all(same(g, t) for g, t in zip(got, hot, strict=True))
        # dst now sees the prefix hot; a is dead, the prefix is already on k alive nodes
        clock.now += 1.0
        report = await b.replicator.replicate_once(clock.now)
        assert sorted(report.alive) == sorted([dst, other]) and report.pushed == []


async def test_a_dead_holder_is_replaced_and_a_prefix_nobody_holds_is_lost():
    clock = Clock()
    keys, values = chain(3, 3), tensors(3, 3)
    gone_keys, gone = chain(4, 2), tensors(4, 2)
    async with Cluster("abc", clock, k=2) as cl:
        a, b = cl.agents["a"], cl.agents["b"]
        write(a, keys, values)
        write(b, keys, values)  # the prefix lives on a and b
        write(b, gone_keys, gone)
        await cl.lookup("b", keys, times=4)
        await cl.lookup("b", gone_keys, times=4)
        for k in gone_keys:
            b.store.remove(k)  # evicted: nobody holds it any more
        await cl.groups["a"].stop()
        report = await b.replicator.replicate_once(clock.now)
        assert sorted(report.alive) == ["b", "c"]
        assert [(c.prefix, c.dst) for c in report.pushed] == [(keys[-1], "c")]
        assert report.plan.lost == (gone_keys[-1],)
        assert cl.holders(keys) >= {"b", "c"}
        stats = b.stats()["replication"]
        assert stats["lost"] == 1 and stats["alive_peers"] == 1


@pytest.mark.parametrize("budget", ["blocks", "bytes"])
async def test_a_round_respects_its_budget(budget):
    clock = Clock()
    limit = {"blocks": {"max_blocks": 6}, "bytes": {"max_bytes": 6 * BLOCK_BYTES}}[budget]
    prefixes = [(chain(10 + i, 4), tensors(10 + i, 4)) for i in range(3)]
    smaller = (chain(20, 2), tensors(20, 2))
    async with Cluster("ab", clock, k=2, **limit) as cl:
        a = cl.agents["a"]
        for n, (keys, values) in enumerate([*prefixes, smaller]):
            write(a, keys, values)
            await cl.lookup("a", keys, times=10 - n)  # hottest first: the 4-block ones
        report = await a.replicator.replicate_once(clock.now)
        # 4 blocks go, the next 4-block copies do not fit in the 2 left; the 2-block one does
        assert [c.prefix for c in report.pushed] == [prefixes[0][0][-1], smaller[0][-1]]
        assert [c.prefix for c in report.deferred] == [p[0][-1] for p in prefixes[1:]]
        assert a.replicator.stats.blocks_pushed == 6 and len(cl.agents["b"].store) == 6
        report = await a.replicator.replicate_once(clock.now)  # the next round goes on
        assert [c.prefix for c in report.pushed] == [prefixes[1][0][-1]]
        stats = a.stats()["replication"]
        assert stats["deferred"] == 3 and stats["blocks_pushed"] == 10


async def test_hits_decay_and_the_loop_runs_on_its_trigger():
    clock = Clock()
    async with Cluster("ab", clock, k=2, half_life_s=10.0) as cl:
        a, keys = cl.agents["a"], await hit_on_a(cl, 5, 2, hits=4)
        clock.now += 30.0  # 4 hits decayed by 2**3: 0.5 < min_rate 3
        ticks: asyncio.Queue = asyncio.Queue()
        loop = asyncio.ensure_future(a.replicator.run(ticks.get))
        try:
            for hits, holders in ((0, {"a"}), (3, {"a", "b"})):  # cooled down, then hot again
                if hits:
                    await cl.lookup("a", keys, times=hits)
                rounds = a.replicator.stats.rounds
                ticks.put_nowait(None)
                await after_round(a, lambda r=rounds: a.replicator.stats.rounds > r)
                assert cl.holders(keys) == holders and a.replicator.stats.hot == len(holders) - 1
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)


async def test_a_started_agent_with_peers_runs_its_own_loop():
    async with Cluster("ab", Clock(), k=2, interval_s=0.01) as cl:
        a, keys = cl.agents["a"], await hit_on_a(cl, 6, 3, hits=3)
        await after_round(a, lambda: cl.holders(keys) == {"a", "b"})  # the agent's own loop
        assert a.replicator.stats.rounds >= 1 and a.replicator.stats.failed_rounds == 0
    assert a._loop.done()  # closing the agent stopped it


def test_kvgate_agent_options_configure_replication():
    args = build_parser().parse_args(
        ["agent", "--peer", "http://10.0.0.2:8100", "--peer", "http://10.0.0.3:8100",
         "--replicate-k", "3", "--replicate-interval", "2.5", "--replicate-min-rate", "8",
         "--replicate-max-blocks", "64", "--replicate-max-mib", "0.5"]
    )  # fmt: skip
    cfg = agent_config_from_args(args)
    assert cfg.peers == ("http://10.0.0.2:8100", "http://10.0.0.3:8100")
    r = cfg.replication
    assert (r.k, r.interval_s, r.min_rate, r.max_blocks, r.max_bytes) == (3, 2.5, 8.0, 64, 1 << 19)
    with pytest.raises(ValueError, match="k"):
        agent_config_from_args(build_parser().parse_args(["agent", "--replicate-k", "0"]))
