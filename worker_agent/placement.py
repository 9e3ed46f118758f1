"""Where each KV block lives: pure bookkeeping and planning for the tiered store (no torch, no I/O).

Model.  Tiers ``0..T-1``, fastest first (GPU, CPU, disk).  Tier ``t`` may hold at most
``capacity[t]`` bytes; a block of ``n`` payload bytes is charged ``n + overhead[t]`` there (the disk
tier's file header).  Every block lives in exactly one tier (an exclusive hierarchy), and each tier
keeps its blocks in LRU order, least recently used first.

Victims.  To free room in tier ``t`` the planner looks at the ``scan`` least recently used blocks
of ``t`` and picks the one with the fewest hits (ties: the least recently used).  ``scan=1`` is
plain LRU; a larger window lets a hot block outlive a colder block that was used a little later.

Steps.  Every mutation updates the bookkeeping at once and returns the physical steps the executor
must perform, in order:

* ``TAKE(key, src)``   take the block out of ``src`` into a staging area (promotion/move source)
* ``MOVE(key, src, dst)`` copy the block from ``src`` to ``dst`` and delete it from ``src``
* ``DROP(key, src)``   delete the block (eviction)
* ``PLACE(key, dst)``  store the staged block (or the caller's tensor, for put) into ``dst``

Making room for ``n`` bytes in tier ``t``: while ``used[t] + n > capacity[t]``, the victim ``v`` is
demoted to the first lower tier ``u`` whose capacity can hold it (making room in ``u`` first,
recursively, so ``u``'s steps come before ``MOVE(v, t, u)``), or dropped when none can.  Steps are
thus ordered bottom-up and no tier's accounted bytes exceed its capacity after any step.  A demoted
block enters its new tier as most recently used.

* put(key, n, tier): a present block is only touched.  Otherwise the first tier ``>= tier`` whose
  capacity can hold ``n`` gets it; a block larger than all of them is rejected (CapacityError).
* get(key): a hit in tier ``t`` counts ``hits[t]`` and the block's own hit count.  In tier 0 it is
  touched; deeper, it is promoted: TAKE, room is made in the highest tier that can hold it, PLACE.
* move(key, dst): an explicit promotion or demotion, same steps.

Counters (per tier: blocks, bytes, hits, promotions and demotions out of it, evictions; global:
misses, stored, removed, lost, rejected) are maintained incrementally; ``recount()`` recomputes the
occupancy from the LRU lists and ``blocks_total == stored - evictions - removed - lost`` holds.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .errors import CapacityError


class StepKind(enum.Enum):
    TAKE = "take"
    MOVE = "move"
    DROP = "drop"
    PLACE = "place"


class Step(NamedTuple):
    kind: StepKind
    key: int
    src: int | None = None
    dst: int | None = None


@dataclass(slots=True)
class TierCounters:
    blocks: int = 0
    bytes: int = 0
    hits: int = 0
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0


@dataclass(slots=True)
class PlacementStats:
    tiers: list[TierCounters] = field(default_factory=list)
    misses: int = 0
    stored: int = 0
    removed: int = 0
    lost: int = 0
    rejected: int = 0


class Placement:
    def __init__(
        self,
        capacities: Sequence[int],
        overheads: Sequence[int] | None = None,
        *,
        scan: int = 1,
    ) -> None:
        if not capacities or any(c < 0 for c in capacities):
            raise ValueError("need at least one tier and non-negative capacities")
        if scan < 1:
            raise ValueError("scan must be >= 1")
        self.capacities = tuple(int(c) for c in capacities)
        self.overheads = tuple(overheads or (0,) * len(capacities))
        if len(self.overheads) != len(self.capacities):
            raise ValueError("one overhead per tier")
        self.scan = scan
        self._lru: list[OrderedDict[int, int]] = [OrderedDict() for _ in self.capacities]
        self._where: dict[int, int] = {}
        self._hits: dict[int, int] = {}
        self.stats = PlacementStats(tiers=[TierCounters() for _ in self.capacities])

    # -- queries -------------------------------------------------------------------------------
    @property
    def n_tiers(self) -> int:
        return len(self.capacities)

    def __contains__(self, key: int) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def tier_of(self, key: int) -> int | None:
        return self._where.get(key)

    def size_of(self, key: int) -> int:
        return self._lru[self._where[key]][key]

    def hits_of(self, key: int) -> int:
        return self._hits.get(key, 0)

    def keys(self, tier: int) -> list[int]:
        """Keys of ``tier``, least recently used first."""
        return list(self._lru[tier])

    def charge(self, tier: int, nbytes: int) -> int:
        return nbytes + self.overheads[tier]

    def fits(self, tier: int, nbytes: int) -> bool:
        return self.charge(tier, nbytes) <= self.capacities[tier]

    def hottest(self, n: int) -> list[int]:
        """Up to ``n`` keys with the most hits (for replication)."""
        return sorted(self._hits, key=self._hits.__getitem__, reverse=True)[:n]

    def recount(self) -> list[tuple[int, int]]:
        """(blocks, bytes) per tier recomputed from the LRU lists."""
        return [
            (len(lru), sum(self.charge(t, n) for n in lru.values()))
            for t, lru in enumerate(self._lru)
        ]

    # -- bookkeeping primitives ----------------------------------------------------------------
    def _link(self, key: int, tier: int, nbytes: int) -> None:
        self._lru[tier][key] = nbytes
        self._where[key] = tier
        c = self.stats.tiers[tier]
        c.blocks += 1
        c.bytes += self.charge(tier, nbytes)

    def _unlink(self, key: int) -> tuple[int, int]:
        tier = self._where.pop(key)
        nbytes = self._lru[tier].pop(key)
        c = self.stats.tiers[tier]
        c.blocks -= 1
        c.bytes -= self.charge(tier, nbytes)
        return tier, nbytes

    def _victim(self, tier: int) -> int:
        window = itertools.islice(self._lru[tier], self.scan)
        if self.scan == 1:
            return next(window)
        return min(window, key=lambda k: self._hits.get(k, 0))  # min keeps the first (LRU) tie

    def _make_room(self, tier: int, need: int, steps: list[Step]) -> None:
        cap = self.capacities[tier]
        while self.stats.tiers[tier].bytes + need > cap:
            self._demote(self._victim(tier), tier, steps)

    def _demote(self, key: int, tier: int, steps: list[Step]) -> None:
        _, nbytes = self._unlink(key)
        for lower in range(tier + 1, self.n_tiers):
            if self.fits(lower, nbytes):
                self._make_room(lower, self.charge(lower, nbytes), steps)
                self._link(key, lower, nbytes)
                steps.append(Step(StepKind.MOVE, key, tier, lower))
                self.stats.tiers[tier].demotions += 1
                return
        steps.append(Step(StepKind.DROP, key, tier))
        self.stats.tiers[tier].evictions += 1
        self._hits.pop(key, None)

    def _place(self, key: int, tier: int, nbytes: int, steps: list[Step]) -> None:
        self._make_room(tier, self.charge(tier, nbytes), steps)
        self._link(key, tier, nbytes)
        steps.append(Step(StepKind.PLACE, key, None, tier))

    # -- operations ----------------------------------------------------------------------------
    def touch(self, key: int) -> None:
        tier = self._where.get(key)
        if tier is not None:
            self._lru[tier].move_to_end(key)

    def touch_many(self, keys: Iterable[int]) -> None:
        for key in keys:
            self.touch(key)

    def plan_put(self, key: int, nbytes: int, tier: int = 0) -> list[Step]:
        if key in self._where:
            self.touch(key)
            return []
        for t in range(tier, self.n_tiers):
            if self.fits(t, nbytes):
                steps: list[Step] = []
                self._place(key, t, nbytes, steps)
                self.stats.stored += 1
                return steps
        self.stats.rejected += 1
        raise CapacityError(f"a block of {nbytes} bytes fits no tier from {tier} down")

    def plan_get(self, key: int) -> tuple[int | None, list[Step]]:
        """Record a lookup; returns (tier it was found in or None, steps to promote it)."""
        tier = self._where.get(key)
        if tier is None:
            self.stats.misses += 1
            return None, []
        self.stats.tiers[tier].hits += 1
        self._hits[key] = self._hits.get(key, 0) + 1
        dst = next((u for u in range(tier) if self.fits(u, self._lru[tier][key])), None)
        if dst is None:
            self.touch(key)
            return tier, []
        self.stats.tiers[tier].promotions += 1
        return tier, self._relocate(key, dst)

    def plan_move(self, key: int, dst: int) -> list[Step]:
        tier = self._where[key]
        if dst == tier:
            self.touch(key)
            return []
        if not self.fits(dst, self._lru[tier][key]):
            raise CapacityError(f"block {key:016x} does not fit tier {dst}")
        counters = self.stats.tiers[tier]
        if dst < tier:
            counters.promotions += 1
        else:
            counters.demotions += 1
        return self._relocate(key, dst)

    def _relocate(self, key: int, dst: int) -> list[Step]:
        src, nbytes = self._unlink(key)
        steps = [Step(StepKind.TAKE, key, src)]
        self._place(key, dst, nbytes, steps)
        return steps

    def adopt(self, key: int, nbytes: int, tier: int) -> None:
        """Register a block already held by ``tier`` (a reopened disk tier), as most recent."""
        if key in self._where or not self.fits(tier, nbytes):
            raise CapacityError(f"cannot adopt block {key:016x} into tier {tier}")
        if self.stats.tiers[tier].bytes + self.charge(tier, nbytes) > self.capacities[tier]:
            raise CapacityError(f"tier {tier} is full")
        self._link(key, tier, nbytes)
        self.stats.stored += 1

    def remove(self, key: int) -> int | None:
        """Forget a block on request; returns the tier that held it."""
        if key not in self._where:
            return None
        tier, _ = self._unlink(key)
        self._hits.pop(key, None)
        self.stats.removed += 1
        return tier

    def forget(self, key: int) -> int | None:
        """Forget a block whose physical copy was lost (I/O error, corruption)."""
        if key not in self._where:
            return None
        tier, _ = self._unlink(key)
        self._hits.pop(key, None)
        self.stats.lost += 1
        return tier
