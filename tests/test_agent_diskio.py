"""Batch reads of the disk tier: two threads, every block byte-identical and verified, read once."""

from __future__ import annotations

import random
import threading

import pytest

torch = pytest.importorskip("torch")

from tests.kvblocks import flip_byte, random_block, same_bytes  # noqa: E402
from worker_agent.blockfmt import HEADER_SIZE  # noqa: E402
from worker_agent.diskio import read_all  # noqa: E402
from worker_agent.disktier import DiskTier  # noqa: E402
from worker_agent.errors import ChecksumMismatch  # noqa: E402
from worker_agent.tiers import BlockMeta  # noqa: E402

SHAPE = (3, 2, 16, 2, 64)  # 24 KiB in float16


def filled_tier(tmp_path, n: int, seed: int = 0, chunk: int = 4096):
    tier = DiskTier(tmp_path, 1 << 30)
    tier.READ_CHUNK = chunk  # several pieces per block: the chunked read path runs too
    rng = random.Random(seed)
    blocks = {k: random_block(rng, torch.float16, SHAPE) for k in range(1, n + 1)}
    for k, t in blocks.items():
        tier.store(k, t, BlockMeta(), owned=False)
    return tier, blocks


def test_read_all_uses_both_threads_and_keeps_errors_in_place():
    names: set[str] = set()
    both = threading.Event()

    def read(i: int) -> int:
        names.add(threading.current_thread().name)
        if len(names) < 2:
            assert both.wait(10)  # the first reader waits until the other thread has read one
        else:
            both.set()
        if i == 5:
            raise OSError("gone")
        return i * i

    out = read_all(read, 12, helpers=1)
    assert len(names) == 2 and threading.current_thread().name in names
    assert isinstance(out[5], OSError)
    assert [x for i, x in enumerate(out) if i != 5] == [i * i for i in range(12) if i != 5]
    assert all(t.name != "kv-read" for t in threading.enumerate())  # joined before returning


def test_read_all_without_helpers_stays_on_the_caller():
    seen = []
    assert read_all(lambda i: seen.append(threading.current_thread()) or i, 4, helpers=0) == [
        0, 1, 2, 3,
    ]  # fmt: skip
    assert set(seen) == {threading.current_thread()}
    assert read_all(lambda i: i, 0) == []


@pytest.mark.parametrize("seed", range(3))
def test_blocks_read_ahead_are_byte_identical_and_served_once(tmp_path, seed):
    tier, blocks = filled_tier(tmp_path, 9, seed)
    rng = random.Random(seed)
    keys = list(blocks) + [404]  # a key the tier does not hold is ignored
    rng.shuffle(keys)
    with tier.read_ahead(keys):
        assert set(tier._ahead) == set(blocks)  # read before the block runs
        for k in rng.sample(list(blocks), len(blocks)):
            assert same_bytes(tier.load(k), blocks[k])
            assert k not in tier._ahead  # handed out once
        assert same_bytes(tier.load(3), blocks[3])  # again: from the file
    assert tier._ahead == {}


def test_corruption_is_detected_in_a_batch_read(tmp_path):
    tier, blocks = filled_tier(tmp_path, 6)
    flip_byte(tier.path(4), HEADER_SIZE + 5000)
    with tier.read_ahead(blocks):
        for k, t in blocks.items():
            if k == 4:
                with pytest.raises(ChecksumMismatch):
                    tier.load(k)
            else:
                assert same_bytes(tier.load(k), t)
    tier.verify = False  # the documented trade: payload bytes unchecked
    with tier.read_ahead(blocks):
        assert not same_bytes(tier.load(4), blocks[4])
        assert same_bytes(tier.load(5), blocks[5])


def test_a_block_deleted_or_replaced_in_a_batch_is_read_from_its_new_file(tmp_path):
    tier, blocks = filled_tier(tmp_path, 4)
    other = random_block(random.Random(99), torch.float16, SHAPE)
    with tier.read_ahead(blocks):
        tier.delete(2)  # its read ahead is dropped with it; its file becomes a spare
        assert 2 not in tier._ahead
        tier.store(2, other, BlockMeta(), owned=False)  # the spare, overwritten
        assert same_bytes(tier.load(2), other)
        with tier.read_ahead(blocks):  # nested: nothing more is read
            assert set(tier._ahead) == {1, 3, 4}
        assert same_bytes(tier.load(1), blocks[1])


def test_a_single_block_is_not_read_ahead(tmp_path):
    tier, blocks = filled_tier(tmp_path, 2)
    with tier.read_ahead([1, 77]):
        assert tier._ahead == {}
        assert same_bytes(tier.load(1), blocks[1])
