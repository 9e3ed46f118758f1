"""Per-block versions over a :class:`~worker_agent.store.KVBlockStore` (the agent's write path).

Every held block has a :class:`~worker_agent.migration.Version` ``(counter, writer)``:

* a local write (:meth:`VersionedBlocks.write`) bumps it: ``counter`` = the highest seen for the
  block + 1, ``writer`` = this node, and replaces what the store held;
* a copy from a peer (:meth:`VersionedBlocks.apply`, for pulls and for pushes the data port
  receives) is stored only if its version is higher than the held block's: a lower one is refused
  and counted ``stale``, an equal one is a ``duplicate`` (the same write, already here);
* a block that nobody versioned (put straight into the store, reopened from disk, sent by a peer
  without versions) is :data:`~worker_agent.migration.UNVERSIONED`, the lowest version.

So, per block, the highest version wins on every node whatever order copies arrive in.  Versions
are kept for held blocks only: :meth:`prune` forgets those of evicted blocks, and runs by itself
when the map outgrows twice the store (plus ``slack``), so it stays the size of the store; a copy
arriving for a block not held is taken with its own version.
Check, store and record happen under one lock, so an export never pairs a version with other bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .blockfmt import Block, BlockHeader
from .errors import CapacityError
from .migration import UNVERSIONED, BlockVersions, Version
from .store import KVBlockStore


@dataclass
class ApplyCounts:
    stored: int = 0  # copies now held (new blocks and replacements)
    replaced: int = 0  # of which replaced an older version
    stale: int = 0  # refused: the held block is newer
    duplicate: int = 0  # refused: the held block has the same version
    rejected: int = 0  # did not fit any tier

    def add(self, other: ApplyCounts) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class VersionedBlocks:
    """A store whose blocks carry versions (see the module header)."""

    def __init__(self, store: KVBlockStore, node: str, *, slack: int = 1024) -> None:
        self.store = store
        self.slack = slack
        self.versions = BlockVersions(node)
        self.totals = ApplyCounts()  # every apply since start
        self._lock = threading.Lock()

    def version(self, key: int) -> Version | None:
        """The held block's version, or None when the store does not hold ``key``."""
        with self._lock:
            return self._held(key)

    def _held(self, key: int) -> Version | None:
        if key not in self.store:
            return None
        return self.versions.get(key) or UNVERSIONED

    # -- writes ----------------------------------------------------------------------------------
    def write(self, blocks: Sequence[Block], *, tier: int = 0) -> list[Version]:
        """Local (re)writes of a chain, as ``KVBlockStore.put_blocks`` (block i's parent defaults
        to block i-1; stored tail first): each block gets a version above every one seen for it."""
        out = []
        with self._lock:
            for i in reversed(range(len(blocks))):
                b = blocks[i]
                if b.parent is None and i > 0:
                    b = b._replace(parent=blocks[i - 1].key)
                out.append(self.versions.bump(b.key))
                self._replace(b, tier, copy=True)
            self._maybe_prune()
        return out[::-1]

    def apply(self, blocks: Iterable[Block], *, tier: int = 0) -> ApplyCounts:
        """Copies from a peer: each is stored iff its version beats the held one (handed over)."""
        counts = ApplyCounts()
        with self._lock:
            for b in blocks:
                incoming = b.version or UNVERSIONED
                held = self._held(b.key)
                if held is not None and held >= incoming:
                    if held > incoming:
                        counts.stale += 1
                    else:
                        counts.duplicate += 1
                    continue
                try:
                    stored = self._replace(b, tier, copy=False)
                except CapacityError:
                    counts.rejected += 1
                    continue
                if stored:
                    counts.stored += 1
                    counts.replaced += held is not None
                    self.versions.versions[b.key] = incoming
            self.totals.add(counts)
            self._maybe_prune()
        return counts

    def accept(self, blocks: list[Block]) -> int:
        """The data port's hook for pushed blocks: how many were stored."""
        return self.apply(blocks).stored

    def _replace(self, b: Block, tier: int, *, copy: bool) -> bool:
        self.store.remove(b.key)
        return self.store.put(
            b.key, b.tensor, parent=b.parent, tier=tier, copy=copy, checksum=b.checksum
        )

    # -- reads -----------------------------------------------------------------------------------
    def export(self, key: int) -> tuple[BlockHeader, torch.Tensor, Version] | None:
        """A block for a peer with the version of exactly these bytes (the data port's hook)."""
        with self._lock:
            item = self.store.export(key)
            return None if item is None else (*item, self._held(key) or UNVERSIONED)

    def export_blocks(self, keys: Iterable[int]) -> list[Block]:
        out = []
        for key in keys:
            item = self.export(key)
            if item is not None:
                header, tensor, version = item
                out.append(Block(key, tensor, header.parent, header.checksum, version))
        return out

    def prune(self) -> int:
        """Forget the versions of blocks the store no longer holds; returns how many."""
        with self._lock:
            return self._prune()

    def _prune(self) -> int:
        gone = [k for k in self.versions.versions if k not in self.store]
        for k in gone:
            del self.versions.versions[k]
        return len(gone)

    def _maybe_prune(self) -> None:
        if len(self.versions.versions) > 2 * len(self.store) + self.slack:
            self._prune()
