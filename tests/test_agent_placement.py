"""Pure placement planner: LRU/demotion/promotion order, capacity, counters (no torch needed)."""

from __future__ import annotations

import random

import pytest

from worker_agent.errors import CapacityError
from worker_agent.placement import Placement, Step, StepKind

TAKE, MOVE, DROP, PLACE = StepKind.TAKE, StepKind.MOVE, StepKind.DROP, StepKind.PLACE


class Shadow:
    """Applies steps to a model of the physical tiers and checks capacity after each one."""

    def __init__(self, p: Placement) -> None:
        self.p = p
        self.tiers: list[dict[int, int]] = [{} for _ in p.capacities]
        self.staged: dict[int, int] = {}

    def apply(self, steps: list[Step], new: dict[int, int]) -> None:
        self.staged.update(new)
        for kind, key, src, dst in steps:
            if kind is TAKE:
                self.staged[key] = self.tiers[src].pop(key)
            elif kind is MOVE:
                self.tiers[dst][key] = self.tiers[src].pop(key)
            elif kind is DROP:
                del self.tiers[src][key]
            else:
                self.tiers[dst][key] = self.staged.pop(key)
            for t, held in enumerate(self.tiers):
                used = sum(self.p.charge(t, n) for n in held.values())
                assert used <= self.p.capacities[t], f"tier {t} over capacity after {kind}"
        assert not self.staged

    def check(self) -> None:
        for t, held in enumerate(self.tiers):
            assert set(held) == set(self.p.keys(t))


def test_lru_demotes_oldest_then_drops_at_the_bottom():
    p = Placement([20, 20])
    assert p.plan_put(1, 10) == [Step(PLACE, 1, None, 0)]
    p.plan_put(2, 10)
    assert p.plan_put(3, 10) == [Step(MOVE, 1, 0, 1), Step(PLACE, 3, None, 0)]
    p.plan_put(4, 10)  # demotes 2
    assert p.keys(0) == [3, 4] and p.keys(1) == [1, 2]
    # tier 1 full: demoting 3 first drops tier 1's LRU (1); bottom-up order
    assert p.plan_put(5, 10) == [Step(DROP, 1, 1), Step(MOVE, 3, 0, 1), Step(PLACE, 5, None, 0)]
    s = p.stats
    assert (s.tiers[0].demotions, s.tiers[1].evictions, s.stored) == (3, 1, 5)


def test_hit_promotes_to_top_and_demotes_lru():
    p = Placement([20, 20, 40])
    for k in range(1, 6):
        p.plan_put(k, 10)
    # tiers: 0=[4,5] 1=[2,3] 2=[1]
    tier, steps = p.plan_get(1)
    assert tier == 2
    assert steps == [
        Step(TAKE, 1, 2),
        Step(MOVE, 2, 1, 2),
        Step(MOVE, 4, 0, 1),
        Step(PLACE, 1, None, 0),
    ]
    assert (p.keys(0), p.keys(1), p.keys(2)) == ([5, 1], [3, 4], [2])
    assert p.plan_get(5) == (0, [])  # top-tier hit: touch only
    assert p.keys(0) == [1, 5]
    assert p.plan_get(99) == (None, [])
    s = p.stats
    assert (s.tiers[2].hits, s.tiers[2].promotions, s.tiers[0].hits, s.misses) == (1, 1, 1, 1)
    assert p.hits_of(1) == 1 and p.hottest(1) in ([1], [5])


def test_touch_changes_victim():
    p = Placement([30, 100])
    for k in (1, 2, 3):
        p.plan_put(k, 10)
    p.touch(1)
    assert p.plan_put(4, 10) == [Step(MOVE, 2, 0, 1), Step(PLACE, 4, None, 0)]


def test_scan_window_protects_hot_blocks():
    p = Placement([30, 100], scan=2)
    for k in (1, 2, 3):
        p.plan_put(k, 10)
    p.plan_get(1)  # hits: 1 -> 1, and 1 is now MRU
    p.touch(2)
    p.touch(3)
    p.touch(1)
    p.touch(2)  # LRU order: 3, 1, 2 ; window of 2 = (3, 1): 3 has fewer hits
    assert p.plan_put(4, 10)[0] == Step(MOVE, 3, 0, 1)
    p.touch(1)
    p.touch(4)  # LRU order: 2, 1, 4 with hits 0, 1, 0 -> 2
    assert p.plan_put(5, 10)[0] == Step(MOVE, 2, 0, 1)


def test_oversized_blocks_skip_tiers_or_are_rejected():
    p = Placement([10, 100], overheads=[0, 8])
    assert p.plan_put(1, 50) == [Step(PLACE, 1, None, 1)]
    assert p.stats.tiers[1].bytes == 58
    assert p.plan_get(1) == (1, [])  # cannot be promoted: stays put, still a hit
    with pytest.raises(CapacityError):
        p.plan_put(2, 93)
    assert p.stats.rejected == 1 and 2 not in p


def test_explicit_move_and_remove():
    p = Placement([20, 20])
    p.plan_put(1, 10)
    p.plan_put(2, 10)
    assert p.plan_move(1, 1) == [Step(TAKE, 1, 0), Step(PLACE, 1, None, 1)]
    assert p.stats.tiers[0].demotions == 1
    assert p.plan_move(1, 0) == [Step(TAKE, 1, 1), Step(PLACE, 1, None, 0)]
    assert p.remove(2) == 0 and p.remove(2) is None
    assert p.forget(1) == 0 and len(p) == 0
    assert (p.stats.removed, p.stats.lost) == (1, 1)


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_counters_and_capacity(seed):
    rng = random.Random(seed)
    caps = [rng.choice([0, 64, 200]), rng.choice([100, 300]), rng.choice([0, 500])]
    p = Placement(caps, overheads=[0, 0, 8], scan=rng.choice([1, 3]))
    shadow = Shadow(p)
    for _ in range(1500):
        key = rng.randrange(60)
        op = rng.random()
        if op < 0.45:
            n = rng.choice([8, 16, 32, 64, 120])
            try:
                steps = p.plan_put(key, n)
            except CapacityError:
                continue
            shadow.apply(steps, {} if not steps else {key: n})
        elif op < 0.85:
            _, steps = p.plan_get(key)
            shadow.apply(steps, {})
        elif op < 0.93 and key in p:
            dst = rng.randrange(3)
            if p.fits(dst, p.size_of(key)):
                shadow.apply(p.plan_move(key, dst), {})
        else:
            tier = p.remove(key)
            if tier is not None:
                del shadow.tiers[tier][key]
        shadow.check()
        s = p.stats
        assert [(c.blocks, c.bytes) for c in s.tiers] == p.recount()
        assert all(c.bytes <= cap for c, cap in zip(s.tiers, caps, strict=True))
        evicted = sum(c.evictions for c in s.tiers)
        assert len(p) == s.stored - evicted - s.removed - s.lost
