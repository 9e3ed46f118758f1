"""torch.distributed block transport: point-to-point send/recv between ranks.

The backend is a parameter: ``nccl`` between GPUs (payloads travel as CUDA tensors), ``gloo`` on
CPUs (and in tests).  Messages between a pair of ranks, in order:

* control: int64 tensor ``[op, count, flags, body_len]`` (ops and the ``Frame`` it decodes to from
  ``framing``; ``body_len`` is the size of the versions body, 0 when none)
* FETCH: int64 tensor of ``count`` keys (uint64 bit patterns)
* PUSH / BLOCKS: one uint8 tensor of ``count`` x 80-byte ``blockfmt`` headers (no checksum in
  them) followed by the ``body_len`` bytes of ``framing.pack_versions`` (each block's
  ``Block.version``, as TCP frames carry them), then each payload as a flat uint8 tensor (posted
  together with isend/irecv so the backend pipelines them), then, for host payloads (control flag
  ``FLAG_TRAILER``), an int64 tensor of the ``count`` xxh3_64 payload checksums.  Sending the
  checksums last lets the sender hash while the backend transmits, and the receiver hashes block i
  while blocks i+1.. are still arriving.
* ACK: the control tensor alone, ``count`` = blocks stored (PUSH) or sent (FETCH)
* ERROR: the control tensor with ``body_len`` bytes of UTF-8 text following (a PUSH whose
  checksums did not match: the server has read every message of it, so the pair stays in step)

Versions ride with the headers, so NCCL and gloo move them the same way (one metadata tensor on
the backend's device).  Received blocks carry their version; ``serve_one`` exports and stores
through the same ``export`` / ``accept`` hooks as ``TcpBlockServer`` (``base``): with a
``VersionedBlocks`` the highest version wins and a stale copy is refused and counted, as over TCP.

CUDA payloads (NCCL) carry no checksum (computing one would need a device-to-host copy).
Collective calls block, so the async ``fetch`` / ``push`` of ``BlockTransport`` run them in a
worker thread; the peer rank must be in ``serve_one`` (or the matching ``recv_blocks`` /
``send_blocks``) at the same time.
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
from ..errors import ChecksumMismatch, ProtocolError, RemoteError
from .base import Accept, Export, plain_accept, plain_export
from .framing import (
    FLAG_PREFIX,
    MAX_BODY,
    MAX_COUNT,
    Frame,
    Op,
    pack_versions,
    unpack_versions,
)

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
    def _send_ctrl(self, dst: int, op: Op, count: int = 0, flags: int = 0, body: int = 0) -> None:
        ctrl = torch.tensor([int(op), count, flags, body], dtype=torch.int64, device=self.device)
        dist.send(ctrl, dst, group=self.group)

    def _recv_ctrl(self, src: int) -> Frame:
        ctrl = torch.empty(4, dtype=torch.int64, device=self.device)
        dist.recv(ctrl, src, group=self.group)
        op, count, flags, body = ctrl.tolist()
        try:
            kind = Op(op)
        except ValueError:
            raise ProtocolError(f"unknown op {op} from rank {src}") from None
        if not (0 <= count <= MAX_COUNT and 0 <= body <= MAX_BODY):
            raise ProtocolError(f"bad control from rank {src}: count={count}, body={body}")
        return Frame(kind, count, body, flags)

    def _send_error(self, dst: int, message: str) -> None:
        data = message.encode()[:MAX_BODY]
        self._send_ctrl(dst, Op.ERROR, 0, 0, len(data))
        if data:
            text = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            dist.send(text, dst, group=self.group)

    def _raise_error(self, src: int, frame: Frame) -> None:
        text = torch.empty(frame.body_len, dtype=torch.uint8, device=self.device)
        if frame.body_len:
            dist.recv(text, src, group=self.group)
        raise RemoteError(bytes(text.cpu().numpy()).decode(errors="replace"))

    def _payload(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return byte_view(tensor.detach().to("cpu").contiguous())
        return byte_view(tensor.detach().to(self.device).contiguous())

    def send_blocks(self, dst: int, blocks: Sequence[Block], op: Op = Op.PUSH) -> None:
        payloads = [self._payload(b.tensor) for b in blocks]
        trailer = self.device.type == "cpu"
        meta = bytearray()
        for block in blocks:
            meta += header_for(block.key, block.tensor, parent=block.parent).pack()
        versions = pack_versions([b.version for b in blocks])
        meta += versions
        self._send_ctrl(dst, op, len(blocks), FLAG_TRAILER if trailer else 0, len(versions))
        if not blocks:
            return
        head = torch.frombuffer(meta, dtype=torch.uint8).to(self.device)
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

    def _recv_payloads(self, src: int, frame: Frame) -> list[Block]:
        count, flags = frame.count, frame.flags
        if count == 0:
            return []
        size = count * HEADER_SIZE
        head = torch.empty(size + frame.body_len, dtype=torch.uint8, device=self.device)
        dist.recv(head, src, group=self.group)
        raw = memoryview(head.cpu().numpy())
        headers = [BlockHeader.unpack(raw[i * HEADER_SIZE :]) for i in range(count)]
        versions = unpack_versions(raw[size:], count)
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
            Block(h.key, tensor_from_payload(h, b), h.parent, c, v)
            for h, b, c, v in zip(headers, bufs, sums, versions, strict=True)
        ]

    def recv_blocks(self, src: int) -> list[Block]:
        frame = self._recv_ctrl(src)
        if frame.op is Op.ERROR:
            self._raise_error(src, frame)
        if frame.op not in (Op.PUSH, Op.BLOCKS):
            raise ProtocolError(f"expected blocks from rank {src}, got {frame.op.name}")
        return self._recv_payloads(src, frame)

    # -- request / response ----------------------------------------------------------------------
    def fetch_sync(self, peer: int, keys: Sequence[int], *, prefix: bool = False) -> list[Block]:
        self._send_ctrl(peer, Op.FETCH, len(keys), FLAG_PREFIX if prefix else 0)
        if keys:
            as_i64 = np.array(keys, dtype=np.uint64).view(np.int64)
            dist.send(torch.from_numpy(as_i64).to(self.device), peer, group=self.group)
        return self.recv_blocks(peer)

    def push_sync(self, peer: int, blocks: Sequence[Block]) -> int:
        self.send_blocks(peer, blocks, Op.PUSH)
        frame = self._recv_ctrl(peer)
        if frame.op is Op.ERROR:  # e.g. a checksum the server did not match: RemoteError
            self._raise_error(peer, frame)
        if frame.op is not Op.ACK:
            raise ProtocolError(f"expected ACK from rank {peer}, got {frame.op.name}")
        return frame.count

    def serve_one(
        self, peer: int, store, *, export: Export | None = None, accept: Accept | None = None
    ) -> Op:
        """Handle one request from ``peer`` against ``store``; returns the request's op.

        ``export`` / ``accept``: the store hooks of ``base`` (as ``TcpBlockServer`` takes them;
        a ``VersionedBlocks``' for replication), by default ``plain_export`` / ``plain_accept``.
        A PUSH whose checksums do not match stores nothing: the pusher gets an ERROR (its
        ``push`` raises ``RemoteError``) and this raises ``ChecksumMismatch``, after which the
        pair is still in step and ``serve_one`` can be called again."""
        export = export or plain_export(store)
        accept = accept or plain_accept(store)
        frame = self._recv_ctrl(peer)
        if frame.op is Op.FETCH:
            keys_t = torch.empty(frame.count, dtype=torch.int64, device=self.device)
            if frame.count:
                dist.recv(keys_t, peer, group=self.group)
            keys = keys_t.cpu().numpy().view(np.uint64).tolist()
            blocks = []
            for key in keys:
                item = export(key)
                if item is None:
                    if frame.flags & FLAG_PREFIX:
                        break
                    continue
                header, host, version = item
                blocks.append(Block(key, host, header.parent, header.checksum, version))
            self.send_blocks(peer, blocks, Op.BLOCKS)
        elif frame.op is Op.PUSH:
            try:
                blocks = self._recv_payloads(peer, frame)
            except ChecksumMismatch as exc:
                self._send_error(peer, f"push refused: {exc}")
                raise
            self._send_ctrl(peer, Op.ACK, accept(blocks))
        else:
            raise ProtocolError(f"unexpected {frame.op.name} request from rank {peer}")
        return frame.op

    # -- BlockTransport ----------------------------------------------------------------------------
    async def fetch(self, peer: int, keys: Sequence[int], *, prefix: bool = False) -> list[Block]:
        return await asyncio.to_thread(self.fetch_sync, peer, keys, prefix=prefix)

    async def push(self, peer: int, blocks: Sequence[Block]) -> int:
        return await asyncio.to_thread(self.push_sync, peer, blocks)

    async def close(self) -> None:
        return None
