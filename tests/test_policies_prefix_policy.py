"""The ``prefix`` policy: longest match over threshold, imbalance fallback, spreading cold prefixes."""

from __future__ import annotations

from collections import Counter

import pytest

from policies import (
    ClusterView,
    PolicyDeps,
    PrefixIndex,
    ReplicaState,
    RequestFeatures,
    default_registry,
)
from policies.errors import NoReplicaError
from policies.hashing import chain_hashes


def chain(*parts: str) -> tuple[int, ...]:
    return tuple(chain_hashes([p.encode() for p in parts], 11))


def doc(name: str, n: int) -> tuple[int, ...]:
    return chain(*[f"{name}{i}" for i in range(n)])


def view(*loads: int) -> ClusterView:
    return ClusterView(tuple(ReplicaState(f"r{i}", in_flight=x) for i, x in enumerate(loads)))


def feat(hashes: tuple[int, ...], session: str | None = None) -> RequestFeatures:
    return RequestFeatures("m", hashes, 64, len(hashes) * 64, 0, session)


@pytest.fixture
def deps() -> PolicyDeps:
    return PolicyDeps(clock=lambda: 0.0, index=PrefixIndex())


def build(deps: PolicyDeps, **params: object):
    return default_registry().build("prefix", params, deps)


def test_goes_to_the_replica_with_the_longest_match(deps: PolicyDeps) -> None:
    deps.index.insert("r1", doc("a", 10))
    deps.index.insert("r2", doc("a", 4))
    pol = build(deps)
    d = pol.select(feat(doc("a", 12)), view(0, 1, 0, 0))
    assert d.replica == "r1"
    assert d.reason == "prefix-hit"
    assert d.predicted_cached_tokens == 10 * 64
    assert d.alternates[0] == "r2"  # next longest match
    assert set(d.candidates()) == {"r0", "r1", "r2", "r3"}


def test_below_the_threshold_goes_least_loaded(deps: PolicyDeps) -> None:
    deps.index.insert("r1", doc("a", 2))
    pol = build(deps, cache_threshold=0.5)
    d = pol.select(feat(doc("a", 10)), view(2, 1, 0, 2))
    assert d.replica == "r2"
    assert d.predicted_cached_tokens == 0
    assert d.reason == "cold-rendezvous"


def test_imbalanced_cluster_goes_least_loaded_even_on_a_hit(deps: PolicyDeps) -> None:
    deps.index.insert("r0", doc("a", 10))
    pol = build(deps, balance_abs_threshold=8, balance_rel_threshold=1.5)
    d = pol.select(feat(doc("a", 10)), view(20, 5, 3, 9))
    assert d.replica == "r2" and d.reason == "load-fallback"
    # Balanced (difference within the absolute threshold): the hit wins.
    assert pol.select(feat(doc("a", 10)), view(6, 5, 3, 5)).replica == "r0"


def test_hit_replica_over_the_load_bound_is_passed_over(deps: PolicyDeps) -> None:
    deps.index.insert("r0", doc("a", 10))
    pol = build(deps, load_factor=1.25, load_slack=1, balance_abs_threshold=64)
    d = pol.select(feat(doc("a", 10)), view(8, 1, 1, 1))  # limit = 1.25 * 2.75 + 1 = 4.4
    assert d.replica != "r0" and d.reason == "load-fallback"


def test_cold_prefixes_spread_at_low_concurrency(deps: PolicyDeps) -> None:
    pol = build(deps)
    counts = Counter()
    for k in range(2000):
        req = feat(doc(f"q{k}-", 4))
        d = pol.select(req, view(0, 0, 0, 0))
        counts[d.replica] += 1
    assert len(counts) == 4
    assert max(counts.values()) < 1.25 * 500


def test_on_dispatch_records_the_chain_so_the_next_turn_hits(deps: PolicyDeps) -> None:
    pol = build(deps)
    v = view(0, 0, 0, 0)
    first = feat(doc("conv", 6))
    d1 = pol.select(first, v)
    pol.on_dispatch(first, d1, v)
    assert deps.index.match(first.prefix_hashes) == {d1.replica: 6}
    d2 = pol.select(feat(doc("conv", 8)), view(1, 1, 1, 1))
    assert d2.replica == d1.replica and d2.reason == "prefix-hit"


def test_equal_matches_prefer_the_less_loaded(deps: PolicyDeps) -> None:
    for r in ("r1", "r2"):
        deps.index.insert(r, doc("a", 5))
    pol = build(deps)
    assert pol.select(feat(doc("a", 5)), view(0, 3, 1, 0)).replica == "r2"


def test_empty_prompt_and_unknown_model(deps: PolicyDeps) -> None:
    pol = build(deps)
    assert pol.select(feat(()), view(2, 0, 1)).replica == "r1"
    v = ClusterView((ReplicaState("r0", models=frozenset({"x"})),))
    with pytest.raises(NoReplicaError):
        pol.select(feat(doc("a", 2)), v)
