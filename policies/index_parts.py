"""Building blocks of :class:`policies.prefix_index.PrefixIndex` (see its header for the algorithm).

* ``Node``: a contiguous run ``seg`` of one hash chain starting at depth ``start``, with the
  replicas holding a prefix of it (``held``).
* ``Recency``: one replica's holdings ordered by last use.  Each holding has a stamp
  ``(tick, now, since)`` -- ``tick`` from a counter global to the index, so stamps order all
  replicas' uses; ``since`` is when the replica first got the node -- and a min-heap of ``(tick, -start, now, id, node)`` entries finds the least recently
  used one.  Entries go stale when a holding is re-stamped, dropped or its node's ``start`` moves
  (a split); stale entries are skipped when they reach the top and the heap is rebuilt once it
  holds more than twice the live entries.  Equal ticks (a split's head and tail) are ordered
  deepest first, so a tail is always evicted before its head.
* ``common_prefix``: where a chain leaves a segment, by binary search under the chain property.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush


class Node:
    __slots__ = ("seg", "start", "parent_hash", "held", "forked")

    def __init__(self, start: int, parent_hash: int | None) -> None:
        self.seg: list[int] = []
        self.start = start
        self.parent_hash = parent_hash  # the hash just before seg[0]; None at the root
        self.held: dict[str, int] = {}  # replica -> blocks held (a prefix of seg)
        self.forked = False  # another node hangs from this node's end: do not extend it


Entry = tuple[int, int, float, int, Node]


class Recency:
    __slots__ = ("stamp", "heap")

    def __init__(self) -> None:
        self.stamp: dict[Node, tuple[int, float, float]] = {}
        self.heap: list[Entry] = []

    def __len__(self) -> int:
        return len(self.stamp)

    def __contains__(self, node: Node) -> bool:
        return node in self.stamp

    def touch(self, node: Node, tick: int, now: float) -> None:
        old = self.stamp.get(node)
        self.stamp[node] = (tick, now, now if old is None else old[2])
        heappush(self.heap, (tick, -node.start, now, id(node), node))
        if len(self.heap) > 2 * len(self.stamp) + 64:
            self.heap = [(st[0], -n.start, st[1], id(n), n) for n, st in self.stamp.items()]
            heapify(self.heap)

    def restamp(self, node: Node, stamp: tuple[int, float, float]) -> None:
        """Give ``node`` an existing stamp (a split copies the tail's stamp to the head)."""
        self.stamp[node] = stamp
        heappush(self.heap, (stamp[0], -node.start, stamp[1], id(node), node))

    def discard(self, node: Node) -> None:
        self.stamp.pop(node, None)

    def oldest(self) -> Entry | None:
        """The least recently used holding's entry (stale entries on top are dropped)."""
        heap = self.heap
        stamp = self.stamp
        while heap:
            entry = heap[0]
            node = entry[4]
            st = stamp.get(node)
            if st is not None and st[0] == entry[0] and entry[1] == -node.start:
                return entry
            heappop(heap)
        return None


def common_prefix(seg: list[int], hs: tuple[int, ...], i: int, limit: int) -> int:
    """Length of the common prefix of ``seg`` and ``hs[i:]``, at most ``limit`` (>= 1).

    ``seg[0] == hs[i]`` is known.  Exact under the chain property (if position k is equal, every
    position before it is too): compare the last position, else binary search.
    """
    if seg[limit - 1] == hs[i + limit - 1]:
        return limit
    lo, hi = 1, limit - 1  # seg[lo-1] equal, seg[hi] different
    while lo < hi:
        mid = (lo + hi) >> 1
        if seg[mid] == hs[i + mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo
