"""Batched moves and prefix reads (disk reads ahead on two threads) equal their per-block forms."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from tests.kvblocks import random_block, same_bytes  # noqa: E402
from tests.test_agent_store import (  # noqa: E402
    NB,
    Recorder,
    check_invariants,
    make_store,
)
from worker_agent.blockfmt import HEADER_SIZE  # noqa: E402

BLK = NB * 2  # bytes of a float16 block


def twin_stores(tmp_path, seed: int, read_ahead: int):
    """Two stores given the same random puts (the tiers tight enough to demote and drop)."""
    rng = random.Random(seed)
    out = []
    for name in ("batched", "single"):
        rec = Recorder()
        store = make_store(
            tmp_path / name, gpu=3 * BLK, cpu=5 * BLK, disk=12 * (BLK + HEADER_SIZE), rec=rec
        )
        store.READ_AHEAD = read_ahead
        out.append((store, rec))
    blocks = {k: random_block(rng) for k in range(30)}
    for _ in range(60):
        k = rng.randrange(30)
        for store, _rec in out:
            store.put(k, blocks[k], parent=k - 1 if k else None)
    return out, blocks, rng


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("read_ahead", [2, 5, 64])
def test_move_many_equals_moves_one_by_one(tmp_path, seed, read_ahead):
    ((batched, brec), (single, srec)), blocks, rng = twin_stores(tmp_path, seed, read_ahead)
    for _ in range(25):
        keys = [rng.randrange(32) for _ in range(rng.randrange(12))]  # repeats, absent keys
        tier = rng.randrange(3)
        moved = batched.move_many(keys, tier)
        for k in keys:
            if k in single:
                single.move(k, tier)
        assert moved == sum(single.locate([k]) == [tier] for k in keys)
        assert batched.locate(range(32)) == single.locate(range(32))
        assert batched.stats() == single.stats()
        assert brec.where == srec.where
        check_invariants(batched, brec)
        for k in rng.sample(range(32), 4):
            a, b = batched.export(k), single.export(k)
            assert (a is None) == (b is None)
            if a is not None:
                assert same_bytes(a[1], blocks[k]) and same_bytes(b[1], blocks[k])


@pytest.mark.parametrize("seed", range(4))
def test_get_prefix_reads_ahead_and_equals_gets_one_by_one(tmp_path, seed):
    ((batched, brec), (single, srec)), blocks, rng = twin_stores(tmp_path, seed, 3)
    for _ in range(20):
        start = rng.randrange(30)
        keys = list(range(start, min(30, start + rng.randrange(1, 10))))
        got = batched.get_prefix(keys)
        ref = []
        for k in reversed(keys[: single.contains_prefix(keys)]):
            ref.append(single.get(k))
        ref.reverse()
        assert len(got) == len(ref)
        assert all(same_bytes(g, blocks[k]) for g, k in zip(got, keys, strict=False))
        assert batched.locate(range(30)) == single.locate(range(30))
        assert batched.stats() == single.stats()
        assert brec.where == srec.where
        check_invariants(batched, brec)


def test_a_corrupt_block_in_a_batch_is_lost_and_cuts_the_prefix(tmp_path, caplog):
    rec = Recorder()
    store = make_store(tmp_path, gpu=8 * BLK, cpu=8 * BLK, disk=1 << 20, rec=rec)
    rng = random.Random(3)
    blocks = {k: random_block(rng) for k in range(1, 7)}
    for k, t in blocks.items():
        store.put(k, t, parent=k - 1 if k > 1 else None, tier=2)
    path = store.tiers[2].path(3)
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 9] ^= 0x01
    path.write_bytes(bytes(data))
    got = store.get_prefix(list(blocks))
    assert [same_bytes(g, blocks[k]) for g, k in zip(got, blocks, strict=False)] == [True, True]
    assert 3 not in store and "checksum" in caplog.text
    assert store.locate([1, 2, 4, 5, 6]) == [0] * 5  # the others were promoted all the same
    assert store.stats().lost == 1
    check_invariants(store, rec)
    assert store.move_many([4, 5, 6, 3], 2) == 3 and store.locate([4, 5, 6]) == [2, 2, 2]
    assert store.move_many([6, 5, 4], 1) == 3
    assert all(same_bytes(store.get(k), blocks[k]) for k in (4, 5, 6))
