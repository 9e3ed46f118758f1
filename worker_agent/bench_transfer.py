"""Transfer benchmark: tier moves and transports against the machine's own limits, same run.

    python -m worker_agent.bench_transfer [--block-mib 2] [--total-mib 256] [--rounds 3]

Rows (``--rounds`` timed rounds after one warm-up round, interleaved; ``bench_report`` turns them
into GB/s and ratios against the baselines timed in the same rounds):

* memcpy            ``dst.copy_(src)`` into preallocated tensors: the baseline of the tier rows
* tier host copy    ``MemoryTier.store`` of a block it must copy (what a GPU->CPU demotion does
                    on the host side; pinned memory when CUDA is present)
* tier CPU->disk    ``KVBlockStore.move`` to the disk tier (atomic file write; the checksum is
                    computed once per block and cached, so timed rounds reuse it)
* tier disk->CPU    ``KVBlockStore.move_many`` back (file reads + checksum verify on the caller and
                    one helper thread, as the agent's ``get_prefix`` reads; then the moves, each
                    file recycled); "verify off": the same without the checksum pass (to show
                    what it costs); "per block": ``KVBlockStore.move`` of one key at a time (all
                    on the calling thread)
* raw file write/read  the same bytes with bare os.write / os.readv, one file per block
* raw loopback      two processes, the transport's own socket I/O (``SocketStream``: vectored
                    sends, recv_into with SO_RCVLOWAT wake-ups) of the same bytes into a
                    reused buffer, no framing: the baseline of the TCP rows ("distinct memory":
                    received into one buffer per byte, as blocks are; a second reference)
* tcp fetch / push  ``TcpTransport`` against a ``TcpBlockServer`` in another process; push sends
                    blocks with known checksums (as ``KVBlockStore.export`` gives them), "hash on
                    send" hashes them first; the warm-up fetch is checked byte for byte
* gloo raw / blocks one ``dist.send`` of all the bytes vs ``DistTransport.send_blocks``
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import tempfile
import time
from collections.abc import Callable

import torch

from gateway.bench.tables import replace_block

from .bench_report import Times, markdown, report
from .blockfmt import Block, byte_view, checksum, payload_view
from .disktier import DiskTier
from .store import KVBlockStore
from .tiers import BlockMeta, MemoryTier, cuda_available, tune_host_allocator


def make_blocks(n: int, block_bytes: int, seed: int = 0) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    numel = block_bytes // 2
    heads, dim = 8, 128
    layers = max(1, numel // (2 * 16 * heads * dim))
    shape = (layers, 2, 16, heads, dim)
    return {
        (seed << 32) + i + 1: torch.randn(shape, generator=g).to(torch.float16) for i in range(n)
    }


# -- tiers -------------------------------------------------------------------------------------
class Rounds:
    """Interleaves several measurements round by round (machine noise hits them alike)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    def time(self, name: str, fn: Callable[[], object], record: bool) -> None:
        t0 = time.perf_counter()
        fn()
        if record:
            self.times.setdefault(name, []).append(time.perf_counter() - t0)



def _raw_write(directory: str, views: list[memoryview]) -> None:
    for i, view in enumerate(views):
        tmp, final = f"{directory}/{i}.tmp", f"{directory}/{i}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, view)
        os.close(fd)
        os.replace(tmp, final)


def _raw_read(directory: str, n: int, nbytes: int) -> list[torch.Tensor]:
    out = []
    for i in range(n):
        fd = os.open(f"{directory}/{i}", os.O_RDONLY)
        t = torch.empty(nbytes, dtype=torch.uint8)
        os.readv(fd, [memoryview(t.numpy())])
        os.close(fd)
        out.append(t)
    return out


def bench_tiers(blocks: dict[int, torch.Tensor], rounds: int, disk_dir: str) -> Times:
    srcs = list(blocks.values())
    dsts = [torch.empty_like(t) for t in srcs]
    views = [payload_view(t) for t in srcs]
    raw_dir = os.path.join(disk_dir, "raw")
    os.mkdir(raw_dir)
    tier = MemoryTier("CPU", "cpu", 1 << 62)
    meta = BlockMeta()
    disk = DiskTier(disk_dir, 1 << 62)
    store = KVBlockStore([MemoryTier("CPU", "cpu", 1 << 62), disk])
    for k, t in blocks.items():
        store.put(k, t)
    keys = list(blocks)
    r = Rounds()
    for i in range(rounds + 1):
        rec = i > 0
        r.time("memcpy", lambda: [d.copy_(s) for d, s in zip(dsts, srcs, strict=True)], rec)
        r.time(
            "tier host copy",
            lambda: [tier.store(k, t, meta, owned=False) for k, t in blocks.items()],
            rec,
        )
        for k in blocks:
            tier.delete(k)
        r.time("raw file write", lambda: _raw_write(raw_dir, views), rec)
        r.time("tier CPU->disk", lambda: [store.move(k, 1) for k in blocks], rec)
        r.time("raw file read", lambda: _raw_read(raw_dir, len(views), len(views[0])), rec)
        r.time("tier disk->CPU", lambda: store.move_many(keys, 0), rec)
        if not rec and not all(
            torch.equal(byte_view(store.tiers[0].load(k)), byte_view(t)) for k, t in blocks.items()
        ):
            raise RuntimeError("blocks moved back from disk differ from the originals")
        store.move_many(keys, 1)
        disk.verify = False
        r.time("disk->CPU, verify off", lambda: store.move_many(keys, 0), rec)
        disk.verify = True
        store.move_many(keys, 1)
        r.time("disk->CPU, per block", lambda: [store.move(k, 0) for k in keys], rec)
        for j in range(len(views)):
            os.unlink(f"{raw_dir}/{j}")
    store.clear()
    store.close()
    return r.times


# -- TCP ---------------------------------------------------------------------------------------
def _raw_peer(port_q, total: int, chunk: int, tune: bool) -> None:
    """Per request byte: b"g" -> send ``total`` bytes; b"p" -> receive ``total`` bytes, ack."""
    from .transport.sockio import SocketStream

    if tune:
        tune_host_allocator()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ls = socket.create_server(("127.0.0.1", 0))
        ls.setblocking(False)
        port_q.put(ls.getsockname()[1])
        conn, _ = await loop.sock_accept(ls)
        conn.setblocking(False)
        stream = SocketStream(conn)
        buf = memoryview(bytearray(chunk))
        while await stream.recv_into(buf[:1], boundary=True):
            if buf[0] == ord("g"):
                await stream.sendv([buf] * (total // chunk))
            else:
                await _recv_total(stream, buf, total)
                await stream.sendv([b"k"])

    asyncio.run(main())


def _block_peer(port_q, n: int, block_bytes: int, tune: bool) -> None:
    from .transport.tcp import TcpBlockServer

    if tune:
        tune_host_allocator()

    async def main() -> None:
        store = KVBlockStore.create(gpu_bytes=3 * n * block_bytes, cpu_bytes=0, gpu_device="cpu")
        for k, t in make_blocks(n, block_bytes).items():
            store.put(k, t)
        async with TcpBlockServer(store, chunk_bytes=32 << 20) as server:
            port_q.put(server.port)
            await asyncio.Event().wait()

    asyncio.run(main())


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(q, *args), daemon=True)
    proc.start()
    return proc, q.get(timeout=120)


async def _recv_total(stream, buf: memoryview, total: int) -> None:
    """``total`` bytes into ``buf`` (wrapping when it is smaller), read the way the transport
    reads a socket (``SocketStream``: recv_into, SO_RCVLOWAT wake-ups) but with no framing,
    checksum or allocation: the machine's limit that the TCP rows are measured against."""
    got = 0
    while got < total:
        n = min(len(buf), total - got)
        await stream.recv_into(buf[:n])
        got += n


async def _raw_round(stream, buf: memoryview, total: int, op: bytes) -> None:
    """b"g": receive ``total`` bytes into ``buf``; b"p": send them (vectored), wait for the ack."""
    await stream.sendv([op])
    if op == b"g":
        await _recv_total(stream, buf, total)
    else:
        await stream.sendv([buf] * (total // len(buf)))
        await stream.recv_into(buf[:1])


async def _tcp_rounds(raw_port: int, blk_port: int, blocks: dict, rounds: int) -> dict:
    from .transport.sockio import SocketStream
    from .transport.tcp import TcpTransport

    loop = asyncio.get_running_loop()
    sock = socket.create_connection(("127.0.0.1", raw_port))
    sock.setblocking(False)
    raw = SocketStream(sock)
    chunk = next(iter(blocks.values())).nbytes
    total = chunk * len(blocks)
    buf = memoryview(bytearray(chunk))
    region = torch.zeros(total, dtype=torch.uint8)  # distinct memory for every byte, like blocks
    region_view = memoryview(region.numpy())
    client = TcpTransport(timeout=120)
    trusting = TcpTransport(timeout=120, verify=False)
    peer = ("127.0.0.1", blk_port)
    keys = list(blocks)
    items = [Block(k, t) for k, t in blocks.items()]
    known = [Block(k, t, checksum=checksum(payload_view(t))) for k, t in blocks.items()]
    times: dict[str, list[float]] = {}

    async def timed_async(name: str, coro, rec: bool):
        t0 = loop.time()
        result = await coro
        if rec:
            times.setdefault(name, []).append(loop.time() - t0)
        return result

    for i in range(rounds + 1):
        rec = i > 0
        await timed_async("raw loopback peer->us", _raw_round(raw, buf, total, b"g"), rec)
        await timed_async(
            "raw ... distinct memory", _raw_round(raw, region_view, total, b"g"), rec
        )
        got = await timed_async("tcp fetch", client.fetch(peer, keys), rec)
        if not rec:  # the server made the same blocks from the same seed
            _check_identical(got, blocks)
        del got
        got = await timed_async("tcp fetch, verify off", trusting.fetch(peer, keys), rec)
        del got
        await timed_async("raw loopback us->peer", _raw_round(raw, buf, total, b"p"), rec)
        await timed_async("tcp push", client.push(peer, known), rec)
        await timed_async("tcp push, hash on send", client.push(peer, items), rec)
    sock.close()
    await client.close()
    await trusting.close()
    return times


def _check_identical(got: list[Block], blocks: dict[int, torch.Tensor]) -> None:
    if [b.key for b in got] != list(blocks) or not all(
        torch.equal(byte_view(b.tensor), byte_view(blocks[b.key])) for b in got
    ):
        raise RuntimeError("tcp fetch returned blocks that differ from the source's")


def bench_tcp(blocks: dict, block_bytes: int, rounds: int, tune: bool) -> Times:
    raw, raw_port = _spawn(_raw_peer, len(blocks) * block_bytes, block_bytes, tune)
    blk, blk_port = _spawn(_block_peer, len(blocks), block_bytes, tune)
    try:
        return asyncio.run(_tcp_rounds(raw_port, blk_port, blocks, rounds))
    finally:
        raw.kill()
        blk.kill()


# -- gloo --------------------------------------------------------------------------------------
def _gloo_worker(rank: int, port: int, n: int, block_bytes: int, rounds: int, tune: bool, q):
    import torch.distributed as dist

    from .transport.dist import DistTransport, init_process_group

    if tune:
        tune_host_allocator()
    init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, 2)
    transport = DistTransport()
    blocks = [Block(k, t) for k, t in make_blocks(n, block_bytes).items()]
    flat = torch.empty(n * block_bytes, dtype=torch.uint8)
    raw_t, blk_t = [], []
    for r in range(rounds + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(flat, 1)
        else:
            dist.recv(flat, 0)
        t1 = time.perf_counter()
        dist.barrier()
        t2 = time.perf_counter()
        if rank == 0:
            transport.send_blocks(1, blocks)
        else:
            assert len(transport.recv_blocks(0)) == n
        t3 = time.perf_counter()
        if r:
            raw_t.append(t1 - t0)
            blk_t.append(t3 - t2)
    if rank == 1:
        q.put((raw_t, blk_t))
    dist.destroy_process_group()


def bench_gloo(n: int, block_bytes: int, rounds: int, tune: bool) -> Times:
    import torch.multiprocessing as tmp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = mp.get_context("spawn").SimpleQueue()
    tmp.spawn(_gloo_worker, args=(port, n, block_bytes, rounds, tune, q), nprocs=2, join=True)
    raw, blk = q.get()
    return {"gloo raw send": raw, "gloo blocks": blk}


# -- run ---------------------------------------------------------------------------------------
def add_arguments(ap: argparse.ArgumentParser) -> None:
    """Options of ``kvgate bench transfer`` (and ``python -m worker_agent.bench_transfer``)."""
    ap.add_argument("--out", default="bench-results", help="folder for transfer.md")
    ap.add_argument("--block-mib", type=float, default=2.0)
    ap.add_argument("--total-mib", type=float, default=256.0)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--disk-dir", default=None, help="directory for the disk tier (default: tmp)")
    ap.add_argument("--skip", action="append", default=[], choices=["tier", "tcp", "gloo"])
    ap.add_argument(
        "--no-malloc-tune", action="store_true", help="leave glibc's trim/mmap thresholds alone"
    )
    ap.add_argument("--readme", default=None, help="README to update between bench:transfer markers")


def setup_line(n: int, block_bytes: int, rounds: int, tune: bool) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return (
        f"{n} blocks x {block_bytes / 2**20:g} MiB ({n * block_bytes / 2**20:g} MiB per round), "
        f"{rounds} interleaved rounds after a warm-up; {os.cpu_count()} CPUs shared by both ends "
        f"(and other work), nothing pinned; cuda={cuda_available()}, malloc tuned={tune}, "
        f"torch {torch.__version__}; {stamp}"
    )


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    tune = not args.no_malloc_tune and tune_host_allocator()
    block_bytes = int(args.block_mib * 2**20)
    blocks = make_blocks(max(1, int(args.total_mib * 2**20) // block_bytes), block_bytes)
    block_bytes = next(iter(blocks.values())).nbytes
    total = len(blocks) * block_bytes
    setup = setup_line(len(blocks), block_bytes, args.rounds, bool(tune))
    print(setup)
    times: Times = {}
    if "tier" not in args.skip:
        with tempfile.TemporaryDirectory(dir=args.disk_dir) as d:
            times.update(bench_tiers(blocks, args.rounds, d))
    if "tcp" not in args.skip:
        times.update(bench_tcp(blocks, block_bytes, args.rounds, tune))
    if "gloo" not in args.skip:
        times.update(bench_gloo(len(blocks), block_bytes, args.rounds, tune))
    print(report(times, total))
    text = markdown(times, total, setup)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "transfer.md"), "w") as fh:
        fh.write(text)
    if args.readme:
        replace_block(args.readme, "transfer", text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
