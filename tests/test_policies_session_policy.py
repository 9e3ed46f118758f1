"""The ``session`` policy: stickiness, bounded-load spill, rendezvous stability and spread."""

from __future__ import annotations

from collections import Counter

import pytest

from policies import ClusterView, PolicyDeps, ReplicaState, RequestFeatures, default_registry
from policies.errors import NoReplicaError
from policies.sessions import SessionTable


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def view(*loads: int, ids: list[str] | None = None, **overrides: dict) -> ClusterView:
    ids = ids or [f"r{i}" for i in range(len(loads))]
    return ClusterView(
        tuple(
            ReplicaState(rid, in_flight=load, **overrides.get(rid, {}))
            for rid, load in zip(ids, loads, strict=True)
        )
    )


def feat(
    session: str | None = None, hashes: tuple[int, ...] = (), model: str = "m"
) -> RequestFeatures:
    return RequestFeatures(model=model, prefix_hashes=hashes, session_key=session)


@pytest.fixture
def deps() -> PolicyDeps:
    clock = FakeClock()
    return PolicyDeps(clock=clock, sessions=SessionTable(ttl_s=60, clock=clock))


def build(deps: PolicyDeps, **params: object):
    return default_registry().build("session", params, deps)


def route(policy, req: RequestFeatures, v: ClusterView) -> str:
    d = policy.select(req, v)
    policy.on_dispatch(req, d, v)
    return d.replica


def test_a_session_sticks_to_its_replica(deps: PolicyDeps) -> None:
    pol = build(deps)
    first = route(pol, feat("alice"), view(0, 0, 0, 0))
    # Loads change but stay within the bound: still the same replica.
    assert all(route(pol, feat("alice"), view(1, 1, 1, 1)) == first for _ in range(5))
    d = pol.select(feat("alice"), view(1, 1, 1, 1))
    assert d.reason == "session"
    assert sorted(d.candidates()) == ["r0", "r1", "r2", "r3"]


def test_overloaded_bound_replica_spills_and_rebinds(deps: PolicyDeps) -> None:
    pol = build(deps, load_factor=1.25, load_slack=1)
    home = route(pol, feat("bob"), view(0, 0, 0, 0))
    loads = [0, 0, 0, 0]
    loads[int(home[1])] = 10  # mean 2.5, limit 4.125
    d = pol.select(feat("bob"), view(*loads))
    assert d.replica != home
    assert d.reason == "session-moved"
    assert d.alternates[-1] == home  # over the bound: last resort
    pol.on_dispatch(feat("bob"), d, view(*loads))
    assert deps.sessions.peek("bob") == d.replica


def test_unhealthy_bound_replica_moves_the_session(deps: PolicyDeps) -> None:
    pol = build(deps)
    home = route(pol, feat("carol"), view(0, 0, 0))
    v = view(0, 0, 0, **{home: {"healthy": False}})
    d = pol.select(feat("carol"), v)
    assert d.replica != home and home not in d.candidates()


def test_within_the_bound_stickiness_beats_load(deps: PolicyDeps) -> None:
    pol = build(deps, load_factor=1.25, load_slack=1)
    home = route(pol, feat("dan"), view(0, 0, 0, 0))
    loads = [2, 2, 2, 2]
    loads[int(home[1])] = 3  # limit = 1.25 * 2.25 + 1 = 3.8
    assert pol.select(feat("dan"), view(*loads)).replica == home


def test_rendezvous_removal_moves_only_the_removed_replicas_keys(deps: PolicyDeps) -> None:
    pol = build(deps)
    ids = [f"r{i}" for i in range(5)]
    before = {
        k: pol.select(feat(f"k{k}"), view(0, 0, 0, 0, 0, ids=ids)).replica for k in range(500)
    }
    survivors = [i for i in ids if i != "r2"]
    after = {
        k: pol.select(feat(f"k{k}"), view(0, 0, 0, 0, ids=survivors)).replica for k in range(500)
    }
    moved = {k for k in before if before[k] != after[k]}
    assert moved == {k for k in before if before[k] == "r2"}
    assert 50 < len(moved) < 150  # about a fifth


def test_cold_keys_spread_roughly_uniformly(deps: PolicyDeps) -> None:
    pol = build(deps)
    counts = Counter(
        pol.select(feat(f"user{k}"), view(0, 0, 0, 0, 0, 0, 0, 0)).replica for k in range(4000)
    )
    assert set(counts) == {f"r{i}" for i in range(8)}
    assert max(counts.values()) < 1.2 * 500 and min(counts.values()) > 0.8 * 500


def test_new_sessions_skip_replicas_over_the_bound(deps: PolicyDeps) -> None:
    pol = build(deps, load_factor=1.0, load_slack=0)
    v = view(9, 0, 0, 0)  # mean 2.25: r0 is over the bound
    picks = Counter(pol.select(feat(f"s{k}"), v).replica for k in range(300))
    assert "r0" not in picks
    assert len(picks) == 3


def test_without_a_session_key_the_first_prefix_hash_is_the_key(deps: PolicyDeps) -> None:
    pol = build(deps)
    a = pol.select(feat(None, (111, 222)), view(0, 0, 0, 0, 0, 0))
    b = pol.select(feat(None, (111, 999)), view(0, 0, 0, 0, 0, 0))
    assert a.replica == b.replica and a.reason == "rendezvous"
    pol.on_dispatch(feat(None, (111, 222)), a, view(0, 0, 0, 0, 0, 0))
    assert len(deps.sessions) == 0  # nothing to bind


def test_no_key_at_all_goes_to_the_least_loaded(deps: PolicyDeps) -> None:
    pol = build(deps)
    d = pol.select(feat(None), view(3, 1, 2))
    assert d.replica == "r1" and d.alternates == ("r2", "r0")


def test_independent_instances_agree(deps: PolicyDeps) -> None:
    a = build(deps)
    b = default_registry().build("session", {}, None)
    v = view(0, 0, 0, 0, 0)
    assert all(
        a.select(feat(f"x{k}"), v).replica == b.select(feat(f"x{k}"), v).replica for k in range(100)
    )


def test_unknown_model_raises(deps: PolicyDeps) -> None:
    pol = build(deps)
    v = ClusterView((ReplicaState("r0", models=frozenset({"llama"})),))
    with pytest.raises(NoReplicaError):
        pol.select(feat("s", model="gpt"), v)
