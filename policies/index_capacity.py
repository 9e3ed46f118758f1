"""The capacity model of :class:`policies.prefix_index.PrefixIndex` (see its header: "Capacity
model", "Learned capacity", "Bounded memory"): configured and learned capacity per replica, and
the evictions that keep the recorded blocks within them.

The base of the index's classes (``CapacityModel`` <- ``KvEvents`` <- ``PrefixIndex``, one line
of single inheritance, as mypyc compiles it): it declares the index's state, which
``PrefixIndex.__init__`` sets up, and the helpers it needs from ``PrefixIndex`` (``_add_replica``,
``_walk``, ``_shrink_holding``).
"""

from __future__ import annotations

from collections.abc import Sequence

from .index_parts import Node, Recency


class CapacityModel:
    default_capacity: int
    max_total_blocks: int
    min_capacity: int
    miss_ratio: float
    shrink: float
    grow: float
    settle_s: float
    _where: dict[int, Node]  # first hash of each node (every hash once by_hash)
    _by_hash: bool
    _stored: int  # distinct blocks stored: the sum of the segments' lengths
    _lru: dict[str, Recency]
    _tick: int
    _now: float
    _blocks: dict[str, int]
    _configured: dict[str, int]
    _effective: dict[str, int]
    _set: set[str]  # replicas whose capacity was configured (set_capacity)
    _nodes: int
    _orphan_events: int

    def _add_replica(self, replica_id: str) -> Recency:
        raise NotImplementedError  # PrefixIndex's

    def _walk(self, hashes: Sequence[int]) -> list[tuple[Node, int]]:
        raise NotImplementedError  # PrefixIndex's

    def _shrink_holding(self, replica_id: str, node: Node, keep: int) -> int:
        raise NotImplementedError  # PrefixIndex's

    def capacity(self, replica_id: str) -> int:
        """The effective (learned) capacity of a replica, in blocks."""
        return self._effective.get(replica_id, self.default_capacity)

    def rooms(self, replica_ids: Sequence[str]) -> list[int]:
        """Per replica, in order: the blocks it can still record before the capacity model
        evicts (< 0: never)."""
        eff, blocks, default = self._effective, self._blocks, self.default_capacity
        return [eff.get(r, default) - blocks.get(r, 0) for r in replica_ids]

    def configured_capacity(self, replica_id: str) -> int | None:
        """The capacity configured for a replica (None: it has the default, or is unknown)."""
        return self._configured.get(replica_id) if replica_id in self._set else None

    def set_capacity(self, replica_id: str, blocks: int) -> None:
        """Configure a replica's capacity in blocks (e.g. from its KV-cache size); resets learning."""
        if blocks < 1:
            raise ValueError("capacity must be >= 1 block")
        if replica_id not in self._lru:
            self._add_replica(replica_id)
        self._configured[replica_id] = blocks
        self._effective[replica_id] = blocks
        self._set.add(replica_id)
        self._evict(replica_id)

    def observe(
        self,
        replica_id: str,
        predicted_tokens: int,
        actual_tokens: int,
        hashes: Sequence[int] = (),
        tokens_per_hash: int = 1,
        dispatched_at: float | None = None,
    ) -> None:
        """Learn the replica's effective capacity from predicted vs reported cached tokens.

        With the request's ``hashes`` and ``dispatched_at`` (same clock as ``now``), a shortfall
        only counts if the first block the replica lacked was recorded on it at least
        ``settle_s`` before the dispatch.
        """
        if replica_id not in self._lru or predicted_tokens <= 0:
            return
        eff = self._effective[replica_id]
        if actual_tokens < self.miss_ratio * predicted_tokens:
            if hashes and dispatched_at is not None:
                since = self._since(replica_id, hashes, actual_tokens // max(1, tokens_per_hash))
                if since is None or since > dispatched_at - self.settle_s:
                    return
            base = min(eff, self._blocks[replica_id])
            eff = max(self.min_capacity, int(base * (1.0 - self.shrink)))
        elif actual_tokens >= predicted_tokens:
            eff = min(self._configured[replica_id], eff + max(1, int(eff * self.grow)))
        self._effective[replica_id] = eff
        self._evict(replica_id)

    def expire(self, older_than: float) -> int:
        """Forget holdings last used before ``older_than`` (same time base as ``insert``'s now)."""
        forgotten = 0
        for rid, lru in self._lru.items():
            while (entry := lru.oldest()) is not None and entry[2] < older_than:
                forgotten += self._shrink_holding(rid, entry[4], 0)
        return forgotten

    def _since(self, replica_id: str, hashes: Sequence[int], k: int) -> float | None:
        """When the replica first got the node holding ``hashes[k]`` (None if it does not)."""
        for node, covered in self._walk(hashes):
            if node.start <= k < node.start + covered:
                stamp = self._lru[replica_id].stamp.get(node)
                return None if stamp is None else stamp[2]
        return None

    def _evict(self, replica_id: str) -> None:
        excess = self._blocks[replica_id] - self._effective[replica_id]
        if excess <= 0:
            return
        lru = self._lru[replica_id]
        while excess > 0:
            entry = lru.oldest()
            assert entry is not None  # blocks are recorded: some holding is
            node = entry[4]
            h = node.held[replica_id]
            excess -= self._shrink_holding(replica_id, node, max(0, h - excess))

    def _enforce_total(self) -> None:
        while self._stored > self.max_total_blocks:
            heads = [(e, rid) for rid, lru in self._lru.items() if (e := lru.oldest()) is not None]
            entry, rid = min(heads, key=lambda x: x[0][0])
            self._shrink_holding(rid, entry[4], 0)
