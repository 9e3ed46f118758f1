"""KV events for :class:`policies.prefix_index.PrefixIndex` (see its header: "Storage", "Events"):
stored runs that continue a parent block, removed blocks, and the lookup by any block hash they
need.

On the request path the index maps only each node's first hash (that is all ``match`` and
``insert`` look up), so recording a new 32k-token prompt costs one dict entry, not 512.  An
engine's events name blocks anywhere in a chain (the parent of a stored run, each removed block),
so the first such event makes the index map every stored hash to its node
(``_hash_every_block``), once: from then on inserts, splits and trims keep that map whole.

Between ``CapacityModel`` (the state it works on) and ``PrefixIndex`` (``insert``,
``drop_replica`` and ``_shrink_holding``, declared here) in the index's line of classes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain as _chain
from itertools import repeat

from .index_capacity import CapacityModel
from .index_parts import Node


class KvEvents(CapacityModel):
    def insert(self, replica_id: str, hashes: Sequence[int], now: float | None = None) -> int:
        raise NotImplementedError  # PrefixIndex's

    def drop_replica(self, replica_id: str) -> int:
        raise NotImplementedError  # PrefixIndex's

    def apply_events(
        self,
        replica_id: str,
        stored: Iterable[tuple[int | None, Sequence[int]]] = (),
        removed: Iterable[int] = (),
        cleared: bool = False,
        now: float | None = None,
    ) -> None:
        """Apply KV events from a replica's engine or agent, in the order cleared, stored, removed."""
        if cleared:
            self.drop_replica(replica_id)
        for parent, hashes in stored:
            if parent is None:
                self.insert(replica_id, hashes, now)
            else:
                self.insert_after(replica_id, parent, hashes, now)
        removed = list(removed)
        if removed:
            self.remove(replica_id, removed)

    def insert_after(
        self, replica_id: str, parent_hash: int, hashes: Sequence[int], now: float | None = None
    ) -> int:
        """Record a run that continues the stored block ``parent_hash`` (an engine BlockStored).

        The replica is taken to hold the parent's whole prefix too.  Returns the blocks newly
        recorded, or -1 when the parent is unknown (the event is counted as an orphan).
        """
        prefix = self._prefix_through(parent_hash)
        if prefix is None:
            self._orphan_events += 1
            return -1
        return self.insert(replica_id, prefix + tuple(hashes), now)

    def remove(self, replica_id: str, hashes: Iterable[int]) -> int:
        """Forget that the replica holds these blocks (and the rest of each one's node after it)."""
        self._hash_every_block()
        where = self._where
        firsts: dict[Node, list[int]] = {}
        for h in hashes:
            node = where.get(h)
            if node is not None and replica_id in node.held:
                firsts.setdefault(node, []).append(h)
        removed = 0
        for node, hs in firsts.items():
            if len(hs) == 1:
                cut = node.seg.index(hs[0])
            else:
                pos = dict(zip(node.seg, range(len(node.seg)), strict=True))
                cut = min(pos[h] for h in hs)
            removed += self._shrink_holding(replica_id, node, cut)
        return removed

    def _prefix_through(self, h: int) -> tuple[int, ...] | None:
        """The stored chain from the root through hash ``h``, or None if it is not intact."""
        self._hash_every_block()
        where = self._where
        node = where.get(h)
        if node is None:
            return None
        parts = [node.seg[: node.seg.index(h) + 1]]
        while node.start:
            parent = where.get(node.parent_hash)  # type: ignore[arg-type]
            if parent is None:
                return None
            off = node.start - 1 - parent.start
            if not 0 <= off < len(parent.seg) or parent.seg[off] != node.parent_hash:
                return None
            parts.append(parent.seg[: off + 1])
            node = parent
        return tuple(_chain.from_iterable(reversed(parts)))

    def _hash_every_block(self) -> None:
        """Map every stored hash to its node (once; see the header).  A hash stored in two nodes
        (input that is not a chain) stays with the shallower node (the lower first hash at equal
        depth); the other node is cut before it, with its holdings."""
        if self._by_hash:
            return
        full: dict[int, Node] = {}
        for node in sorted(set(self._where.values()), key=lambda n: (n.start, n.seg[0])):
            seg = node.seg
            k = 0
            for h in seg:
                if h in full:
                    break
                k += 1
            full.update(zip(seg[:k], repeat(node)))
            if k < len(seg):
                self._cut(node, k)
        self._where = full
        self._stored = len(full)
        self._by_hash = True

    def _cut(self, node: Node, k: int) -> None:
        """Keep the first ``k`` blocks of ``node`` (its holdings too), without touching ``where``."""
        for rid, h in list(node.held.items()):
            if h > k:
                if k:
                    node.held[rid] = k
                else:
                    del node.held[rid]
                    self._lru[rid].discard(node)
                self._blocks[rid] -= h - k
        node.seg = node.seg[:k]
        node.forked = False
        if not k:
            self._nodes -= 1
