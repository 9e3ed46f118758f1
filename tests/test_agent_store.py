"""Tiered block store: byte identity through every tier path, LRU, disk reopen, events, counters."""

from __future__ import annotations

import os
import random

import pytest

torch = pytest.importorskip("torch")

from tests.kvblocks import random_block, same_bytes  # noqa: E402
from worker_agent.blockfmt import HEADER_SIZE, Block  # noqa: E402
from worker_agent.disktier import DiskTier  # noqa: E402
from worker_agent.events import BlockRemoved, BlockStored  # noqa: E402
from worker_agent.store import KVBlockStore  # noqa: E402
from worker_agent.tiers import MemoryTier  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block tokens, kv heads, head dim
NB = 2 * 2 * 4 * 2 * 8  # elements per block


class Recorder:
    """Replays the store's events into {key: medium}: must always equal the store's contents."""

    def __init__(self) -> None:
        self.where: dict[int, str] = {}
        self.batches: list[list] = []

    def __call__(self, events) -> None:
        self.batches.append(events)
        for ev in events:
            for h in ev.block_hashes:
                if isinstance(ev, BlockStored):
                    assert h not in self.where, f"{h} stored twice"
                    self.where[h] = ev.medium
                else:
                    assert self.where.pop(h) == ev.medium


def make_store(tmp_path, gpu, cpu, disk=0, rec=None, scan=1) -> KVBlockStore:
    return KVBlockStore.create(
        gpu_bytes=gpu,
        cpu_bytes=cpu,
        disk_bytes=disk,
        disk_dir=str(tmp_path / "disk") if disk else None,
        gpu_device="cpu",
        on_events=rec,
        scan=scan,
    )


def check_invariants(store: KVBlockStore, rec: Recorder | None = None) -> None:
    stats = store.stats()
    maintained = [(c.blocks, c.bytes) for c in stats.tiers]
    assert maintained == store.placement.recount() == store.physical()
    for c, tier in zip(stats.tiers, store.tiers, strict=True):
        assert c.bytes <= tier.capacity
    evicted = sum(c.evictions for c in stats.tiers)
    assert stats.blocks == stats.stored - evicted - stats.removed - stats.lost
    if rec is not None:
        held = {}
        for index, tier in enumerate(store.tiers):
            held.update(dict.fromkeys(store.placement.keys(index), tier.medium))
        assert rec.where == held


@pytest.mark.parametrize("seed", range(3))
def test_random_operations_keep_blocks_byte_identical(tmp_path, seed):
    rng = random.Random(seed)
    rec = Recorder()
    blk = NB * 4  # bytes of a float32 block
    store = make_store(tmp_path, gpu=3 * blk, cpu=4 * blk, disk=6 * (blk + HEADER_SIZE), rec=rec)
    reference: dict[int, torch.Tensor] = {}
    for step in range(400):
        key = rng.randrange(40)
        op = rng.random()
        if op < 0.4:
            if key not in reference:
                reference[key] = random_block(rng, rng.choice(DTYPES))
            was = key in store
            new = store.put(key, reference[key], parent=key - 1 if key else None)
            assert new is (not was) and key in store
        elif op < 0.8:
            present = key in store
            got = store.get(key)
            assert (got is not None) == present
            if got is not None:
                assert same_bytes(got, reference[key])
                assert store.locate([key]) == [0]
        elif op < 0.9 and key in store:
            store.move(key, rng.randrange(3))
        else:
            store.remove(key)
        if step % 20 == 0:
            for k in list(reference):
                exported = store.export(k)
                if exported is not None:
                    header, host = exported
                    assert same_bytes(host, reference[k]) and header.key == k
        check_invariants(store, rec)
    s = store.stats()
    assert s.tiers[0].demotions and s.tiers[1].demotions and s.tiers[2].evictions
    assert sum(c.promotions for c in s.tiers) and s.misses


def test_lru_demotion_and_promotion_order(tmp_path):
    rec = Recorder()
    blk = NB * 2
    store = make_store(tmp_path, gpu=2 * blk, cpu=2 * blk, disk=2 * (blk + HEADER_SIZE), rec=rec)
    rng = random.Random(0)
    blocks = {k: random_block(rng) for k in range(1, 7)}
    for k in range(1, 7):
        store.put(k, blocks[k])
    assert store.locate(range(1, 7)) == [2, 2, 1, 1, 0, 0]
    got = store.get(1)  # disk hit: promoted to the top, everything shifts down one
    assert same_bytes(got, blocks[1])
    assert store.locate(range(1, 7)) == [0, 2, 2, 1, 1, 0]
    store.put(7, random_block(rng))  # cascade: gpu LRU 6 -> cpu, cpu LRU 4 -> disk, disk drops 2
    assert store.locate(range(1, 8)) == [0, None, 2, 2, 1, 1, 0]
    s = store.stats()
    assert (s.tiers[2].hits, s.tiers[2].promotions, s.tiers[2].evictions) == (1, 1, 1)
    check_invariants(store, rec)


def test_chain_put_and_prefix_keep_roots_hot(tmp_path):
    blk = NB * 2
    store = make_store(tmp_path, gpu=2 * blk, cpu=10 * blk)
    rng = random.Random(1)
    chain = [Block(k, random_block(rng)) for k in (11, 12, 13, 14)]
    assert store.put_blocks(chain) == 4
    assert store.locate([11, 12, 13, 14]) == [0, 0, 1, 1]  # the root stays in the fast tier
    assert store.contains_prefix([11, 12, 13, 99, 14]) == 3
    assert store.contains_prefix([99, 11]) == 0
    got = store.get_prefix([11, 12, 13, 14, 15])
    assert len(got) == 4 and all(same_bytes(g, b.tensor) for g, b in zip(got, chain, strict=True))
    assert store.locate([11, 12]) == [0, 0]  # promoted last-to-first: the root ends up hot
    assert store.contains_prefix([]) == 0 and store.get_prefix([99]) == []


def test_put_copies_unless_handed_over(tmp_path):
    store = make_store(tmp_path, gpu=10_000, cpu=10_000)
    t = torch.ones(SHAPE, dtype=torch.float16)
    store.put(1, t)
    t.fill_(2.0)
    assert torch.all(store.get(1) == 1.0)
    u = torch.ones(SHAPE, dtype=torch.float16)
    store.put(2, u, copy=False)
    assert store.get(2).data_ptr() == u.data_ptr()  # kept as is: zero copies
    assert store.put(2, u) is False  # already present


def test_disk_tier_survives_reopen(tmp_path):
    rng = random.Random(5)
    blocks = {k: random_block(rng, DTYPES[k % 3]) for k in range(8)}
    store = make_store(tmp_path, gpu=1, cpu=1, disk=1 << 20)
    for k, t in blocks.items():
        store.put(k, t, parent=k - 1 if k else None)
    assert store.locate(blocks) == [2] * 8
    (tmp_path / "disk" / ".leftover.tmp").write_bytes(b"partial write")
    store.close()
    rec = Recorder()
    reopened = make_store(tmp_path, gpu=NB * 4, cpu=NB * 4, disk=1 << 20, rec=rec)
    assert len(reopened) == 8 and not (tmp_path / "disk" / ".leftover.tmp").exists()
    snapshot = reopened.snapshot_events()
    assert sorted(h for ev in snapshot for h in ev.block_hashes) == sorted(blocks)
    rec.where = {h: "DISK" for h in blocks}
    for k, t in blocks.items():
        assert same_bytes(reopened.get(k), t)
    assert reopened.export(3)[0].parent == 2
    check_invariants(reopened, rec)


def test_disk_corruption_is_detected_and_dropped(tmp_path, caplog):
    rec = Recorder()
    rng = random.Random(9)
    store = make_store(tmp_path, gpu=1, cpu=1, disk=1 << 20, rec=rec)
    store.put(1, random_block(rng))
    store.put(2, random_block(rng))
    path = store.tiers[2].path(1)
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 17] ^= 0x10
    path.write_bytes(bytes(data))
    assert store.get(1) is None
    assert 1 not in store and not path.exists() and "checksum" in caplog.text
    os.truncate(store.tiers[2].path(2), HEADER_SIZE + 3)
    assert store.export(2) is None and len(store) == 0
    s = store.stats()
    assert (s.lost, s.misses) == (2, 1)
    check_invariants(store, rec)


def test_truncated_file_is_dropped_on_reopen(tmp_path):
    store = make_store(tmp_path, gpu=1, cpu=1, disk=1 << 20)
    store.put(1, torch.zeros(SHAPE))
    store.put(2, torch.zeros(SHAPE))
    os.truncate(store.tiers[2].path(1), 100)
    store.close()
    reopened = make_store(tmp_path, gpu=1, cpu=1, disk=1 << 20)
    assert 1 not in reopened and 2 in reopened


def test_events_describe_moves(tmp_path):
    rec = Recorder()
    blk = NB * 2
    store = make_store(tmp_path, gpu=blk, cpu=blk, rec=rec)
    a, b = torch.zeros(SHAPE, dtype=torch.float16), torch.ones(SHAPE, dtype=torch.float16)
    store.put(1, a, token_ids=range(4))
    store.put(2, b, parent=1, token_ids=range(4, 8))
    assert rec.batches[-1] == [
        BlockRemoved((1,), "GPU"),
        BlockStored((1,), None, (0, 1, 2, 3), 4, "CPU"),
        BlockStored((2,), 1, (4, 5, 6, 7), 4, "GPU"),
    ]
    store.clear()
    assert rec.where == {} and len(store) == 0


def test_memory_only_tier_list_and_capacity_errors():
    store = KVBlockStore([MemoryTier("GPU", "cpu", 100)])
    with pytest.raises(Exception, match="fits no tier"):
        store.put(1, torch.zeros(100, dtype=torch.float32))
    with pytest.raises(ValueError):
        store.put(2, torch.zeros(2, dtype=torch.int64))
    assert store.stats().rejected == 1


def test_disk_tier_alone_round_trips(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    store = KVBlockStore([tier])
    rng = random.Random(2)
    t = random_block(rng, torch.bfloat16)
    store.put(5, t)
    assert tier.path(5).stat().st_size == HEADER_SIZE + t.nbytes
    assert same_bytes(store.get(5), t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tiers_round_trip_async(tmp_path):  # pragma: no cover - needs CUDA
    rng = random.Random(11)
    store = KVBlockStore.create(
        gpu_bytes=2 * NB * 4, cpu_bytes=4 * NB * 4, disk_bytes=1 << 20, disk_dir=str(tmp_path)
    )
    assert store.tiers[0].device.type == "cuda" and store.tiers[1].pinned
    blocks = {k: random_block(rng, DTYPES[k % 3]) for k in range(10)}
    for k, t in blocks.items():
        store.put(k, t.cuda())
    for k, t in blocks.items():
        got = store.get(k)
        assert got.is_cuda and same_bytes(got, t)
    check_invariants(store)
