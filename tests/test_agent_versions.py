"""Per-block versions: on the wire (framing, TCP) and in the store's write path."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("zmq")

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
