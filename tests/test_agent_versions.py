"""Per-block versions: on the wire (framing, TCP), in the store's write path, between real agents."""

from __future__ import annotations

import itertools
import random

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("zmq")

from tests.test_agent_service import Running, chain, config, same, tensors  # noqa: E402
from worker_agent.blockfmt import Block  # noqa: E402
from worker_agent.errors import ProtocolError  # noqa: E402
from worker_agent.migration import UNVERSIONED, Version  # noqa: E402
from worker_agent.store import KVBlockStore  # noqa: E402
from worker_agent.transport.framing import pack_versions, unpack_versions  # noqa: E402
from worker_agent.transport.tcp import TcpBlockServer, TcpTransport  # noqa: E402
from worker_agent.versioned import VersionedBlocks  # noqa: E402


def versioned(node: str) -> VersionedBlocks:
    return VersionedBlocks(
        KVBlockStore.create(gpu_bytes=1 << 20, cpu_bytes=0, gpu_device="cpu"), node
    )


def block(key: int, fill: float) -> Block:
    return Block(key, torch.full((4, 8), fill, dtype=torch.float16))


def test_versions_round_trip_the_frame_body():
    vs = [Version(3, "a"), None, Version(1 << 63, "ünïcode"), Version(7, "")]
    body = pack_versions(vs)
    want = [Version(3, "a"), UNVERSIONED, Version(1 << 63, "ünïcode"), Version(7, "")]
    assert unpack_versions(body, 4) == want
    assert pack_versions([None, UNVERSIONED]) == b""  # nothing versioned: the old wire format
    assert unpack_versions(b"", 2) == [UNVERSIONED] * 2
    for bad in (body[:-1], body + b"\0", body[:5]):
        with pytest.raises(ProtocolError):
            unpack_versions(bad, 4)
    with pytest.raises(ProtocolError):
        pack_versions([Version(1, "w" * 256)])


def test_a_copy_applies_only_when_newer():
    node = versioned("b")
    key = 11
    assert node.write([block(key, 1.0)]) == [Version(1, "b")]
    assert node.write([block(key, 2.0)]) == [Version(2, "b")]  # a rewrite bumps
    stale = node.apply([block(key, 9.0)._replace(version=Version(1, "z"))])
    assert (stale.stored, stale.stale) == (0, 1)
    assert float(node.store.get(key)[0, 0]) == 2.0 and node.version(key) == Version(2, "b")
    dup = node.apply([block(key, 9.0)._replace(version=Version(2, "b"))])
    assert (dup.stored, dup.duplicate) == (0, 1)
    plain = node.apply([block(key, 9.0)])  # no version: the lowest, never overwrites
    assert plain.stale == 1 and float(node.store.get(key)[0, 0]) == 2.0
    newer = node.apply([block(key, 5.0)._replace(version=Version(2, "c"))])  # writer breaks ties
    assert (newer.stored, newer.replaced) == (1, 1)
    assert float(node.store.get(key)[0, 0]) == 5.0 and node.version(key) == Version(2, "c")
    assert node.write([block(key, 6.0)]) == [Version(3, "b")]  # past every version seen
    assert node.totals.stale == 2 and node.totals.duplicate == 1 and node.totals.stored == 1
    node.store.remove(key)
    assert node.version(key) is None and node.prune() == 1


def test_concurrent_writers_converge_to_the_highest_version_in_any_order():
    """Three nodes write the same keys; one pass of pushes between every ordered pair, in each of
    the 720 orders, leaves every node with the highest version's bytes of every key."""
    pairs = list(itertools.permutations("abc", 2))
    writes = {  # key -> writes per node (more writes: a higher counter)
        1: {"a": 1, "b": 2, "c": 1},  # b wins on its counter
        2: {"a": 1, "b": 1, "c": 1},  # a tie on counters: the highest writer id, c, wins
        3: {"a": 3},  # only a holds it
    }
    winners = {1: ("b", 2), 2: ("c", 1), 3: ("a", 3)}
    for order in itertools.permutations(pairs):
        nodes = {n: versioned(n) for n in "abc"}
        for key, per_node in writes.items():
            for n, times in per_node.items():
                for i in range(times):
                    nodes[n].write([block(key, ord(n) * 10 + i)])
        for src, dst in order:
            nodes[dst].apply(nodes[src].export_blocks(writes))
        for key, (writer, counter) in winners.items():
            want = float(ord(writer) * 10 + counter - 1)
            for n, node in nodes.items():
                assert node.version(key) == Version(counter, writer), (order, key, n)
                assert float(node.store.get(key)[0, 0]) == want, (order, key, n)


async def test_versions_travel_with_fetch_and_push_over_tcp():
    src, dst = versioned("a"), versioned("b")
    src.write([block(1, 1.0), block(2, 2.0)])
    src.write([block(2, 3.0)])  # key 2 at version 2
    dst.write([block(2, 7.0)] * 3)  # dst's key 2 is newer: version (3, "b")
    server = TcpBlockServer(src.store, export=src.export, accept=src.accept)
    client = TcpTransport()
    async with server:
        fetched = await client.fetch(server.address, [1, 2])
        assert [b.version for b in fetched] == [Version(1, "a"), Version(2, "a")]
        counts = dst.apply(fetched)
        assert (counts.stored, counts.stale) == (1, 1)
        assert float(dst.store.get(2)[0, 0]) == 7.0  # the stale copy did not overwrite
        # dst pushes its newer key 2 back: the server's accept hook replaces the older block
        assert await client.push(server.address, dst.export_blocks([2])) == 1
        assert src.version(2) == Version(3, "b") and float(src.store.get(2)[0, 0]) == 7.0
        assert await client.push(server.address, dst.export_blocks([2])) == 0  # a duplicate
        assert src.totals.duplicate == 1
    await client.close()


async def test_a_stale_push_between_agents_is_refused_and_counted():
    keys, old, new = chain(7, 3), tensors(7, 3), tensors(8, 3)
    async with Running(config("a"), config("b")) as run:
        a, b = run.agents
        ha, hb = run.http
        a.write([Block(k, t) for k, t in zip(keys, old, strict=True)])  # version (1, "a")
        b.write([Block(k, t) for k, t in zip(keys, old, strict=True)])
        b.write([Block(k, t) for k, t in zip(keys, new, strict=True)])  # version (2, "b")
        pushed = (await ha.post("/v1/push", json={"peer": b.data_address, "hashes": keys})).json()
        assert pushed["sent"] == 3 and pushed["stored_by_peer"] == 0
        assert all(same(b.store.get(k), t) for k, t in zip(keys, new, strict=True))
        versions = (await hb.get("/v1/stats")).json()["versions"]
        assert versions["stale"] == 3 and versions["stored"] == 0
        pulled = (await ha.post("/v1/pull", json={"peer": b.data_address, "hashes": keys})).json()
        assert pulled["stored"] == 3 and pulled["stale"] == 0  # a takes b's newer blocks
        assert all(same(a.store.get(k), t) for k, t in zip(keys, new, strict=True))
        assert {a.blocks.version(k) for k in keys} == {Version(2, "b")}


async def test_concurrent_writers_converge_across_real_agents():
    keys = chain(9, 2)
    rng = random.Random(9)
    async with Running(config("a"), config("b"), config("c")) as run:
        agents = {a.config.name: a for a in run.agents}
        for i, agent in enumerate(run.agents):  # a: once, b: twice, c: once -> (2, "b") wins
            for n in range(1 + (agent.config.name == "b")):
                agent.write([Block(k, torch.full((8,), float(10 * i + n))) for k in keys])
        pairs = list(itertools.permutations(agents, 2))
        rng.shuffle(pairs)
        async with httpx.AsyncClient(timeout=10) as http:
            for src, dst in pairs:
                url = f"http://127.0.0.1:{agents[src].config.port}/v1/push"
                body = {"peer": agents[dst].data_address, "hashes": keys}
                assert (await http.post(url, json=body)).status_code == 200
        for agent in run.agents:
            assert {agent.blocks.version(k) for k in keys} == {Version(2, "b")}
            assert all(float(agent.store.get(k)[0]) == 11.0 for k in keys)
