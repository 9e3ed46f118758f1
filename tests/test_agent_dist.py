"""torch.distributed transport over gloo: two real processes, byte-identical blocks both ways."""

from __future__ import annotations

import json
import random
import socket

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"
)

N_BLOCKS = 24


def reference_blocks() -> dict[int, torch.Tensor]:
    rng = random.Random(77)
    out = {}
    for i in range(N_BLOCKS):
        dtype = [torch.float16, torch.bfloat16, torch.float32][i % 3]
        shape = (rng.randint(1, 3), 2, 16, rng.randint(1, 2), 64)
        n = 1
        for d in shape:
            n *= d
        raw = torch.tensor(bytearray(rng.randbytes(n * dtype.itemsize)), dtype=torch.uint8)
        out[rng.getrandbits(64)] = raw.view(dtype).view(shape)
    return out


def digest(t: torch.Tensor) -> str:
    from worker_agent.blockfmt import checksum, payload_view

    return f"{t.dtype}:{tuple(t.shape)}:{checksum(payload_view(t)):016x}"


def _worker(rank: int, port: int, out_dir: str) -> None:
    from worker_agent.blockfmt import Block
    from worker_agent.errors import ChecksumMismatch
    from worker_agent.store import KVBlockStore
    from worker_agent.transport.dist import DistTransport, init_process_group

    init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, 2, timeout_s=30)
    try:
        ref = reference_blocks()
        keys = list(ref)
        store = KVBlockStore.create(gpu_bytes=1 << 24, cpu_bytes=1 << 24, gpu_device="cpu")
        t = DistTransport()
        result: dict = {"backend": t.backend}
        if rank == 0:
            half = keys[: N_BLOCKS // 2]
            result["pushed"] = t.push_sync(1, [Block(k, ref[k]) for k in half])
            for k in keys[N_BLOCKS // 2 :]:
                store.put(k, ref[k])
            assert t.serve_one(1, store).name == "FETCH"
            assert t.serve_one(1, store).name == "FETCH"
            t.send_blocks(1, [Block(1, ref[keys[0]], checksum=12345)])  # a wrong checksum
        else:
            assert t.serve_one(0, store).name == "PUSH"
            got = t.fetch_sync(0, keys[N_BLOCKS // 2 :] + [42])
            pre = t.fetch_sync(0, [keys[-1], 42, keys[-2]], prefix=True)
            result["fetched"] = {str(b.key): digest(b.tensor) for b in got}
            result["prefix"] = [str(b.key) for b in pre]
            result["versions"] = sorted({repr(b.version) for b in got + pre})  # a plain store's
            result["stored"] = {str(k): digest(store.get(k)) for k in keys[: N_BLOCKS // 2]}
            try:
                t.recv_blocks(0)
                result["corrupt"] = "accepted"
            except ChecksumMismatch as exc:
                result["corrupt"] = f"{exc.key}:{exc.expected}"
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gloo_push_and_fetch_between_two_processes(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    ref = {str(k): digest(t) for k, t in reference_blocks().items()}
    keys = list(ref)
    assert r0["backend"] == "gloo" and r0["pushed"] == N_BLOCKS // 2
    assert r1["stored"] == {k: ref[k] for k in keys[: N_BLOCKS // 2]}
    assert r1["fetched"] == {k: ref[k] for k in keys[N_BLOCKS // 2 :]}
    assert list(r1["fetched"]) == keys[N_BLOCKS // 2 :]
    assert r1["prefix"] == [keys[-1]]
    assert r1["versions"] == ["Version(counter=0, writer='')"]  # unversioned: the lowest
    assert r1["corrupt"] == "1:12345"


def _corrupt_push_worker(rank: int, port: int, out_dir: str) -> None:
    from worker_agent.blockfmt import Block
    from worker_agent.errors import ChecksumMismatch, RemoteError
    from worker_agent.store import KVBlockStore
    from worker_agent.transport.dist import DistTransport, init_process_group

    init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, 2, timeout_s=30)
    try:
        ref = reference_blocks()
        keys = list(ref)
        t = DistTransport()
        result: dict = {}
        if rank == 0:
            try:  # a wrong checksum: refused with an answer, not left waiting for a timeout
                t.push_sync(1, [Block(keys[0], ref[keys[0]], checksum=12345)])
                result["bad"] = "accepted"
            except RemoteError as exc:
                result["bad"] = str(exc)
            result["good"] = t.push_sync(1, [Block(k, ref[k]) for k in keys[1:4]])  # still in step
        else:
            store = KVBlockStore.create(gpu_bytes=1 << 24, cpu_bytes=1 << 24, gpu_device="cpu")
            try:
                t.serve_one(0, store)
                result["served"] = "no error"
            except ChecksumMismatch as exc:
                result["served"] = f"{exc.key}:{exc.expected}"
            result["after_bad"] = len(store)
            assert t.serve_one(0, store).name == "PUSH"
            result["stored"] = {str(k): digest(store.get(k)) for k in keys[1:4]}
            result["has_bad"] = store.get(keys[0]) is not None
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_gloo_push_with_a_bad_checksum_is_refused_with_an_answer(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_corrupt_push_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    ref = {str(k): digest(t) for k, t in reference_blocks().items()}
    keys = list(ref)
    assert "push refused" in r0["bad"] and "checksum" in r0["bad"].lower()
    assert r1["served"] == f"{keys[0]}:12345"
    assert r1["after_bad"] == 0 and r1["has_bad"] is False  # nothing of the bad push stored
    assert r0["good"] == 3 and r1["stored"] == {k: ref[k] for k in keys[1:4]}
