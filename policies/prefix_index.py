"""PrefixIndex: the approximate local view of which replica holds which prefix block.

Algorithm (keep this header in sync with the code):

* Input.  A request's prefix is a chain of hashes ``h_0..h_{n-1}`` (see :mod:`policies.hashing`):
  ``h_i`` names the whole prefix ``0..i``, so equal hashes at position ``i`` imply equal prefixes and
  a hash has one intrinsic depth ``i``.  The index relies on this (collisions are 2^-64 events).
* Storage: a radix forest over hashes, flattened.  A node holds a contiguous run ``seg`` (a list)
  of one chain, starting at depth ``start``; each hash lives in exactly one node.  One dict
  ``where`` maps each node's first hash to the node: that is all ``match`` and ``insert`` look
  up, so recording a new 32k-token prompt (512 hashes) is one dict entry, not 512.  With
  ``by_hash`` (set by the first KV event that names a block inside a chain, see
  ``index_events``) it maps every stored hash to its node.  ``node.held[replica] = k`` says the
  replica holds the first ``k`` blocks of ``seg`` (always a prefix of the segment: a replica that
  lost block ``j`` cannot use blocks after it).  ``node.parent_hash`` is ``h_{start-1}``.
* match(chain): ``node = where[h_0]``; compare the chain with ``node.seg`` (last element first; on a
  mismatch, binary search for the divergence point -- exact under the chain property); every
  replica whose ``held`` covers the common part stays in the running; continue at the next depth
  with ``where[h_i]``.  The cost is one dict lookup per *node* on the path, not per hash: a 512-hash
  warm prompt usually walks 1-3 nodes (a shared system prompt, the conversation).
* insert(replica, chain, now): walk as in match, raising ``held`` for the replica on each node of the
  path.  A node the chain covers only in part (it diverges or ends inside) is split there first,
  so every node on a path is used whole and recency stays exact per node.  The unmatched tail
  becomes a new node -- or extends the path's last node when nothing else hangs from that node's
  end (``forked``), so a conversation's turns stay one node and paths stay 1-3 nodes long.
  ``truncate`` and the learning's lookups walk the chain the same way.
* Capacity model (LRU per replica, over nodes).  Each replica stamps the nodes it holds with a
  tick of one counter (``index_parts.Recency``: stamps plus a lazily cleaned heap).  An insert
  stamps the path leaf first and root last, so a parent is always at least as recent as its
  children and eviction takes the deepest blocks first (as vLLM frees a request's blocks in
  reverse).  When the blocks recorded for a replica exceed its capacity
  the tail blocks of its least recently used node are forgotten (``held`` shrinks; the node's
  position is kept), because the engine must have evicted them.  A node nobody holds is trimmed
  and, once empty, leaves ``where``.  A split gives the new head node the tail's stamp for every
  holder (ties go deepest first), so recency is exact across splits.
* Learned capacity (``observe``).  The configured capacity is an upper bound; the effective one
  adapts to what the replica reports: a clear shortfall (actual cached tokens < ``miss_ratio`` x
  predicted) on blocks the replica was recorded holding at least ``settle_s`` before the request
  was dispatched means the engine evicted blocks we believed resident, so the effective capacity
  drops to ``(1 - shrink)`` x min(effective, recorded blocks), never below ``min_capacity``; a
  confirmed hit grows it by ``grow`` x effective up to the configured capacity (AIMD).  Fresher
  holdings prove nothing: a burst of requests sharing a new prefix is predicted to hit blocks the
  first of them is still computing.  A replica that does
  not cache at all converges to ``min_capacity``; behind several unsynchronised gateways each one
  converges to its share of the engine's cache.
* Bounded memory.  ``max_total_blocks`` caps the distinct blocks stored; above it the globally least
  recently used holding goes (any number of replicas can come and go: ``drop_replica``).
  ``_stored`` counts the distinct blocks (the sum of the segments' lengths).
* Events (``index_events``).  ``apply_events`` takes engine/agent KV events: stored runs
  (``(parent_hash, hashes)``, the parent ``None`` for a chain from the root), removed hashes and a
  cleared flag.
* Memory (tracemalloc, hash ints included; ``kvgate bench policy``): about 45 MB per million
  blocks recorded in long chains (512-hash nodes), about 82 MB per million in 16-hash nodes
  (85 and 120 with ``by_hash``); another replica holding the same node adds about 110 bytes per
  node, not per block.

``now`` is the gateway's monotonic clock; a missing or earlier ``now`` counts as the latest seen, so
stamps never go back in time (``expire`` relies on it).  Not thread-safe; the gateway calls it from
its event loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat

from .index_events import KvEvents
from .index_parts import Node, Recency, common_prefix

_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend



class PrefixIndex(KvEvents):
    """Which replica holds which prefix blocks, with a per-replica LRU capacity model."""

    def __init__(
        self,
        default_capacity: int = 65_536,
        max_total_blocks: int = 1 << 21,
        min_capacity: int = 64,
        miss_ratio: float = 0.5,
        shrink: float = 0.1,
        grow: float = 0.02,
        settle_s: float = 10.0,
        by_hash: bool = False,
    ) -> None:
        if default_capacity < 1 or max_total_blocks < 1 or min_capacity < 1:
            raise ValueError("capacities must be >= 1")
        if not (0.0 < miss_ratio <= 1.0 and 0.0 <= shrink < 1.0 and grow >= 0.0 <= settle_s):
            raise ValueError("need 0 < miss_ratio <= 1, 0 <= shrink < 1, grow >= 0, settle_s >= 0")
        self.default_capacity = default_capacity
        self.max_total_blocks = max_total_blocks
        self.min_capacity = min(min_capacity, default_capacity)
        self.miss_ratio = miss_ratio
        self.shrink = shrink
        self.grow = grow
        self.settle_s = settle_s
        # the index's state (its types and meaning: CapacityModel, which declares it)
        self._where = {}
        self._by_hash = by_hash
        self._stored = 0
        self._lru = {}
        self._tick = 0
        self._now = 0.0
        self._blocks = {}
        self._configured = {}
        self._effective = {}
        self._set = set()
        self._nodes = 0
        self._orphan_events = 0

    # ------------------------------------------------------------------ queries

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per replica, the number of leading hashes of ``hashes`` it holds (replicas with 0 omitted)."""
        hs = hashes if type(hashes) is tuple else tuple(hashes)
        n = len(hs)
        where = self._where
        node = where.get(hs[0]) if n else None
        if node is None or node.start != 0 or node.seg[0] != hs[0]:
            return {}
        out: dict[str, int] = {}
        alive: Iterable[str] = node.held
        i = 0
        while True:
            seg = node.seg
            limit = min(len(seg), n - i)
            common = common_prefix(seg, hs, i, limit)
            held = node.held
            nxt = []
            for rid in alive:
                h = held.get(rid, 0)
                if h >= common:
                    nxt.append(rid)
                elif i + h:
                    out[rid] = i + h
            i += common
            if not nxt:
                return out
            alive = nxt
            node = where.get(hs[i]) if i < n else None
            if node is None or node.start != i or node.seg[0] != hs[i]:
                for rid in alive:
                    out[rid] = i
                return out

    def blocks(self, replica_id: str) -> int:
        return self._blocks.get(replica_id, 0)

    def replicas(self) -> list[str]:
        return sorted(self._lru)

    def stats(self) -> dict:
        """Sizes per replica and in total, with an approximate memory figure."""
        from .prefix_index_audit import stats

        return stats(self)

    # ------------------------------------------------------------------ updates

    def insert(self, replica_id: str, hashes: Sequence[int], now: float | None = None) -> int:
        """Record that ``replica_id`` holds the chain ``hashes``; returns the blocks newly recorded.

        ``now`` (monotonic seconds) stamps the use for ``expire``; None or an earlier time than
        already seen counts as the latest time seen.
        """
        hs = hashes if type(hashes) is tuple else tuple(hashes)
        n = len(hs)
        if not n:
            return 0
        if now is None or now < self._now:
            now = self._now
        self._now = now
        lru = self._lru.get(replica_id)
        if lru is None:
            lru = self._add_replica(replica_id)
        where = self._where
        path: list[Node] = []
        added = 0
        i = 0
        while i < n:
            node = where.get(hs[i])
            if node is None:
                break
            if node.start != i or node.seg[0] != hs[i]:  # not a chain: record nothing more
                i = n
                break
            common = common_prefix(node.seg, hs, i, min(len(node.seg), n - i))
            if common < len(node.seg):
                node = self._split(node, common)
            cur = node.held.get(replica_id, 0)
            if common > cur:
                node.held[replica_id] = common
                added += common - cur
            path.append(node)
            i += common
        if i < n:
            tail = hs[i:]
            last = path[-1] if path else None
            if last is not None and not last.forked:
                k = self._register(tail, last)
                if k:
                    last.seg += tail if k == len(tail) else tail[:k]
                    last.held[replica_id] += k
            else:
                node = Node(i, hs[i - 1] if i else None)
                k = self._register(tail, node)
                if k:
                    node.seg = list(tail if k == len(tail) else tail[:k])
                    node.held[replica_id] = k
                    self._nodes += 1
                    path.append(node)
            added += k
            self._stored += k
        tick = self._tick
        for node in reversed(path):
            tick += 1
            lru.touch(node, tick, now)
        self._tick = tick
        self._blocks[replica_id] += added
        self._evict(replica_id)
        self._enforce_total()
        return added

    def truncate(self, replica_id: str, hashes: Sequence[int], keep: int) -> int:
        """Forget the replica's blocks of the chain ``hashes`` beyond its first ``keep``."""
        removed = 0
        for node, covered in self._walk(hashes):
            own = max(0, keep - node.start)  # this node's blocks to keep
            if own < covered:
                removed += self._shrink_holding(replica_id, node, own)
        return removed

    def drop_replica(self, replica_id: str) -> int:
        """Forget everything about a replica (removed, restarted or cache cleared)."""
        lru = self._lru.pop(replica_id, None)
        dropped = self._blocks.pop(replica_id, 0)
        self._configured.pop(replica_id, None)
        self._effective.pop(replica_id, None)
        self._set.discard(replica_id)
        for node in lru.stamp if lru is not None else ():
            node.held.pop(replica_id, None)
            self._trim(node)
        return dropped

    # ------------------------------------------------------------------ checks

    def recount(self) -> dict[str, int]:
        """Blocks per replica recomputed from the nodes (for invariant tests)."""
        from .prefix_index_audit import recount

        return recount(self)

    def audit(self) -> list[str]:
        """Inconsistencies between the maintained structures (empty when all is well)."""
        from .prefix_index_audit import audit

        return audit(self)

    # ------------------------------------------------------------------ internals

    def _add_replica(self, replica_id: str) -> Recency:
        lru = Recency()
        self._lru[replica_id] = lru
        self._blocks[replica_id] = 0
        self._configured[replica_id] = self.default_capacity
        self._effective[replica_id] = self.default_capacity
        return lru

    def _walk(self, hashes: Sequence[int]) -> list[tuple[Node, int]]:
        """The nodes the chain runs through, each with how many of its blocks the chain covers."""
        hs = hashes if type(hashes) is tuple else tuple(hashes)
        where = self._where
        n = len(hs)
        out: list[tuple[Node, int]] = []
        i = 0
        while i < n:
            node = where.get(hs[i])
            if node is None or node.start != i or node.seg[0] != hs[i]:
                break
            common = common_prefix(node.seg, hs, i, min(len(node.seg), n - i))
            out.append((node, common))
            if common < len(node.seg):
                break
            i += common
        return out

    def _register(self, tail: tuple[int, ...], node: Node) -> int:
        """Map ``tail``'s hashes to ``node`` (which it extends, or starts when ``node`` is
        new); returns how many leading ones were new and taken.  Without ``by_hash`` only a new
        node's first hash is mapped, and it is new: ``insert`` found nothing there."""
        where = self._where
        if not self._by_hash:
            if not node.seg:
                where[tail[0]] = node
            return len(tail)
        before = len(where)
        _consume(map(where.setdefault, tail, repeat(node)))
        if len(where) - before == len(tail):
            return len(tail)
        # Some hash was already stored (not a chain): keep the leading run of fresh ones.
        old = set(node.seg)
        seen: set[int] = set()
        k = 0
        for h in tail:
            if where.get(h) is not node or h in seen or h in old:
                break
            seen.add(h)
            k += 1
        for h in tail[k:]:
            if where.get(h) is node and h not in seen and h not in old:
                del where[h]
        return k

    def _split(self, node: Node, m: int) -> Node:
        """Cut ``node`` after its first ``m`` blocks; returns the new head (``node`` keeps the tail)."""
        head = Node(node.start, node.parent_hash)
        head.seg = node.seg[:m]
        head.forked = True
        node.seg = node.seg[m:]
        node.start += m
        node.parent_hash = head.seg[-1]
        if self._by_hash:
            self._where.update(zip(head.seg, repeat(head)))
        else:
            self._where[head.seg[0]] = head
            self._where[node.seg[0]] = node
        self._nodes += 1
        for rid, h in list(node.held.items()):
            lru = self._lru[rid]
            stamp = lru.stamp[node]
            head.held[rid] = min(h, m)
            lru.restamp(head, stamp)
            if h > m:
                node.held[rid] = h - m
                lru.restamp(node, stamp)  # its start moved: the old heap entry is stale
            else:
                del node.held[rid]
                lru.discard(node)
        return head

    def _shrink_holding(self, replica_id: str, node: Node, keep: int) -> int:
        """Reduce the replica's holding of ``node`` to its first ``keep`` blocks."""
        h = node.held.get(replica_id, 0)
        if h <= keep:
            return 0
        if keep:
            node.held[replica_id] = keep
        else:
            del node.held[replica_id]
            self._lru[replica_id].discard(node)
        self._blocks[replica_id] -= h - keep
        self._trim(node)
        return h - keep

    def _trim(self, node: Node) -> None:
        longest = max(node.held.values(), default=0)
        seg = node.seg
        if longest >= len(seg):
            return
        if self._by_hash:
            _consume(map(self._where.pop, seg[longest:]))  # each stored hash maps to its own node
        elif not longest and self._where.get(seg[0]) is node:
            del self._where[seg[0]]
        self._stored -= len(seg) - longest
        node.seg = seg[:longest]
        node.forked = False
        if not longest:
            self._nodes -= 1
