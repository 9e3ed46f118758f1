"""torch.distributed block transport: point-to-point send/recv between ranks.

The backend is a parameter: ``nccl`` between GPUs (payloads travel as CUDA tensors), ``gloo`` on
CPUs (and in tests).  Messages between a pair of ranks, in order:

* control: int64 tensor ``[op, count, flags, 0]`` (ops from ``framing.Op``)
* FETCH: int64 tensor of ``count`` keys (uint64 bit patterns)
* PUSH / BLOCKS: one uint8 tensor of ``count`` x 80-byte ``blockfmt`` headers (no checksum in
  them), then each payload as a flat uint8 tensor (posted together with isend/irecv so the backend
  pipelines them), then, for host payloads (control flag ``FLAG_TRAILER``), an int64 tensor of the
  ``count`` xxh3_64 payload checksums.  Sending the checksums last lets the sender hash while the
  backend transmits, and the receiver hashes block i while blocks i+1.. are still arriving.
* ACK: the control tensor alone, ``count`` = blocks stored (PUSH) or sent (FETCH)

CUDA payloads (NCCL) carry no checksum (computing one would need a device-to-host copy).  Collective calls block, so the async
``fetch`` / ``push`` of ``BlockTransport`` run them in a worker thread; the peer rank must be in
``serve_one`` (or the matching ``recv_blocks`` / ``send_blocks``) at the same time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ..blockfmt import (
    HEADER_SIZE,
    Block,
    BlockHeader,
    byte_view,
    checksum,
    header_for,
    tensor_from_payload,
)
from ..errors import ChecksumMismatch, ProtocolError
from .framing import FLAG_PREFIX, Op

FLAG_TRAILER = 2  # control flag: a uint64 checksum per block follows the payloads


def init_process_group(
    backend: str, init_method: str, rank: int, world_size: int, timeout_s: float = 60.0
) -> None:
    """Join a process group (``backend``: "nccl" or "gloo")."""
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


class DistTransport:
    def __init__(self, *, group=None, verify: bool = True, device: str | None = None) -> None:
        self.group = group
        self.backend = dist.get_backend(group)
        self.device = torch.device(device or ("cuda" if self.backend == "nccl" else "cpu"))
        self.verify = verify

    # -- messages ------------------------------------------------------------------------------
    def _send_ctrl(self, dst: int, op: Op, count: int = 0, flags: int = 0) -> None:
        ctrl = torch.tensor([int(op), count, flags, 0], dtype=torch.int64, device=self.device)
        dist.send(ctrl, dst, group=self.group)

    def _recv_ctrl(self, src: int) -> tuple[Op, int, int]:
        ctrl = torch.empty(4, dtype=torch.int64, device=self.device)
        dist.recv(ctrl, src, group=self.group)
        op, count, flags, _ = ctrl.tolist()
        try:
            return Op(op), count, flags
        except ValueError:
            raise ProtocolError(f"unknown op {op} from rank {src}") from None

    def _payload(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return byte_view(tensor.detach().to("cpu").contiguous())
        return byte_view(tensor.detach().to(self.device).contiguous())

    def send_blocks(self, dst: int, blocks: Sequence[Block], op: Op = Op.PUSH) -> None:
        payloads = [self._payload(b.tensor) for b in blocks]
        trailer = self.device.type == "cpu"
        headers = bytearray()
        for block in blocks:
            headers += header_for(block.key, block.tensor, parent=block.parent).pack()
        self._send_ctrl(dst, op, len(blocks), FLAG_TRAILER if trailer else 0)
        if not blocks:
            return
        head = torch.frombuffer(headers, dtype=torch.uint8).to(self.device)
        dist.send(head, dst, group=self.group)
        works = [dist.isend(p, dst, group=self.group) if p.numel() else None for p in payloads]
        if trailer:  # hash while the backend is sending; checksums follow the payloads
            sums = [
                b.checksum if b.checksum is not None else checksum(memoryview(p.numpy()))
                for b, p in zip(blocks, payloads, strict=True)
            ]
        for work in works:
            if work is not None:
                work.wait()
        if trailer:
            as_i64 = np.array(sums, dtype=np.uint64).view(np.int64)
            dist.send(torch.from_numpy(as_i64), dst, group=self.group)

    def _recv_payloads(self, src: int, count: int, flags: int) -> list[Block]:
        if count == 0:
            return []
        head = torch.empty(count * HEADER_SIZE, dtype=torch.uint8, device=self.device)
        dist.recv(head, src, group=self.group)
        raw = memoryview(head.cpu().numpy())
        headers = [BlockHeader.unpack(raw[i * HEADER_SIZE :]) for i in range(count)]
        bufs = [torch.empty(h.nbytes, dtype=torch.uint8, device=self.device) for h in headers]
        works = [dist.irecv(b, src, group=self.group) if b.numel() else None for b in bufs]
        check = bool(flags & FLAG_TRAILER) and self.verify
        actual = []
        for work, buf in zip(works, bufs, strict=True):  # hash block i while i+1.. arrive
            if work is not None:
                work.wait()
            if check:
                actual.append(checksum(memoryview(buf.numpy())))
        sums: list[int | None] = [None] * count
        if flags & FLAG_TRAILER:
            trailer = torch.empty(count, dtype=torch.int64)
            dist.recv(trailer, src, group=self.group)
            expected = trailer.numpy().view(np.uint64).tolist()
            for h, want, got in zip(headers, expected, actual, strict=False):
                if want != got:
                    raise ChecksumMismatch(h.key, want, got)
            if check:
                sums = expected
        return [
            Block(h.key, tensor_from_payload(h, b), h.parent, c)
            for h, b, c in zip(headers, bufs, sums, strict=True)
        ]

    def recv_blocks(self, src: int) -> list[Block]:
        op, count, flags = self._recv_ctrl(src)
        if op not in (Op.PUSH, Op.BLOCKS):
            raise ProtocolError(f"expected blocks from rank {src}, got {op.name}")
        return self._recv_payloads(src, count, flags)

    # -- request / response ----------------------------------------------------------------------
    def fetch_sync(self, peer: int, keys: Sequence[int], *, prefix: bool = False) -> list[Block]:
        self._send_ctrl(peer, Op.FETCH, len(keys), FLAG_PREFIX if prefix else 0)
        if keys:
            as_i64 = np.array(keys, dtype=np.uint64).view(np.int64)
            dist.send(torch.from_numpy(as_i64).to(self.device), peer, group=self.group)
        return self.recv_blocks(peer)

    def push_sync(self, peer: int, blocks: Sequence[Block]) -> int:
        self.send_blocks(peer, blocks, Op.PUSH)
        op, count, _ = self._recv_ctrl(peer)
        if op is not Op.ACK:
            raise ProtocolError(f"expected ACK from rank {peer}, got {op.name}")
        return count

    def serve_one(self, peer: int, store) -> Op:
        """Handle one request from ``peer`` against ``store``; returns the request's op."""
        op, count, flags = self._recv_ctrl(peer)
        if op is Op.FETCH:
            keys_t = torch.empty(count, dtype=torch.int64, device=self.device)
            if count:
                dist.recv(keys_t, peer, group=self.group)
            keys = keys_t.cpu().numpy().view(np.uint64).tolist()
            blocks = []
            for key in keys:
                item = store.export(key)
                if item is None:
                    if flags & FLAG_PREFIX:
                        break
                    continue
                header, host = item
                blocks.append(Block(key, host, header.parent, header.checksum))
            self.send_blocks(peer, blocks, Op.BLOCKS)
        elif op is Op.PUSH:
            blocks = self._recv_payloads(peer, count, flags)
            stored = sum(
                store.put(b.key, b.tensor, parent=b.parent, copy=False, checksum=b.checksum)
                for b in blocks
            )
            self._send_ctrl(peer, Op.ACK, stored)
        else:
            raise ProtocolError(f"unexpected {op.name} request from rank {peer}")
        return op

    # -- BlockTransport ----------------------------------------------------------------------------
    async def fetch(self, peer: int, keys: Sequence[int], *, prefix: bool = False) -> list[Block]:
        return await asyncio.to_thread(self.fetch_sync, peer, keys, prefix=prefix)

    async def push(self, peer: int, blocks: Sequence[Block]) -> int:
        return await asyncio.to_thread(self.push_sync, peer, blocks)

    async def close(self) -> None:
        return None
