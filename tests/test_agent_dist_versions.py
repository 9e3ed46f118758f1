"""Block versions over torch.distributed (gloo, two real processes), held to what TCP does.

One script of fetches and pushes between two versioned nodes ``a`` (rank 0) and ``b`` (rank 1) runs
over gloo and over TCP; both runs must record the same versions, acks, refusals and bytes, and
those are checked against the expected values too (so an equal failure on both cannot pass).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from tests.test_agent_dist import digest, free_port, reference_blocks  # noqa: E402
from worker_agent.blockfmt import Block  # noqa: E402
from worker_agent.migration import Version  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"
)

REF = reference_blocks()
K = list(REF)  # K[0..3]: the keys in play; the other tensors are bytes of rewrites
T = list(REF.values())
MISSING = 42

# (actor, op, what the actor sends): the peer serves each step with its VersionedBlocks' hooks
STEPS = (
    ("b", "fetch", lambda node: [K[0], MISSING, K[1]]),  # b's K[1] is newer: that copy is stale
    ("a", "push", lambda node: node.export_blocks([K[1]])),  # a's older K[1]: refused, counted
    ("b", "push", lambda node: node.export_blocks([K[1]])),  # b's newer K[1]: replaces a's
    ("b", "push", lambda node: node.export_blocks([K[1]])),  # the same again: a duplicate
    (
        "a",
        "push",
        lambda node: [Block(K[2], T[2], version=Version(7, "z")), Block(K[3], T[3])],
    ),  # a version not the sender's own, and an unversioned block, in one batch
)


def initial(name: str):
    from worker_agent.store import KVBlockStore
    from worker_agent.versioned import VersionedBlocks

    node = VersionedBlocks(
        KVBlockStore.create(gpu_bytes=1 << 24, cpu_bytes=0, gpu_device="cpu"), name
    )
    if name == "a":
        node.write([Block(K[0], T[0]), Block(K[1], T[1])])  # (1, "a") each
        node.write([Block(K[1], T[4])])  # K[1] at (2, "a")
    else:
        for t in T[5:8]:
            node.write([Block(K[1], t)])  # K[1] at (3, "b"), bytes T[7]
    return node


def vstr(v: Version | None) -> str:
    return "None" if v is None else f"{v.counter}:{v.writer}"


def record_fetch(node, blocks: list[Block]) -> dict:
    got = [[str(b.key), vstr(b.version), digest(b.tensor)] for b in blocks]
    return {"got": got, "applied": dataclasses.asdict(node.apply(blocks))}


def final_state(node, steps: dict) -> dict:
    held = {
        str(k): [vstr(node.version(k)), digest(node.store.get(k))] for k in K if k in node.store
    }
    return {"steps": steps, "held": held, "totals": dataclasses.asdict(node.totals)}


# -- gloo ------------------------------------------------------------------------------------------
def _worker(rank: int, port: int, out_dir: str) -> None:
    from worker_agent.transport.dist import DistTransport, init_process_group

    init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, 2, timeout_s=30)
    try:
        me, peer = "ab"[rank], 1 - rank
        node, t, steps = initial(me), DistTransport(), {}
        for i, (actor, op, what) in enumerate(STEPS):
            if actor != me:
                served = t.serve_one(peer, node.store, export=node.export, accept=node.accept)
                assert served.name == op.upper(), (i, served)
            elif op == "fetch":
                steps[str(i)] = record_fetch(node, t.fetch_sync(peer, what(node)))
            else:
                steps[str(i)] = {"ack": t.push_sync(peer, what(node))}
        with open(f"{out_dir}/{me}.json", "w") as f:
            json.dump(final_state(node, steps), f)
    finally:
        dist.destroy_process_group()


def run_gloo(tmp_path) -> dict:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    return {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab"}


# -- tcp -------------------------------------------------------------------------------------------
async def run_tcp() -> dict:
    from worker_agent.transport.tcp import TcpBlockServer, TcpTransport

    nodes = {n: initial(n) for n in "ab"}
    servers = {
        n: TcpBlockServer(node.store, export=node.export, accept=node.accept)
        for n, node in nodes.items()
    }
    client, steps = TcpTransport(), {"a": {}, "b": {}}
    async with servers["a"], servers["b"]:
        for i, (actor, op, what) in enumerate(STEPS):
            node, peer = nodes[actor], servers["b" if actor == "a" else "a"].address
            if op == "fetch":
                steps[actor][str(i)] = record_fetch(node, await client.fetch(peer, what(node)))
            else:
                steps[actor][str(i)] = {"ack": await client.push(peer, what(node))}
    await client.close()
    return {n: final_state(node, steps[n]) for n, node in nodes.items()}


def counts(**kw) -> dict:
    base = {"stored": 0, "replaced": 0, "stale": 0, "duplicate": 0, "rejected": 0}
    return {**base, **kw}


async def test_versions_over_gloo_match_tcp(tmp_path):
    gloo = run_gloo(tmp_path)
    tcp = await run_tcp()
    a, b = gloo["a"], gloo["b"]
    d = [digest(t) for t in T]
    # b fetched a's blocks with a's versions and bytes; a's K[1] lost to b's newer one
    assert b["steps"]["0"]["got"] == [[str(K[0]), "1:a", d[0]], [str(K[1]), "2:a", d[4]]]
    assert b["steps"]["0"]["applied"] == counts(stored=1, stale=1)
    assert a["steps"]["1"] == {"ack": 0}  # the stale push: nothing stored ...
    assert b["steps"]["2"] == {"ack": 1} and b["steps"]["3"] == {"ack": 0}
    assert a["steps"]["4"] == {"ack": 2}
    # ... and counted by the receiver: the stale fetch above plus the stale push
    assert b["totals"] == counts(stored=3, stale=2)
    assert a["totals"] == counts(stored=1, replaced=1, duplicate=1)
    assert a["held"] == {str(K[0]): ["1:a", d[0]], str(K[1]): ["3:b", d[7]]}
    assert b["held"] == {
        str(K[0]): ["1:a", d[0]],
        str(K[1]): ["3:b", d[7]],  # never overwritten by a's older copies
        str(K[2]): ["7:z", d[2]],  # a pushed version arrives as sent, not as the sender's
        str(K[3]): ["0:", d[3]],  # no version: the lowest
    }
    assert gloo == tcp
