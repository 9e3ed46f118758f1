"""The disk tier: one file per block, the ``blockfmt`` header then the raw payload.

Atomicity.  A block is written under a name that is not a block's name (a fresh ``.tmp`` file or a
recycled ``.spare`` one) and renamed into place, so a crash leaves either the old state or a
complete block; ``fsync=True`` also makes it durable.  Reopening a directory finds the blocks it
holds, oldest (by modification time) first, and removes the debris (``.tmp`` and ``.spare``).

Recycling.  Creating a file and unlinking it cost more than the bytes they move: the kernel
allocates page-cache pages for a new file and frees them again on unlink (measured here for 2 MiB
blocks: writing into new files 2.0 GB/s, overwriting existing ones 4.5 GB/s; unlink 13 GB/s of
blocks, rename 95 GB/s).  So a block leaving the tier is renamed to a spare file, kept up to
``spare_bytes`` (beyond ``capacity``), and the next block stored overwrites a spare of its size in
place (``pwritev`` of header and payload, one call) before the rename.  ``close`` unlinks spares.

Reads.  ``load`` reads header and payload with ``preadv`` straight into a tensor of the block's
dtype and shape, then hashes the payload while it is still in cache (one checksum pass, no copy);
payloads above ``READ_CHUNK`` are read and hashed in pieces of that size, so each piece is hashed
from cache rather than memory.  The tier keeps every held block's header (the 80 bytes it wrote,
or found when it scanned the directory): the file's header must equal them byte for byte, which
spares parsing it on every read and still catches a file that holds another block.  A single
``load`` runs on the calling thread (a helper thread woken per block lost on the 2-vCPU machine
of the README's numbers, where waking a sleeping thread takes about 70 us, a quarter of a 2 MiB
read).  Batches (``read_ahead``: the store's ``get_prefix`` and ``move_many``) are read on the
caller and one helper thread started once per batch (``diskio.read_all``), all before the
batch's blocks move.  O_DIRECT is not used: it bypasses the page cache these moves are measured
against, needs page-aligned buffers, and the header's 80 bytes would misalign every payload.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch

from .blockfmt import HEADER_SIZE, BlockHeader, byte_view, checksum, header_for
from .diskio import helper_threads, pwrite_all, read_all, read_block
from .errors import BlockFormatError, ChecksumMismatch
from .tiers import BlockMeta, cuda_available

DEFAULT_SPARE_BYTES = 4 << 30


class _Head(NamedTuple):
    """A held block's header: the bytes its file starts with, and what they say."""

    raw: bytes
    header: BlockHeader


class SparePool:
    """Files of departed blocks, by size, waiting to be overwritten (at most ``max_bytes``)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._by_size: dict[int, list[str]] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_size.values())

    def give(self, path: str, size: int, spare: str) -> bool:
        """Rename ``path`` to ``spare`` and keep it; False (nothing done) when the pool is full."""
        if self.bytes + size > self.max_bytes:
            return False
        os.replace(path, spare)
        self._by_size.setdefault(size, []).append(spare)
        self.bytes += size
        return True

    def take(self, size: int) -> tuple[str, int] | None:
        """A spare file of ``size`` bytes if there is one, else any (path, its size), else None."""
        if not self._by_size:
            return None
        have = size if size in self._by_size else next(iter(self._by_size))
        files = self._by_size[have]
        path = files.pop()
        if not files:
            del self._by_size[have]
        self.bytes -= have
        return path, have

    def clear(self) -> None:
        for files in self._by_size.values():
            for path in files:
                _unlink_quietly(path)
        self._by_size.clear()
        self.bytes = 0


class DiskTier:
    """Blocks as files in ``directory`` (see the module docstring); ``verify=False`` skips the
    payload checksum on reads, ``spare_bytes`` bounds the recycled files kept for reuse."""

    medium = "DISK"
    overhead = HEADER_SIZE
    SUFFIX = ".kvb"
    READ_CHUNK = 1 << 20

    def __init__(
        self,
        directory: str | os.PathLike,
        capacity: int,
        *,
        fsync: bool = False,
        verify: bool = True,
        pin: bool = False,
        spare_bytes: int | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity = int(capacity)
        self.fsync = fsync
        self.verify = verify
        self.pinned = bool(pin and cuda_available())
        if spare_bytes is None:
            spare_bytes = min(self.capacity // 4, DEFAULT_SPARE_BYTES)
        self.spares = SparePool(spare_bytes)
        self._dir = str(self.directory)
        self._heads: dict[int, _Head] = {}  # key -> the header its file starts with
        self._ids = itertools.count()
        self._ahead: dict[int, object] = {}  # key -> its block (or the read's error), read ahead
        self._reading_ahead = False

    def __contains__(self, key: int) -> bool:
        return key in self._heads

    def __len__(self) -> int:
        return len(self._heads)

    def path(self, key: int) -> Path:
        return Path(self._file(key))

    def _file(self, key: int) -> str:  # plain strings: pathlib costs more than the syscalls
        return f"{self._dir}/{key:016x}{self.SUFFIX}"

    def _scratch(self, suffix: str) -> str:
        return f"{self._dir}/.{os.getpid()}.{next(self._ids)}{suffix}"

    def scan(self) -> list[tuple[int, int, int | None]]:
        """(key, payload bytes, parent) of the valid blocks found, oldest first; drops debris."""
        found: list[tuple[float, int, _Head]] = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith((".tmp", ".spare")):
                _unlink_quietly(entry.path)  # an interrupted write or a previous run's spare
                continue
            if not entry.name.endswith(self.SUFFIX):
                continue
            try:
                with open(entry.path, "rb") as f:
                    raw = f.read(HEADER_SIZE)
                header = BlockHeader.unpack(raw)
                st = entry.stat()
                if (
                    st.st_size != HEADER_SIZE + header.nbytes
                    or entry.name != self.path(header.key).name
                ):
                    raise BlockFormatError("size or name does not match the header")
            except (OSError, BlockFormatError):
                _unlink_quietly(entry.path)
                continue
            found.append((st.st_mtime, header.key, _Head(raw, header)))
        found.sort(key=lambda f: f[:2])
        self._heads.update((k, head) for _, k, head in found)
        return [(k, h.header.nbytes, h.header.parent) for _, k, h in found]

    def held(self) -> tuple[int, int]:
        sizes = [os.stat(self.path(k)).st_size for k in self._heads]
        return len(sizes), sum(sizes)

    def store(self, key: int, tensor: torch.Tensor, meta: BlockMeta, *, owned: bool) -> None:
        if self._ahead:
            self._ahead.pop(key, None)
        host = tensor if tensor.device.type == "cpu" else tensor.to("cpu")
        if not host.is_contiguous():
            host = host.contiguous()
        view = _bytes_of(host)
        if meta.checksum is None:
            meta.checksum = checksum(view)
        header = header_for(key, host, parent=meta.parent, csum=meta.checksum)
        raw = header.pack()
        size = HEADER_SIZE + len(view)
        spare = self.spares.take(size)
        if spare is None:
            where, old = self._scratch(".tmp"), 0
            fd = os.open(where, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        else:
            (where, old), fd = spare, os.open(spare[0], os.O_WRONLY | os.O_CLOEXEC)
        try:
            pwrite_all(fd, [memoryview(raw), view])
            if old > size:
                os.ftruncate(fd, size)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(where)
            raise
        os.close(fd)
        os.replace(where, self._file(key))
        self._heads[key] = _Head(raw, header)

    @contextmanager
    def read_ahead(self, keys: Iterable[int]) -> Iterator[None]:
        """Read the held ``keys`` now, on this thread and a helper (``diskio.read_all``); within
        the block, ``load`` of each returns that read (once) and ``delete`` drops it.  Every read
        is over before the block runs, so it may change the tier; nested calls read nothing."""
        held = [] if self._reading_ahead else [k for k in dict.fromkeys(keys) if k in self._heads]
        if len(held) < 2:
            yield
            return
        bufs = [self._empty(k) for k in held]  # here: the helper's malloc arena would not reuse
        got = read_all(lambda i: self._read(held[i], bufs[i]), len(held), helpers=helper_threads())
        self._ahead, self._reading_ahead = dict(zip(held, got, strict=True)), True
        try:
            yield
        finally:
            self._ahead, self._reading_ahead = {}, False

    def load(self, key: int, *, host: bool = True) -> torch.Tensor:
        """Read and (unless ``verify=False``) verify the block; raises OSError, BlockFormatError."""
        if self._ahead:
            data = self._ahead.pop(key, None)
            if isinstance(data, Exception):
                raise data
            if data is not None:
                return data  # type: ignore[return-value]
        return self._read(key)

    def _empty(self, key: int) -> torch.Tensor:
        header = self._heads[key].header
        return torch.empty(header.shape, dtype=header.dtype, pin_memory=self.pinned)

    def _read(self, key: int, data: torch.Tensor | None = None) -> torch.Tensor:
        """``load`` without the reads ahead, into ``data`` (a fresh tensor by default)."""
        # the header is known (written or scanned here): the file's must be the same 80 bytes,
        # so no parsing; a shorter file fails the read, a changed one these checks
        raw, header = self._heads[key]
        fd = os.open(self._file(key), os.O_RDONLY | os.O_CLOEXEC)
        try:
            head = bytearray(HEADER_SIZE)
            if data is None:
                data = self._empty(key)
            digest = read_block(fd, head, _bytes_of(data), self.READ_CHUNK, self.verify)
        finally:
            os.close(fd)
        if head != raw:
            raise BlockFormatError(f"file for {key:016x} holds another header than it was given")
        if digest is not None and header.checksum is not None and digest != header.checksum:
            raise ChecksumMismatch(key, header.checksum, digest)
        return data

    def delete(self, key: int) -> None:
        if self._ahead:
            self._ahead.pop(key, None)
        head = self._heads.pop(key, None)
        if head is None:
            return
        size = HEADER_SIZE + head.header.nbytes
        path = self._file(key)
        try:
            if not self.spares.give(path, size, self._scratch(".spare")):
                os.unlink(path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unlink the spare files; the blocks stay for a reopen."""
        self.spares.clear()


_NUMPY_DTYPES = frozenset({torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8})


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A 1-D byte view of a contiguous host tensor, as ``blockfmt.payload_view`` but with fewer
    torch calls where numpy knows the dtype (each costs microseconds when caches are cold)."""
    if tensor.dtype in _NUMPY_DTYPES and tensor.numel():
        return memoryview(tensor.numpy()).cast("B")
    return memoryview(byte_view(tensor).numpy())


def _unlink_quietly(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
