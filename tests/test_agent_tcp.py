"""TCP block transport: real sockets on loopback between two stores, and every failure mode."""

from __future__ import annotations

import asyncio
import random

import pytest

torch = pytest.importorskip("torch")

from tests.kvblocks import random_block, same_bytes  # noqa: E402
from worker_agent.blockfmt import HEADER_SIZE, Block, encode_block  # noqa: E402
from worker_agent.errors import (  # noqa: E402
    ChecksumMismatch,
    PeerGone,
    RemoteError,
    TransferTimeout,
    TruncatedFrame,
)
from worker_agent.store import KVBlockStore  # noqa: E402
from worker_agent.transport import tcp  # noqa: E402
from worker_agent.transport.framing import Op, pack_frame  # noqa: E402
from worker_agent.transport.tcp import TcpBlockServer, TcpTransport  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def store(nbytes: int = 256 << 20) -> KVBlockStore:
    return KVBlockStore.create(gpu_bytes=nbytes, cpu_bytes=nbytes, gpu_device="cpu")


def make_blocks(seed: int, n: int) -> dict[int, torch.Tensor]:
    rng = random.Random(seed)
    out = {}
    for _ in range(n):
        shape = (rng.randint(1, 3), 2, rng.choice([4, 16]), rng.randint(1, 2), rng.choice([8, 64]))
        out[rng.getrandbits(64)] = random_block(rng, rng.choice(DTYPES), shape)
    return out


async def test_fetch_and_push_many_blocks_between_stores(tmp_path):
    # the source spreads its blocks over all three tiers, so serving reads memory and disk
    src = KVBlockStore.create(
        gpu_bytes=256 << 10,
        cpu_bytes=256 << 10,
        disk_bytes=1 << 28,
        disk_dir=str(tmp_path),
        gpu_device="cpu",
    )
    dst = store()
    blocks = make_blocks(1, 300)
    for k, t in blocks.items():
        src.put(k, t)
    assert {t for t in src.locate(blocks)} == {0, 1, 2}
    client = TcpTransport(timeout=20)
    async with TcpBlockServer(src, chunk_bytes=1 << 20) as a, TcpBlockServer(dst) as b:
        keys = list(blocks)
        got = await client.fetch(a.address, keys)
        assert [blk.key for blk in got] == keys
        assert all(same_bytes(blk.tensor, blocks[blk.key]) for blk in got)
        assert await client.push(b.address, got) == len(keys)
        assert await client.push(b.address, got[:10]) == 0  # already held
        for k, t in blocks.items():
            assert same_bytes(dst.get(k), t)
        # missing keys are skipped; prefix mode stops at the first one
        probe = keys[:3] + [12345] + keys[3:5]
        assert [blk.key for blk in await client.fetch(a.address, probe)] == keys[:5]
        assert [blk.key for blk in await client.fetch(a.address, probe, prefix=True)] == keys[:3]
        assert await client.fetch(a.address, []) == []
        assert len(client._idle[tcp.parse_peer(a.address)]) == 1  # one connection, reused
    await client.close()


async def test_large_blocks_with_small_socket_buffers_apply_backpressure():
    rng = random.Random(2)
    src = store()
    blocks = {k: random_block(rng, torch.bfloat16, (4, 2, 16, 8, 128)) for k in range(8)}  # 2 MiB
    for k, t in blocks.items():
        src.put(k, t)
    client = TcpTransport(sock_buf=64 << 10)
    async with TcpBlockServer(src, sock_buf=64 << 10) as server:
        got = await client.fetch(("127.0.0.1", server.port), list(blocks))
    assert [b.key for b in got] == list(blocks)
    assert all(same_bytes(b.tensor, blocks[b.key]) for b in got)
    await client.close()


async def test_push_with_a_corrupt_block_is_refused_per_block():
    dst = store()
    good = Block(1, torch.ones(2, 2, 4, 1, 8))
    bad = Block(2, torch.zeros(2, 2, 4, 1, 8), checksum=12345)  # a wrong "known" checksum
    client = TcpTransport()
    async with TcpBlockServer(dst) as server:
        with pytest.raises(RemoteError, match="checksum"):
            await client.push(server.address, [bad, good])
        assert 1 in dst and 2 not in dst  # the stream stayed in sync: the good block landed
        assert await client.push(server.address, [bad._replace(checksum=None)]) == 1
        assert torch.equal(dst.get(2), bad.tensor)
    await client.close()


async def fake_server(reply: bytes, *, close: bool = True):
    """A server that reads a one-key FETCH, sends ``reply`` and closes (or hangs until ``done``).

    Returns (server, done, finished): ``finished`` is set once the handler closed its socket.
    """
    done, finished = asyncio.Event(), asyncio.Event()

    async def handle(reader, writer):
        try:
            await reader.readexactly(16 + 8)  # the FETCH frame and its one key
            writer.write(reply)
            await writer.drain()
            if not close:
                await done.wait()
        finally:
            writer.close()
            finished.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, done, finished


@pytest.mark.parametrize(
    "case", ["bad_checksum", "truncated_payload", "truncated_header", "closed", "error"]
)
async def test_fetch_detects_broken_replies(case):
    t = torch.arange(128, dtype=torch.float32).view(2, 2, 4, 2, 4)
    block = bytearray(encode_block(7, t))
    if case == "bad_checksum":
        block[HEADER_SIZE + 5] ^= 1
        reply = pack_frame(Op.BLOCKS, 1) + bytes(block) + pack_frame(Op.ACK, 1)
    elif case == "truncated_payload":
        reply = pack_frame(Op.BLOCKS, 1) + bytes(block[:-9])
    elif case == "truncated_header":
        reply = pack_frame(Op.BLOCKS, 1) + bytes(block[:40])
    elif case == "error":
        reply = pack_frame(Op.ERROR, 0, 4) + b"nope"
    else:
        reply = b""
    expected = {
        "bad_checksum": ChecksumMismatch,
        "truncated_payload": TruncatedFrame,
        "truncated_header": TruncatedFrame,
        "closed": PeerGone,
        "error": RemoteError,
    }[case]
    server, _, finished = await fake_server(reply)
    client = TcpTransport(timeout=5)
    port = server.sockets[0].getsockname()[1]
    with pytest.raises(expected):
        await client.fetch(("127.0.0.1", port), [7])
    assert not client._idle.get(("127.0.0.1", port))  # a failed connection is not reused
    await finished.wait()
    server.close()
    await client.close()


async def test_silent_peer_times_out():
    server, done, finished = await fake_server(b"", close=False)
    port = server.sockets[0].getsockname()[1]
    client = TcpTransport(timeout=0.3)
    with pytest.raises(TransferTimeout):
        await client.fetch(("127.0.0.1", port), [1])
    done.set()
    await finished.wait()
    server.close()
    await client.close()


async def test_peer_gone():
    src = store()
    src.put(1, torch.ones(2, 2, 4, 1, 8))
    client = TcpTransport(timeout=5)
    server = await TcpBlockServer(src).start()
    addr = server.address
    assert len(await client.fetch(addr, [1])) == 1
    await server.close()  # the pooled connection is now dead, and nothing listens
    with pytest.raises(PeerGone):
        await client.fetch(addr, [1])
    assert not client._idle[tcp.parse_peer(addr)]
    await client.close()


async def test_stale_pooled_connection_is_replaced():
    src = store()
    src.put(1, torch.ones(2, 2, 4, 1, 8))
    client = TcpTransport(timeout=5)
    async with TcpBlockServer(src) as server:
        assert len(await client.fetch(server.address, [1])) == 1
        (stale,) = client._idle[tcp.parse_peer(server.address)]
        serving = [t for t in server._tasks if t.get_coro().__name__ == "_serve"]
        assert len(serving) == 1
        serving[0].cancel()  # drop the server side of the pooled connection only
        got = await client.fetch(server.address, [1])
        assert len(got) == 1 and torch.equal(got[0].tensor, torch.ones(2, 2, 4, 1, 8))
        (fresh,) = client._idle[tcp.parse_peer(server.address)]
        assert fresh is not stale and stale.sock.fileno() == -1
    await client.close()


@pytest.mark.parametrize("seed", range(4))
async def test_random_blocks_round_trip_byte_identical(seed):
    """Any mix of block sizes (tiny to beyond the 1 MiB receive watermark), socket buffers and
    hashing chunk sizes: fetched and pushed blocks are byte-identical to the source's."""
    rng = random.Random(seed)
    blocks = make_blocks(seed, 12)
    for _ in range(3):  # and a few large ones, received in several watermark-sized waits
        shape = (rng.randint(1, 4), 2, 16, rng.choice([4, 8]), 128)
        blocks[rng.getrandbits(64)] = random_block(rng, rng.choice(DTYPES), shape)
    src, dst = store(), store()
    for k, t in blocks.items():
        src.put(k, t)
    buf = rng.choice([None, 64 << 10, 1 << 20])
    client = TcpTransport(sock_buf=buf, recv_chunk=rng.choice([4 << 10, 64 << 10, 256 << 10]))
    async with TcpBlockServer(src, sock_buf=buf) as a, TcpBlockServer(dst, sock_buf=buf) as b:
        keys = rng.sample(list(blocks), len(blocks))
        got = await client.fetch(a.address, keys)
        assert [blk.key for blk in got] == keys
        assert all(same_bytes(blk.tensor, blocks[blk.key]) for blk in got)
        assert await client.push(b.address, got) == len(keys)
    assert all(same_bytes(dst.get(k), t) for k, t in blocks.items())
    await client.close()


@pytest.mark.parametrize("seed", range(4))
async def test_a_flipped_bit_anywhere_in_a_payload_is_detected(seed):
    rng = random.Random(seed)
    t = random_block(rng, torch.float16, (rng.randint(1, 6), 2, 16, 2, 128))  # up to 1.5 MiB
    block = bytearray(encode_block(7, t))
    block[HEADER_SIZE + rng.randrange(t.nbytes)] ^= 1 << rng.randrange(8)
    server, _, finished = await fake_server(
        pack_frame(Op.BLOCKS, 1) + bytes(block) + pack_frame(Op.ACK, 1)
    )
    client = TcpTransport(timeout=5, recv_chunk=rng.choice([4 << 10, 256 << 10]))
    with pytest.raises(ChecksumMismatch):
        await client.fetch(("127.0.0.1", server.sockets[0].getsockname()[1]), [7])
    await finished.wait()
    server.close()
    await client.close()


async def test_a_reply_trickling_in_small_pieces_is_assembled():
    """Pieces far below the receive watermark still complete the block (the reader's watermark
    never exceeds what the frame still owes)."""
    rng = random.Random(7)
    t = random_block(rng, torch.bfloat16, (3, 2, 16, 2, 128))
    reply = pack_frame(Op.BLOCKS, 1) + encode_block(9, t) + pack_frame(Op.ACK, 1)

    async def handle(reader, writer):
        await reader.readexactly(16 + 8)
        pos = 0
        while pos < len(reply):
            step = rng.choice([1, 17, 4096, 70_000])
            writer.write(reply[pos : pos + step])
            await writer.drain()
            pos += step
        await reader.read()  # until the client closes
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    client = TcpTransport(timeout=10)
    (got,) = await client.fetch(("127.0.0.1", server.sockets[0].getsockname()[1]), [9])
    assert got.key == 9 and same_bytes(got.tensor, t)
    await client.close()
    server.close()


async def test_blocks_move_over_the_local_unix_socket(tmp_path):
    """The engine-local path (``unix:PATH``): the same protocol on an AF_UNIX listener beside the
    TCP port, byte-identical both ways, and the socket file is removed on close."""
    src, dst = store(), store()
    blocks = make_blocks(7, 40)
    for k, t in blocks.items():
        src.put(k, t)
    path = str(tmp_path / "agent.sock")
    client = TcpTransport(timeout=20)
    async with TcpBlockServer(src, unix_path=path) as a, TcpBlockServer(dst, unix_path=path + "2"):
        local = f"unix:{path}"
        got = await client.fetch(local, list(blocks))
        assert [b.key for b in got] == list(blocks)
        assert all(same_bytes(b.tensor, blocks[b.key]) for b in got)
        assert await client.push(f"unix:{path}2", got) == len(blocks)
        assert all(same_bytes(dst.get(k), t) for k, t in blocks.items())
        assert len(client._idle[tcp.parse_peer(local)]) == 1  # pooled like a TCP peer
        assert [b.key for b in await client.fetch(a.address, list(blocks)[:2])] == list(blocks)[:2]
    await client.close()
    assert not (tmp_path / "agent.sock").exists()
