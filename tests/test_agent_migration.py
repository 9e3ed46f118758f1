"""Migration logic (pure): pull-vs-recompute with EWMA estimators, hot-prefix replication, versions.

Property tests are seeded random loops (many cases each), so a failure names its seed.
"""

from __future__ import annotations

import itertools
import random

import pytest

from worker_agent.migration import (
    BlockVersions,
    HotPrefixes,
    PullPlanner,
    RateEstimator,
    Version,
    plan_replication,
    pull_decision,
    rendezvous,
)

# -- (a) on-demand pull ------------------------------------------------------------------------


def test_rate_estimator_prior_then_ewma_of_amounts_over_durations():
    est = RateEstimator(100.0, alpha=0.5)
    assert est.rate == 100.0 and est.samples == 0
    est.observe(1000, 2.0)  # first sample replaces the prior
    assert est.rate == pytest.approx(500.0)
    est.observe(3000, 2.0)  # (0.5*1000 + 0.5*3000) / (0.5*2 + 0.5*2)
    assert est.rate == pytest.approx(1000.0)
    est.observe(0, 1.0)  # carries no information
    est.observe(10, 0.0)
    est.observe(float("nan"), 1.0)
    assert est.samples == 2 and est.rate == pytest.approx(1000.0)


def test_rate_estimator_weights_big_transfers_and_takes_the_overhead_off():
    est = RateEstimator(1.0, alpha=0.5, overhead_s=0.01)
    est.observe(1_000_000_000, 0.11)  # 1 GB in 0.1 s of transfer -> 10 GB/s
    assert est.rate == pytest.approx(1e10)
    est.observe(1000, 0.0100001)  # a tiny transfer: nearly all overhead; min_busy bounds it
    assert 1e9 < est.rate < 2e10
    with pytest.raises(ValueError):
        RateEstimator(0.0)
    with pytest.raises(ValueError):
        RateEstimator(1.0, alpha=0.0)


def test_rate_estimator_converges_to_a_new_steady_rate():
    est = RateEstimator(1.0, alpha=0.3)
    for _ in range(10):
        est.observe(100, 1.0)
    for _ in range(40):
        est.observe(400, 1.0)
    assert est.rate == pytest.approx(400.0, rel=1e-4)


def test_pull_decision_compares_transfer_with_recompute():
    # 10 blocks of 1 MB at 1 GB/s + 5 ms overhead = 15 ms; 160 tokens at 4000 tok/s = 40 ms
    d = pull_decision(10, 1_000_000, 160, 1e9, 4000.0, overhead_s=0.005)
    assert d.pull and d.bytes == 10_000_000
    assert d.transfer_s == pytest.approx(0.015) and d.recompute_s == pytest.approx(0.04)
    assert d.saved_s == pytest.approx(0.025)
    slow = pull_decision(10, 1_000_000, 160, 1e8, 4000.0, overhead_s=0.005)  # 105 ms
    assert not slow.pull and slow.saved_s < 0
    assert not pull_decision(10, 1_000_000, 160, 1e9, 4000.0, 0.005, margin=3.0).pull
    assert not pull_decision(0, 1_000_000, 160, 1e9, 4000.0).pull


def test_planner_learns_from_observations_and_changes_its_mind():
    planner = PullPlanner(
        1 << 20, bandwidth_prior=10e9, prefill_prior=10_000.0, overhead_s=0.002
    )
    assert planner.decide(64, 1024).pull  # prior: 67 MB at 10 GB/s (9 ms) vs 102 ms
    for _ in range(30):  # the network turns out to be 100x slower than assumed
        planner.observe_transfer(64 << 20, 0.002 + (64 << 20) / 1e8)
    assert planner.bandwidth.rate == pytest.approx(1e8, rel=1e-3)
    assert not planner.decide(64, 1024).pull  # 673 ms of transfer vs 102 ms
    for _ in range(30):  # ... and the engine 20x slower at prefill than assumed
        planner.observe_prefill(1024, 2.048)
    assert planner.decide(64, 1024).pull  # 673 ms vs 2048 ms


# -- (b) hot prefixes --------------------------------------------------------------------------


def test_hot_prefixes_decay_by_half_life():
    hot = HotPrefixes(half_life_s=10.0)
    for t in range(4):
        hot.hit("a", float(t))
    hot.hit("b", 0.0)
    assert hot.rate("a", 3.0) == pytest.approx(1 + 2**-0.1 + 2**-0.2 + 2**-0.3)
    assert hot.rate("a", 13.0) == pytest.approx(hot.rate("a", 3.0) / 2)
    assert hot.rate("zzz", 0.0) == 0.0
    assert [p for p, _ in hot.hottest(2, 3.0)] == ["a", "b"]
    assert hot.prune(100.0, below=0.01) == 2 and len(hot) == 0


def test_plan_copies_hot_prefixes_to_k_nodes_and_leaves_cold_ones():
    nodes = ["n0", "n1", "n2", "n3"]
    holders = {"hot": {"n0"}, "warm": {"n1", "n2"}, "cold": {"n3"}}
    rates = {"hot": 50.0, "warm": 5.0, "cold": 0.1}
    plan = plan_replication(holders, rates, nodes, k=3, min_rate=1.0)
    after = plan.holders_after(holders)
    assert len(after["hot"]) == 3 and len(after["warm"]) == 3 and after["cold"] == {"n3"}
    assert all(c.src in holders[c.prefix] for c in plan.copies)  # sources hold it already
    assert [c.prefix for c in plan.copies][:2] == ["hot", "hot"]  # hottest first
    # the destinations follow the prefix's rendezvous order
    expected = [n for n in rendezvous("hot", nodes) if n != "n0"][:2]
    assert [c.dst for c in plan.copies if c.prefix == "hot"] == expected
    assert plan.lost == () and plan.short == ()


def test_plan_reports_lost_and_short_and_respects_budgets():
    holders = {"a": {"dead"}, "b": {"n0"}, "c": {"n0"}}
    rates = {"a": 9.0, "b": 8.0, "c": 7.0}
    plan = plan_replication(
        holders, rates, ["n0", "n1"], k=2, sizes={"b": 3, "c": 3}, budgets={"n1": 4}
    )
    assert plan.lost == ("a",)
    assert [(c.prefix, c.dst, c.blocks) for c in plan.copies] == [("b", "n1", 3)]
    assert plan.short == ("c",)  # n1 has 1 block of budget left
    with pytest.raises(ValueError):
        plan_replication({}, {}, ["n0"], k=0)


def _random_case(rng: random.Random):
    nodes = [f"n{i}" for i in range(rng.randint(1, 7))]
    prefixes = [f"p{i}" for i in range(rng.randint(0, 12))]
    holders = {p: set(rng.sample(nodes, rng.randint(1, len(nodes)))) for p in prefixes}
    rates = {p: rng.choice([0.0, 0.5, 2.0, 10.0, 100.0]) for p in prefixes}
    return nodes, holders, rates


def test_property_replication_reaches_k_and_survives_any_single_failure():
    for seed in range(300):
        rng = random.Random(seed)
        nodes, holders, rates = _random_case(rng)
        alive = rng.sample(nodes, rng.randint(1, len(nodes)))  # the others died
        k = rng.randint(1, 4)
        plan = plan_replication(holders, rates, alive, k=k, min_rate=1.0)
        after = plan.holders_after(holders)
        hot = [p for p, r in rates.items() if r >= 1.0]
        assert set(plan.lost) == {p for p in hot if not holders[p] & set(alive)}
        for p in set(hot) - set(plan.lost):  # unbounded budgets: never short
            assert len(after[p] & set(alive)) >= min(k, len(alive))
        for c in plan.copies:
            assert c.src in holders[c.prefix] and c.src in alive and c.dst in alive
            assert c.dst not in holders[c.prefix] and rates[c.prefix] >= 1.0
        assert len({(c.prefix, c.dst) for c in plan.copies}) == len(plan.copies)  # no duplicates
        if k >= 2 and len(alive) >= 2:  # any one more node dies: no hot prefix is lost
            for dead in alive:
                assert all(after[p] & set(alive) - {dead} for p in hot if p not in plan.lost)
        # idempotent: planning again on the result copies nothing
        assert plan_replication(after, rates, alive, k=k, min_rate=1.0).copies == ()


def test_property_budgets_are_never_exceeded():
    for seed in range(200):
        rng = random.Random(1000 + seed)
        nodes, holders, rates = _random_case(rng)
        sizes = {p: rng.randint(1, 5) for p in holders}
        budgets = {n: rng.randint(0, 8) for n in nodes}
        plan = plan_replication(holders, rates, nodes, k=3, sizes=sizes, budgets=budgets)
        received = {n: 0 for n in nodes}
        for c in plan.copies:
            received[c.dst] += c.blocks
            assert c.blocks == sizes[c.prefix]
        assert all(received[n] <= budgets[n] for n in nodes)
        after = plan.holders_after(holders)
        for p in plan.short:
            assert len(after[p]) < min(3, len(nodes))


def test_planners_agree_and_spread_sources():
    nodes = [f"n{i}" for i in range(6)]
    holders = {f"p{i}": {"n0", "n1"} for i in range(20)}
    rates = {p: 5.0 for p in holders}
    a = plan_replication(holders, rates, nodes, k=3)
    b = plan_replication(dict(reversed(list(holders.items()))), rates, list(reversed(nodes)), k=3)
    assert sorted(map(repr, a.copies)) == sorted(map(repr, b.copies))  # independent planners agree
    srcs = [c.src for c in a.copies]
    assert abs(srcs.count("n0") - srcs.count("n1")) <= 1  # both holders serve copies
    dsts = [c.dst for c in a.copies]
    assert len(set(dsts)) == 4 and max(map(dsts.count, set(dsts))) <= 10  # spread over n2..n5


# -- versions ----------------------------------------------------------------------------------


def test_versions_bump_offer_and_stale():
    a, b = BlockVersions("a"), BlockVersions("b")
    v1 = a.bump(7)
    assert v1 == Version(1, "a")
    assert b.offer(7, v1) and not b.offer(7, v1)  # applied once
    v2 = b.bump(7)
    assert v2 == Version(2, "b") and v2 > v1
    assert not b.offer(7, v1)  # a stale copy never overwrites a newer block
    assert a.stale(b.versions) == [7] and b.stale(a.versions) == []
    assert Version(3, "a") < Version(3, "b")  # equal counters: the writer id decides


def _random_versions(rng: random.Random, name: str) -> BlockVersions:
    bv = BlockVersions(name)
    for _ in range(rng.randint(0, 15)):
        bv.versions[rng.randrange(8)] = Version(rng.randint(1, 6), rng.choice("xyz"))
    return bv


def _merged(*maps: BlockVersions) -> dict[int, Version]:
    out = BlockVersions("m")
    for m in maps:
        out.merge(m.versions)
    return out.versions


def test_property_merge_is_a_semilattice_and_highest_wins():
    for seed in range(200):
        rng = random.Random(5000 + seed)
        a, b, c = (_random_versions(rng, n) for n in "abc")
        assert _merged(a, b) == _merged(b, a)  # commutative
        assert _merged(_merged_bv(a, b), c) == _merged(a, _merged_bv(b, c))  # associative
        assert _merged(a, a) == a.versions  # idempotent
        m = _merged(a, b, c)
        for key in set(a.versions) | set(b.versions) | set(c.versions):
            assert m[key] == max(x.versions[key] for x in (a, b, c) if key in x.versions)


def _merged_bv(*maps: BlockVersions) -> BlockVersions:
    return BlockVersions("m", _merged(*maps))


def test_property_random_gossip_converges_and_never_goes_back():
    for seed in range(100):
        rng = random.Random(9000 + seed)
        nodes = [BlockVersions(f"n{i}") for i in range(rng.randint(2, 5))]
        history = {id(n): {} for n in nodes}
        for _ in range(rng.randint(5, 60)):
            node = rng.choice(nodes)
            if rng.random() < 0.3:
                node.bump(rng.randrange(6))  # a local rewrite
            else:
                node.merge(rng.choice(nodes).versions)  # gossip from a random peer
            for n in nodes:  # monotonic: no node's version of a block ever decreases
                seen = history[id(n)]
                for k, v in n.versions.items():
                    assert seen.get(k, v) <= v
                    seen[k] = v
        top = _merged(*nodes)
        for a, b in itertools.product(nodes, nodes):  # one full exchange round: everyone agrees
            a.merge(b.versions)
        assert all(n.versions == top for n in nodes)
