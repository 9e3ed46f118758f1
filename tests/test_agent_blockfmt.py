"""Block serialisation: round trips over dtypes/shapes, zero-copy views, corruption detection."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from tests.kvblocks import random_block, same_bytes  # noqa: E402
from worker_agent.blockfmt import (  # noqa: E402
    HEADER_SIZE,
    BlockHeader,
    byte_view,
    encode_block,
    header_for,
    payload_view,
    read_block,
    write_block_into,
)
from worker_agent.errors import BlockFormatError, ChecksumMismatch  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_byte_identical(dtype):
    rng = random.Random(1234)
    for _ in range(20):
        shape = (rng.randint(1, 4), 2, rng.choice([1, 16]), rng.randint(1, 3), rng.choice([8, 64]))
        t = random_block(rng, dtype, shape)
        key, parent = rng.getrandbits(64), rng.choice([None, 0, rng.getrandbits(64)])
        data = encode_block(key, t, parent=parent)
        assert len(data) == HEADER_SIZE + t.nbytes
        header, back = read_block(data)
        assert (header.key, header.parent, header.shape, header.dtype) == (
            key,
            parent,
            shape,
            dtype,
        )
        assert same_bytes(back, t)


def test_write_into_shared_buffer_and_view_without_copy():
    rng = random.Random(7)
    t = random_block(rng, torch.bfloat16, (2, 2, 16, 2, 64))
    buf = bytearray(HEADER_SIZE + t.nbytes + 100)
    end = write_block_into(buf, 42, t, parent=41)
    assert end == HEADER_SIZE + t.nbytes
    header, view = read_block(buf, copy=False)
    assert same_bytes(view, t) and header.parent == 41
    buf[HEADER_SIZE] ^= 0xFF  # the view aliases the buffer: no copy was made
    assert byte_view(view)[0].item() == byte_view(t)[0].item() ^ 0xFF
    with pytest.raises(BlockFormatError):
        read_block(bytes(buf), copy=False)  # read-only buffers cannot be viewed in place


def test_shared_memory_segment_round_trip():
    from multiprocessing import shared_memory

    t = torch.arange(2 * 2 * 16 * 2 * 8, dtype=torch.float32).view(2, 2, 16, 2, 8)
    shm = shared_memory.SharedMemory(create=True, size=HEADER_SIZE + t.nbytes)
    try:
        write_block_into(shm.buf, 9, t)
        other = shared_memory.SharedMemory(name=shm.name)  # what a second process would map
        header, view = read_block(other.buf, copy=False)
        assert header.key == 9 and same_bytes(view, t)
        del view
        other.close()
    finally:
        shm.close()
        shm.unlink()


def test_payload_view_aliases_tensor_storage():
    t = torch.zeros(4, 2, 8, dtype=torch.float16)
    view = payload_view(t)
    assert len(view) == t.nbytes and view.format == "B"
    t[0, 0, 0] = 1.0
    assert (
        bytes(view[:2])
        == torch.tensor([1.0], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    )


def test_payload_corruption_is_detected():
    rng = random.Random(3)
    t = random_block(rng, torch.float32, (2, 2, 4, 2, 8))
    data = bytearray(encode_block(99, t))
    pos = HEADER_SIZE + rng.randrange(t.nbytes)
    data[pos] ^= 0x01
    with pytest.raises(ChecksumMismatch) as info:
        read_block(data)
    assert info.value.key == 99
    header, _ = read_block(data, verify=False)  # the header itself is intact
    assert header.key == 99


@pytest.mark.parametrize("offset", [0, 5, 16, 33, 50])
def test_header_corruption_is_detected(offset):
    t = torch.arange(64, dtype=torch.float16).view(2, 2, 2, 2, 4)
    data = bytearray(encode_block(5, t))
    data[offset] ^= 0x40
    with pytest.raises(BlockFormatError):
        read_block(data)


def test_truncated_and_inconsistent_blocks_are_rejected():
    t = torch.ones(2, 2, 4, 1, 8)
    data = encode_block(1, t)
    with pytest.raises(BlockFormatError):
        read_block(data[:-1])
    with pytest.raises(BlockFormatError):
        read_block(data[: HEADER_SIZE - 1])
    bad = BlockHeader(1, torch.float32, (2, 3), nbytes=7)  # 7 != 2*3*4
    with pytest.raises(BlockFormatError):
        BlockHeader.unpack(bad.pack())


def test_header_fields_round_trip():
    t = torch.empty(3, 2, 16, 4, 128, dtype=torch.bfloat16)
    h = header_for((1 << 64) - 1, t, parent=0, csum=123)
    back = BlockHeader.unpack(h.pack())
    assert back == h and back.nbytes == t.nbytes
    assert BlockHeader.unpack(header_for(3, t).pack()).checksum is None
