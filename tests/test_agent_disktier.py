"""Disk tier: recycled files (spares) keep blocks byte-identical, atomic and bounded."""

from __future__ import annotations

import os
import random

import pytest

torch = pytest.importorskip("torch")

from tests.kvblocks import flip_byte, random_block, same_bytes  # noqa: E402
from worker_agent.blockfmt import HEADER_SIZE  # noqa: E402
from worker_agent.disktier import DiskTier  # noqa: E402
from worker_agent.errors import BlockFormatError, ChecksumMismatch  # noqa: E402
from worker_agent.tiers import BlockMeta  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]


def block(rng: random.Random, shape=None, dtype=None) -> torch.Tensor:
    """A random block; shape and dtype drawn from ``rng`` unless given."""
    shape = shape or (rng.randint(1, 3), 2, rng.choice([1, 4, 16]), 2, rng.choice([8, 64]))
    return random_block(rng, dtype or rng.choice(DTYPES), shape)


def files(path, suffix: str) -> list[str]:
    return sorted(name for name in os.listdir(path) if name.endswith(suffix))


def test_a_departed_blocks_file_is_overwritten_in_place(tmp_path):
    tier = DiskTier(tmp_path, 1 << 30)
    rng = random.Random(1)
    a, b = block(rng, (2, 2, 16, 2, 64)), block(rng, (2, 2, 16, 2, 64))
    tier.store(1, a, BlockMeta(), owned=False)
    inode = tier.path(1).stat().st_ino
    tier.delete(1)
    assert files(tmp_path, ".kvb") == [] and len(files(tmp_path, ".spare")) == 1
    tier.store(2, b, BlockMeta(parent=1), owned=False)
    assert tier.path(2).stat().st_ino == inode  # the same file, renamed: nothing was allocated
    assert files(tmp_path, ".spare") == [] and len(tier.spares) == 0
    assert same_bytes(tier.load(2), b)


def test_a_larger_spare_is_truncated_to_the_new_block(tmp_path):
    tier = DiskTier(tmp_path, 1 << 30)
    rng = random.Random(2)
    big, small = block(rng, (3, 2, 16, 2, 64)), block(rng, (1, 2, 4, 2, 8))
    tier.store(1, big, BlockMeta(), owned=False)
    tier.delete(1)
    tier.store(2, small, BlockMeta(), owned=False)
    assert tier.path(2).stat().st_size == HEADER_SIZE + small.nbytes
    assert same_bytes(tier.load(2), small)
    reopened = DiskTier(tmp_path, 1 << 30)
    assert reopened.scan() == [(2, small.nbytes, None)]  # a valid block file, not debris


def test_spares_are_bounded_and_removed_on_close_and_reopen(tmp_path):
    rng = random.Random(3)
    blocks = [block(rng, (1, 2, 16, 2, 64), torch.float16) for _ in range(3)]
    size = HEADER_SIZE + blocks[0].nbytes
    tier = DiskTier(tmp_path, 1 << 30, spare_bytes=2 * size)
    for k, t in enumerate(blocks):
        tier.store(k, t, BlockMeta(), owned=False)
    for k in range(3):
        tier.delete(k)
    assert len(files(tmp_path, ".spare")) == 2 and tier.spares.bytes == 2 * size
    assert files(tmp_path, ".kvb") == []  # the third was unlinked
    (tmp_path / ".1.2.spare").write_bytes(b"from a crashed run")
    assert DiskTier(tmp_path, 1 << 30).scan() == [] and files(tmp_path, ".spare") == []
    tier.close()
    assert os.listdir(tmp_path) == []


def test_corruption_of_a_recycled_file_is_detected(tmp_path):
    tier = DiskTier(tmp_path, 1 << 30)
    rng = random.Random(4)
    tier.store(1, block(rng, (1, 2, 16, 2, 64)), BlockMeta(), owned=False)
    tier.delete(1)
    t = block(rng, (1, 2, 16, 2, 64))
    tier.store(2, t, BlockMeta(), owned=False)
    with open(tier.path(2), "r+b") as fh:
        fh.seek(HEADER_SIZE + t.nbytes - 1)
        last = fh.read(1)[0]
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([last ^ 1]))
    with pytest.raises(ChecksumMismatch):
        tier.load(2)
    os.truncate(tier.path(2), HEADER_SIZE + 5)
    with pytest.raises(BlockFormatError):
        tier.load(2)


@pytest.mark.parametrize("seed", range(4))
def test_random_stores_and_deletes_stay_byte_identical(tmp_path, seed):
    rng = random.Random(seed)
    tier = DiskTier(tmp_path, 1 << 30, spare_bytes=rng.choice([0, 20_000, 1 << 30]))
    held: dict[int, torch.Tensor] = {}
    for _ in range(150):
        key = rng.randrange(12)
        if key in held and rng.random() < 0.5:
            tier.delete(key)
            del held[key]
        elif key not in held:
            held[key] = block(rng)
            tier.store(key, held[key], BlockMeta(parent=key or None), owned=False)
        for k in rng.sample(sorted(held), min(2, len(held))):
            assert same_bytes(tier.load(k), held[k])
        assert files(tmp_path, ".kvb") == sorted(tier.path(k).name for k in held)
        assert len(files(tmp_path, ".spare")) == len(tier.spares)
        assert tier.spares.bytes <= tier.spares.max_bytes
    assert tier.held() == (len(held), sum(HEADER_SIZE + t.nbytes for t in held.values()))


def chunked_tier(tmp_path, chunk: int = 1024) -> DiskTier:
    """A tier that reads payloads larger than ``chunk`` in pieces (hashing each as it lands)."""
    tier = DiskTier(tmp_path, 1 << 30)
    tier.READ_CHUNK = chunk
    return tier


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_chunked_reads_catch_corruption_in_any_piece(tmp_path, where):
    tier = chunked_tier(tmp_path)
    rng = random.Random(5)
    t = block(rng, (3, 2, 16, 2, 64), torch.float16)  # 24 KiB: 24 pieces of 1 KiB
    tier.store(1, t, BlockMeta(), owned=False)
    assert same_bytes(tier.load(1), t)
    offset = {"first": 3, "middle": t.nbytes // 2 + 7, "last": t.nbytes - 1}[where]
    flip_byte(tier.path(1), HEADER_SIZE + offset)
    with pytest.raises(ChecksumMismatch):
        tier.load(1)
    tier.verify = False  # the documented trade: payload bytes unchecked, the header still is
    assert not same_bytes(tier.load(1), t)


@pytest.mark.parametrize("chunk", [1024, 1 << 20])
def test_truncated_files_fail_in_either_read_path(tmp_path, chunk):
    tier = chunked_tier(tmp_path, chunk)
    rng = random.Random(6)
    t = block(rng, (3, 2, 16, 2, 64), torch.float16)
    for cut in (0, HEADER_SIZE // 2, HEADER_SIZE, HEADER_SIZE + 5000, HEADER_SIZE + t.nbytes - 1):
        tier.store(1, t, BlockMeta(), owned=False)
        os.truncate(tier.path(1), cut)
        with pytest.raises(BlockFormatError):
            tier.load(1)
        tier.delete(1)


def test_a_file_holding_another_blocks_header_is_refused(tmp_path):
    tier = DiskTier(tmp_path, 1 << 30)
    rng = random.Random(7)
    shape = (1, 2, 16, 2, 64)
    a, b = block(rng, shape, torch.float16), block(rng, shape, torch.float16)
    tier.store(1, a, BlockMeta(), owned=False)
    tier.store(2, b, BlockMeta(), owned=False)
    os.replace(tier.path(2), tier.path(1))  # same size, valid on its own, wrong block
    for verify in (True, False):
        tier.verify = verify
        with pytest.raises(BlockFormatError):
            tier.load(1)
    flip_byte(tier.path(1), 20)  # the header itself (its key field)
    with pytest.raises(BlockFormatError):
        tier.load(1)


def test_reopened_blocks_load_against_the_headers_found(tmp_path):
    rng = random.Random(8)
    t = block(rng, (2, 2, 16, 2, 64), torch.bfloat16)
    DiskTier(tmp_path, 1 << 30).store(3, t, BlockMeta(parent=2), owned=False)
    reopened = DiskTier(tmp_path, 1 << 30)
    assert reopened.scan() == [(3, t.nbytes, 2)]
    assert same_bytes(reopened.load(3), t)
    flip_byte(reopened.path(3), HEADER_SIZE + 100)
    with pytest.raises(ChecksumMismatch):
        reopened.load(3)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8,
              torch.int8, torch.float8_e4m3fn, torch.float8_e5m2],
)  # fmt: skip
@pytest.mark.parametrize("shape", [(), (1,), (0,), (2, 0, 3), (1, 2, 16, 2, 64)])
def test_every_dtype_and_shape_round_trips(tmp_path, dtype, shape):
    tier = chunked_tier(tmp_path, 256)
    t = random_block(random.Random(9), dtype, shape)
    tier.store(1, t, BlockMeta(), owned=False)
    got = tier.load(1)
    assert same_bytes(got, t) and got.is_contiguous()
    tier.store(2, t.transpose(0, -1) if t.dim() > 1 else t, BlockMeta(), owned=False)
    assert same_bytes(tier.load(2), (t.transpose(0, -1) if t.dim() > 1 else t).contiguous())


def test_short_reads_are_resumed(tmp_path, monkeypatch):
    import worker_agent.disktier as disktier

    real = os.preadv

    def trickle(fd, bufs, offset):  # the kernel may return less than asked: at most 777 bytes
        room, cut = 777, []
        for b in bufs:
            if room:
                cut.append(b[: min(len(b), room)])
                room -= len(cut[-1])
        return real(fd, cut, offset)

    monkeypatch.setattr(disktier.os, "preadv", trickle)
    rng = random.Random(10)
    t = block(rng, (2, 2, 16, 2, 64), torch.float16)
    for chunk in (1000, 1 << 20):
        tier = chunked_tier(tmp_path / str(chunk), chunk)
        tier.store(1, t, BlockMeta(), owned=False)
        assert same_bytes(tier.load(1), t)
