"""Physical storage for the tiered KV block store: device/host memory tiers (``disktier``: disk).

A tier holds whole blocks keyed by their chained hash and knows nothing about LRU or capacity
policy (that is ``placement.Placement``); it only stores, loads and deletes.  Every tier has:
``medium`` (the vLLM event medium: "GPU", "CPU" or "DISK"), ``capacity`` in bytes, ``overhead``
(bytes charged per block beyond its payload), ``store/load/delete``, ``scan`` (blocks it already
holds when opened) and ``held()`` (physically recounted blocks and bytes, for invariant checks).

Copies.  ``Copier`` performs every copy between tiers.  With CUDA on either side it copies on one
side stream with ``non_blocking=True`` (asynchronous for pinned host memory) and returns an event;
the tier keeps that fence and a later ``load`` waits for it (on the device for device consumers, on
the host for host consumers).  Without CUDA the same code path runs a synchronous ``copy_``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class BlockMeta:
    """What the store knows about a block besides its bytes."""

    parent: int | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    checksum: int | None = None


def cuda_available() -> bool:
    return torch.cuda.is_available()


def tune_host_allocator(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Let glibc keep freed multi-MiB host blocks for reuse (process-wide; call it from main).

    By default glibc hands freed blocks above its mmap/trim thresholds back to the kernel, so every
    newly received or copied block pays first-touch page faults (measured here: about 2.5 GB/s
    instead of 6 for allocate-and-copy).  Returns False where this is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = libc.mallopt(m_mmap_threshold, mmap_threshold)
    return bool(ok and libc.mallopt(m_trim_threshold, trim_threshold))


def _norm_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class Copier:
    """Copies tensors between tiers; asynchronous on a side CUDA stream where CUDA is involved."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def copy(self, src: torch.Tensor, device: torch.device, pin: bool):
        """Return ``(copy, fence)``; ``fence`` is None when the copy has already completed."""
        dst = torch.empty(src.shape, dtype=src.dtype, device=device, pin_memory=pin)
        if not (src.is_cuda or dst.is_cuda):
            dst.copy_(src)
            return dst, None
        return dst, self._cuda_copy(src, dst)  # pragma: no cover - needs CUDA

    def _cuda_copy(self, src: torch.Tensor, dst: torch.Tensor):  # pragma: no cover - needs CUDA
        dev = src.device if src.is_cuda else dst.device
        stream = self._streams.get(dev)
        if stream is None:
            stream = self._streams[dev] = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))  # src may still be being written
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            fence = torch.cuda.Event()
            fence.record(stream)
        for t in (src, dst):
            if t.is_cuda:
                t.record_stream(stream)  # keep the caching allocator from reusing it too early
        return fence

    @staticmethod
    def protect_source(src: torch.Tensor, fence) -> None:  # pragma: no cover - needs CUDA
        """Keep the caller from overwriting ``src`` while the copy may still read it: later work
        on the current stream waits for the copy (device source) or the host waits (host source)."""
        if src.is_cuda:
            torch.cuda.current_stream(src.device).wait_event(fence)
        else:
            fence.synchronize()


class MemoryTier:
    """Blocks as tensors on one device (``cuda`` / ``cpu``), pinned host memory when asked."""

    overhead = 0

    def __init__(
        self,
        medium: str,
        device: str | torch.device,
        capacity: int,
        *,
        pin: bool | None = None,
        copier: Copier | None = None,
    ) -> None:
        self.medium = medium
        self.device = _norm_device(device)
        self.capacity = int(capacity)
        on_host = self.device.type == "cpu"
        self.pinned = bool(on_host and cuda_available() and (pin is None or pin))
        self.copier = copier or Copier()
        self._blocks: dict[int, torch.Tensor] = {}
        self._fences: dict[int, object] = {}

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def scan(self) -> list[tuple[int, int, int | None]]:
        return []  # memory starts empty

    def held(self) -> tuple[int, int]:
        return len(self._blocks), sum(t.nbytes for t in self._blocks.values())

    def accepts(self, tensor: torch.Tensor) -> bool:
        """Can ``tensor`` be kept as is (right device, pinned if this tier pins, contiguous)?"""
        if tensor.device != self.device or not tensor.is_contiguous():
            return False
        return not self.pinned or tensor.is_pinned()

    def store(self, key: int, tensor: torch.Tensor, meta: BlockMeta, *, owned: bool) -> None:
        """Keep ``tensor`` (``owned``: the caller hands it over and will not modify it) or a copy."""
        if owned and self.accepts(tensor):
            self._blocks[key] = tensor
            return
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        dst, fence = self.copier.copy(tensor, self.device, self.pinned)
        self._blocks[key] = dst
        if fence is not None:  # pragma: no cover - needs CUDA
            if not owned:  # the caller keeps (and may soon overwrite) the source
                self.copier.protect_source(tensor, fence)
            self._fences[key] = fence

    def load(self, key: int, *, host: bool = False) -> torch.Tensor:
        """The block, safe to use on the current CUDA stream (``host``: safe for CPU code too)."""
        tensor = self._blocks[key]
        fence = self._fences.get(key)
        if fence is not None:  # pragma: no cover - needs CUDA
            if host or not tensor.is_cuda:
                fence.synchronize()
                del self._fences[key]
            else:
                torch.cuda.current_stream(tensor.device).wait_event(fence)
        return tensor

    def delete(self, key: int) -> None:
        self._blocks.pop(key, None)
        self._fences.pop(key, None)

    def close(self) -> None:
        self._blocks.clear()
        self._fences.clear()
