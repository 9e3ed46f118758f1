"""File I/O of the disk tier: vectored whole-block writes and reads, and batch reads on two threads.

``read_all`` runs a batch of block reads on the calling thread and one helper thread, both taking
the next unread block until none is left: a verified read is a page-cache copy (``preadv``) and an
xxh3 pass, and both release the GIL (xxhash above 64 KiB), so two threads overlap them.  The
helper is started once per batch and joined before ``read_all`` returns: no read is in flight
afterwards, so the tier's files may change again.  What was measured on the README's 2-vCPU VM
(``kvgate bench transfer``) and dropped:

* a helper woken per block (hashing the pieces behind the reads, or reading half of each block):
  waking a sleeping thread costs about 70 us there, a quarter of a 2 MiB read;
* a pipeline in which the helper reads ahead while the caller already moves the blocks read
  (the store's bookkeeping between the reads): the caller's bookkeeping holds the GIL, and every
  time one thread wants it back from the other it sleeps and is woken (0.71 of memcpy against
  0.78 for reading the whole batch first, in the same rounds);
* buffers allocated by the helper: glibc gives the helper its own malloc arena, whose freed
  blocks the caller's arena never reuses, so every batch paid thousands of page faults
  (the caller allocates every buffer before the reads start);
* renaming each file to a spare on the reader threads right after its read (the rename the
  block's departure needs): 10 us per block off the caller's moves, 36 us more on the reads.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable

import xxhash

from .blockfmt import HEADER_SIZE, checksum
from .errors import BlockFormatError


def helper_threads() -> int:
    """1 where this process may run on more than one CPU (a helper reader pays off), else 0."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return 1 if cpus > 1 else 0


def read_all(read: Callable[[int], object], n: int, *, helpers: int = 1) -> list[object]:
    """``[read(0), ..., read(n - 1)]``, run by the caller and ``helpers`` threads (each takes the
    next index left); an exception ``read`` raised stands in the list in place of its result.
    ``read`` must be safe to run on several threads at once."""
    out: list[object] = [None] * n
    claims = itertools.count()  # next() on it is atomic under the GIL

    def work() -> None:
        for i in claims:
            if i >= n:
                return
            try:
                out[i] = read(i)
            except Exception as exc:  # handed to whoever uses the block
                out[i] = exc

    threads = [threading.Thread(target=work, name="kv-read", daemon=True) for _ in range(helpers)]
    for t in threads:
        t.start()
    try:
        work()
    finally:
        for t in threads:
            t.join()
    return out


def pwrite_all(fd: int, bufs: list[memoryview]) -> None:
    """Write ``bufs`` back to back from offset 0 (one ``pwritev`` unless the kernel stops short)."""
    bufs, pos = [b for b in bufs if len(b)], 0
    while bufs:
        n = os.pwritev(fd, bufs, pos)
        pos += n
        while n and bufs:
            if n >= len(bufs[0]):
                n -= len(bufs.pop(0))
            else:
                bufs[0] = bufs[0][n:]
                n = 0


def read_block(fd: int, head: bytearray, view: memoryview, step: int, verify: bool) -> int | None:
    """Fill ``head`` then ``view`` from offset 0; returns the payload's xxh3_64 (None unless
    ``verify``).  Up to ``step`` bytes: one ``preadv`` and one hash of the payload while it is
    still in cache; larger payloads in ``step`` pieces, each hashed as it lands."""
    if len(view) <= step or not verify:
        pread_into(fd, [memoryview(head), view], 0)
        return checksum(view) if verify else None
    hasher = xxhash.xxh3_64()
    pread_into(fd, [memoryview(head), view[:step]], 0)
    hasher.update(view[:step])
    for pos in range(step, len(view), step):
        piece = view[pos : pos + step]
        pread_into(fd, [piece], HEADER_SIZE + pos)
        hasher.update(piece)
    return hasher.intdigest()


def pread_into(fd: int, bufs: list[memoryview], offset: int) -> None:
    """Fill ``bufs`` back to back from ``offset`` (one ``preadv`` unless the kernel stops short,
    which for a regular file means its end: BlockFormatError)."""
    bufs = [b for b in bufs if len(b)]
    while bufs:
        n = os.preadv(fd, bufs, offset)
        if n == 0:
            raise BlockFormatError("block file is truncated")
        offset += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs.pop(0))
        if n:
            bufs[0] = bufs[0][n:]
