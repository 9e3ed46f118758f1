"""The one interface every block transport implements, and the hooks its serving side calls.

``peer`` is whatever addresses a remote agent for that transport ("host:port" for TCP, a rank
for torch.distributed).  ``fetch`` returns the blocks the peer holds among ``keys``, in request
order (``prefix=True``: stopping at the first one it lacks); ``push`` hands blocks to the peer's
store and returns how many it did not already hold (or, with a versioned store, how many it
stored).  Blocks arrive verified (checksum per block) and byte-identical, each with the
``Block.version`` it was sent with (``migration.UNVERSIONED`` when the sender had none); errors are
``errors.TransportError`` subclasses (or ``ChecksumMismatch``).

The serving side of every transport (``TcpBlockServer``, ``DistTransport.serve_one``) reads and
writes the store through two hooks: ``export(key) -> (header, tensor, version) | None`` for
fetches and ``accept(blocks) -> stored`` for pushed blocks, versions attached.  A
``versioned.VersionedBlocks`` provides both (its ``export`` / ``accept``: a copy older than the
held block is refused and counted); without them, :func:`plain_export` / :func:`plain_accept`
serve a bare store, unversioned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ..blockfmt import Block, BlockHeader
from ..migration import Version

Export = Callable[[int], tuple[BlockHeader, torch.Tensor, Version | None] | None]
Accept = Callable[[list[Block]], int]


class BlockTransport(Protocol):
    async def fetch(
        self, peer: Any, keys: Sequence[int], *, prefix: bool = False
    ) -> list[Block]: ...

    async def push(self, peer: Any, blocks: Sequence[Block]) -> int: ...

    async def close(self) -> None: ...


def plain_export(store) -> Export:
    """``export`` for a bare ``KVBlockStore``: its blocks, with no version."""

    def export(key: int):
        item = store.export(key)
        return None if item is None else (*item, None)

    return export


def plain_accept(store) -> Accept:
    """``accept`` for a bare ``KVBlockStore``: ``put`` each block (versions ignored)."""

    def accept(blocks: list[Block]) -> int:
        return sum(
            store.put(b.key, b.tensor, parent=b.parent, copy=False, checksum=b.checksum)
            for b in blocks
        )

    return accept
