"""Consistency checks for :class:`policies.prefix_index.PrefixIndex` (tests and debugging).

Every maintained number is recomputed from the nodes and compared:

* ``where`` maps each node's first hash to it (with ``by_hash``: each stored hash to the one node
  whose segment holds it); sizes agree.
* A live node's segment is exactly as long as its longest holding; holdings are in (0, len].
* Holdings and stamps match one to one, every stamp has a live heap entry, and times never
  decrease as ticks increase.
* Parents are at least as recent as their children in every replica's LRU (so eviction takes the
  deepest blocks first).
* Per-replica block counts equal the recount; no replica is over its capacity; the total is
  within ``max_total_blocks``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .prefix_index import PrefixIndex


def _nodes(index: PrefixIndex) -> list:
    found = {id(n): n for n in index._where.values()}
    for lru in index._lru.values():
        found.update((id(n), n) for n in lru.stamp)
    return list(found.values())


def recount(index: PrefixIndex) -> dict[str, int]:
    counts: dict[str, int] = dict.fromkeys(index._lru, 0)
    for node in _nodes(index):
        for rid, h in node.held.items():
            counts[rid] = counts.get(rid, 0) + h
    return counts


def audit(index: PrefixIndex) -> list[str]:
    problems: list[str] = []
    where = index._where
    nodes = _nodes(index)
    stored = sum(len(n.seg) for n in nodes)
    if stored != index._stored or len(where) != (stored if index._by_hash else len(nodes)):
        problems.append("where size or stored count != sum of segment lengths")
    if len(nodes) != index._nodes:
        problems.append(f"node count {index._nodes} != {len(nodes)}")
    for node in nodes:
        mapped = node.seg if index._by_hash else node.seg[:1]
        if any(where.get(h) is not node for h in mapped):
            problems.append("segment hash not mapped to its node")
        if not node.held or max(node.held.values()) != len(node.seg):
            problems.append("segment length != longest holding")
        for rid, h in node.held.items():
            if not 0 < h <= len(node.seg) or rid not in index._lru or node not in index._lru[rid]:
                problems.append(f"bad holding {rid}={h}")
    owner = {h: n for n in nodes for h in n.seg}
    for rid, lru in index._lru.items():
        if any(rid not in n.held for n in lru.stamp):
            problems.append(f"{rid}: stamp without holding")
        live = {
            id(e[4])
            for e in lru.heap
            if lru.stamp.get(e[4], (None,))[0] == e[0] and e[1] == -e[4].start
        }
        if live != {id(n) for n in lru.stamp}:
            problems.append(f"{rid}: heap does not cover the stamped holdings")
        stamps = sorted(lru.stamp.values())
        if any(a[1] > b[1] for a, b in zip(stamps, stamps[1:], strict=False)):
            problems.append(f"{rid}: times decrease while ticks increase")
        for node, (tick, _, _) in lru.stamp.items():
            parent = owner.get(node.parent_hash) if node.start else None
            if parent is not None and parent in lru.stamp and lru.stamp[parent][0] < tick:
                problems.append(f"{rid}: parent older than child")
        if index._blocks[rid] > index._effective[rid]:
            problems.append(f"{rid}: over capacity")
    if recount(index) != index._blocks:
        problems.append("maintained block counts != recount")
    if index._stored > index.max_total_blocks:
        problems.append("over max_total_blocks")
    return problems


# Rough sizes behind stats()["approx_bytes"]; bench_policy measures the real figure.
_BYTES_PER_BLOCK = 44  # hash int + list slot
_BYTES_PER_MAPPED = 40  # a where entry (every block with by_hash, else each node's first)
_BYTES_PER_NODE = 240  # node object + held dict
_BYTES_PER_HOLDING = 200  # one replica's stamp, heap entry and held entry


def stats(index: PrefixIndex) -> dict:
    holdings = sum(len(lru) for lru in index._lru.values())
    total = index._stored
    return {
        "blocks": dict(index._blocks),
        "capacity": dict(index._effective),
        "total_blocks": total,
        "mapped": len(index._where),
        "by_hash": index._by_hash,
        "nodes": index._nodes,
        "holdings": holdings,
        "orphan_events": index._orphan_events,
        "approx_bytes": total * _BYTES_PER_BLOCK
        + len(index._where) * _BYTES_PER_MAPPED
        + index._nodes * _BYTES_PER_NODE
        + holdings * _BYTES_PER_HOLDING,
    }
