"""PrefixDemand (pure) and how cache_aware uses it: a prefix asked for faster than its holders'
slots can serve gets another copy before the holder queues; held requests queue behind."""

from __future__ import annotations

from dataclasses import replace

import pytest

from policies import ClusterView, PolicyDeps, PrefixIndex, ReplicaState, RequestFeatures
from policies.demand import PrefixDemand
from policies.sessions import SessionTable

from .test_policies_cache_aware import TPH, FakeClock, build, doc, route, view


def test_rate_needs_enough_arrivals_and_counts_a_burst_as_its_requests() -> None:
    d = PrefixDemand(depth=8, min_arrivals=4)
    for t in (0.0, 0.0, 0.0):
        d.record(7, t)
    assert d.rate(7, 0.0) == 0.0  # three arrivals prove nothing
    d.record(7, 0.0)
    assert d.rate(7, 0.0, span_s=0.5) == pytest.approx(8.0)  # 4 over at least 0.5 s
    assert d.rate(7, 2.0) == pytest.approx(2.0)  # the same 4, two seconds on
    # Little's law: 4 at once, each holding a slot 0.5 s, keep 4 slots busy
    assert d.needs_copy(7, 0.0, holders=1, service_s=0.5, slots=3, util=1.0)
    assert not d.needs_copy(7, 0.0, holders=1, service_s=0.5, slots=4, util=1.0)
    assert not d.needs_copy(7, 0.0, holders=2, service_s=0.5, slots=3, util=1.0)
    assert not d.needs_copy(8, 0.0, holders=1, service_s=0.5, slots=1, util=1.0)  # unknown


def test_a_steady_stream_is_measured_over_the_recorded_window_and_keys_are_bounded() -> None:
    d = PrefixDemand(depth=4, max_keys=2, min_arrivals=2)
    for i in range(10):
        d.record(1, i * 0.1)  # 10 per second; only the last 4 are kept
    assert d.rate(1, 0.9) == pytest.approx(4 / 0.3)
    d.record(2, 1.0)
    d.record(3, 1.0)  # a third prefix: the least recently asked for (1) goes
    assert len(d) == 2 and d.rate(1, 1.0) == 0.0
    with pytest.raises(ValueError):
        PrefixDemand(depth=4, min_arrivals=5)


@pytest.fixture
def deps() -> PolicyDeps:
    clock = FakeClock()
    return PolicyDeps(clock=clock, index=PrefixIndex(), sessions=SessionTable(clock=clock))


def _hot(i: int) -> RequestFeatures:
    return RequestFeatures("m", doc("hot", 100) + doc(f"q{i}-", 1), TPH, 101 * TPH, 32, None, True)


def _place(pol, deps: PolicyDeps, n: int, gap: float = 0.05) -> list[str]:
    deps.index.insert("r0", doc("hot", 100))  # 640 ms of prefill anywhere else
    placed: list[str] = []
    reqs = [_hot(i) for i in range(n)]  # kept alive: in flight, each is known by its id
    for i, req in enumerate(reqs):
        deps.clock.t = i * gap  # type: ignore[attr-defined]
        placed.append(route(pol, req, view(*[placed.count(f"r{k}") for k in range(4)])).replica)
    return placed


def test_a_prefix_asked_for_faster_than_its_holder_serves_gets_a_copy_first(deps) -> None:
    """3 slots a replica, 32 output tokens at 10 ms: a request holds a slot ~0.33 s.  A document
    asked for 20 times a second keeps ~7 slots busy: once four arrivals show it, the next request
    goes to another replica, before the holder's queue is longer than a cold prefill elsewhere
    (which is when the greedy pick would leave it, with a backlog built).  Without warms (the
    default sends the copy as a request of its own; see the last test) that request is the copy."""
    params = dict(max_running=3, decode_ms_per_token=10, busy_ms_per_request=0, warm_copies=False)
    placed = _place(build(deps, **params), deps, 5)
    assert placed == ["r0"] * 4 + [placed[4]] and placed[4] != "r0"
    deps2 = PolicyDeps(clock=FakeClock(), index=PrefixIndex())
    assert _place(build(deps2, **params, replicate_util=0), deps2, 5) == ["r0"] * 5


def test_a_copy_comes_once_a_quarter_of_the_holders_slots_are_busy_with_the_prefix() -> None:
    """2.5 requests a second, each holding a slot ~0.32 s, keep about 0.8 of the holder's three
    slots busy (one request in flight at a time: no queue): under ``replicate_util`` 0.5 it
    stays there; by default (0.25) the fifth request, the first to see four arrivals, asks for
    the copy while the other replicas are idle."""

    def placed(**extra) -> list[str]:
        deps = PolicyDeps(clock=FakeClock(), index=PrefixIndex())
        pol = build(deps, max_running=3, decode_ms_per_token=10, busy_ms_per_request=0,
                    warm_copies=False, **extra)  # fmt: skip
        deps.index.insert("r0", doc("hot", 100))
        reqs = [_hot(i) for i in range(6)]
        out = []
        for i, req in enumerate(reqs):
            deps.clock.t = i * 0.4  # type: ignore[attr-defined]
            out.append(route(pol, req, view(1, 0, 0, 0)).replica)
        return out

    default = placed()
    assert default[:4] == ["r0"] * 4 and default[4] != "r0"
    assert placed(replicate_util=0.5) == ["r0"] * 6


def test_a_prefix_its_holders_can_serve_stays_put(deps) -> None:
    pol = build(deps, max_running=8, decode_ms_per_token=10, busy_ms_per_request=0)
    deps.index.insert("r0", doc("hot", 100))
    for i in range(12):  # one every 0.5 s: ~0.7 of a slot busy
        deps.clock.t = i * 0.5  # type: ignore[attr-defined]
        assert route(pol, _hot(i), view(0, 0, 0, 0)).replica == "r0"


def test_requests_held_at_the_gateway_do_not_queue_ahead_of_one_sent_now(deps) -> None:
    pol = build(deps, max_running=2, busy_ms_per_request=0)
    deps.index.insert("r0", doc("d", 20))
    req = RequestFeatures("m", doc("d", 20) + doc("x", 1), TPH, 21 * TPH, 0, None)
    busy = ClusterView((ReplicaState("r0", in_flight=3), ReplicaState("r1", in_flight=0)))
    held = ClusterView((ReplicaState("r0", in_flight=3, held=3), ReplicaState("r1", in_flight=0)))
    assert pol.select(req, busy).replica == "r1"  # 3 in flight on 2 slots: cold elsewhere wins
    d = pol.select(req, held)  # all 3 wait at the gateway: the engine has both slots free
    assert d.replica == "r0" and d.scores["queue_ms"] == pytest.approx(0, abs=1e-9)


def test_a_follower_behind_a_long_queue_is_sent_at_once_and_finds_the_prefix(deps) -> None:
    """Its wait for a slot there runs while the leader's prefill does: no hold when the queue
    (counted at half) is longer than what is left of the prefill."""
    pol = build(deps, max_running=1, decode_ms_per_token=10, avg_output_tokens=100,
                busy_ms_per_request=0)  # fmt: skip
    shared = doc("doc", 50)  # 320 ms of prefill
    lead = RequestFeatures("m", shared + doc("a", 1), TPH, 51 * TPH, 100, None)
    d1 = route(pol, lead, view(0, 0))
    deps.clock.t = 0.2  # type: ignore[attr-defined]  # ~130 ms of the prefill left
    follower = RequestFeatures("m", shared + doc("b", 1), TPH, 51 * TPH, 100, None)
    loads = [0, 0]
    loads[int(d1.replica[1])] = 1
    other = 1 - int(d1.replica[1])
    loads[other] = 3  # the other replica has a long queue: staying is best
    d2 = pol.select(follower, view(*loads))
    assert d2.replica == d1.replica and d2.predicted_cached_tokens == 50 * TPH
    # the leader's 1-second decode is ahead of it: the prefix is done long before its slot
    assert d2.hold_s == 0 and d2.scores["queue_ms"] > 600


def test_a_prefix_that_needs_a_copy_stays_when_every_other_replica_is_over_the_bound(deps) -> None:
    """The holders are set aside for a copy only if a replica without the prefix is within the
    bound: the least loaded replica is never set aside (here the holder), so a decision exists."""
    pol = build(deps, max_running=3, decode_ms_per_token=10, busy_ms_per_request=0)
    deps.index.insert("r0", doc("hot", 100))
    reqs = [_hot(i) for i in range(5)]
    for i, req in enumerate(reqs[:4]):  # four arrivals make it hot
        deps.clock.t = i * 0.05  # type: ignore[attr-defined]
        assert route(pol, req, view(0, 0, 0, 0)).replica == "r0"
    d = pol.select(reqs[4], view(1, 30, 30, 30))  # the others far over the bound
    assert d.replica == "r0" and d.predicted_cached_tokens == 100 * TPH
    assert d.warm is None  # nor is a copy sent there


def test_with_warm_copies_the_request_stays_and_a_prefill_of_its_own_makes_the_copy(deps) -> None:
    """``warm_copies``: the request that shows the prefix needs a copy stays with its holder (no
    client pays the cold prefill) and the decision carries the copy as ``warm``; each warm
    dispatched adds a holder, and a follower sent to a copy in flight holds for it."""
    pol = build(deps, max_running=3, decode_ms_per_token=10, busy_ms_per_request=0)  # warms: default
    deps.index.insert("r0", doc("hot", 100))
    reqs = [_hot(i) for i in range(7)]
    decisions = []
    for i, req in enumerate(reqs):
        deps.clock.t = i * 0.05  # type: ignore[attr-defined]
        v = view(*[sum(d.replica == f"r{k}" for d in decisions) for k in range(4)])
        d = route(pol, req, v)
        decisions.append(d)
        if d.warm is not None:
            warm_req = replace(req, max_tokens=1, session_key=None, stream=False)
            pol.on_dispatch(warm_req, d.warm, v)
    warms = [d.warm.replica for d in decisions if d.warm is not None]
    assert decisions[4].warm is not None and not any(d.warm for d in decisions[:4])
    # 20 a second keep ~7 slots busy: each warm adds a holder, until every replica has it
    assert sorted(warms) == ["r1", "r2", "r3"]
    assert [d.replica for d in decisions[:5]] == ["r0"] * 5  # nobody paid the cold prefill
    copy = decisions[4].warm
    assert copy.reason == "warm-copy" and not copy.alternates
    assert copy.scores["top_blocks"] == 0  # a warm is no demand of its own
    assert deps.index.match(doc("hot", 100)).get(copy.replica) == 100  # recorded as computing
    # Once the copies are computed, a request finds the prefix there instead of r0's queue
    deps.clock.t = 1.0  # type: ignore[attr-defined]
    later = pol.select(_hot(99), view(7, 0, 0, 0))
    assert later.replica != "r0" and later.predicted_cached_tokens >= 100 * TPH
    # without the flag the fifth request makes the first copy itself, cold, on the same replica
    deps2 = PolicyDeps(clock=FakeClock(), index=PrefixIndex())
    placed = _place(build(deps2, max_running=3, decode_ms_per_token=10, busy_ms_per_request=0,
                          warm_copies=False), deps2, 5)  # fmt: skip
    assert placed[4] == copy.replica


def test_a_copy_that_can_pull_the_prefix_is_made_by_a_warm_that_pulls(deps) -> None:
    """With ``migrate`` a copy pulls the document from its holder (a few ms, not a cold
    prefill), and a warm makes it: the requests stay with the holder until the copy exists, and
    the warm carries the pull."""
    pol = build(deps, max_running=3, decode_ms_per_token=10, busy_ms_per_request=0, migrate=True)
    deps.index.insert("r0", doc("hot", 100))
    reqs = [_hot(i) for i in range(5)]
    decisions = []
    for i, req in enumerate(reqs):
        deps.clock.t = i * 0.05  # type: ignore[attr-defined]
        decisions.append(route(pol, req, view(*[sum(d.replica == f"r{k}" for d in decisions) for k in range(4)])))
    warms = [d.warm for d in decisions if d.warm]
    assert warms and all(w.pull_from not in (None, w.replica) and w.pull_tokens >= 99 * TPH
                         for w in warms)  # fmt: skip
    assert all(w.reason == "warm-copy" and not w.alternates for w in warms)
    for d in decisions:
        if d.warm:  # the request that showed the demand stays with a holder, and pulls nothing
            assert d.predicted_cached_tokens >= 100 * TPH and d.pull_from is None
            assert d.replica != d.warm.replica
    # without warm copies the request itself pulls, as before
    deps2 = PolicyDeps(clock=FakeClock(), index=PrefixIndex())
    pol2 = build(deps2, max_running=3, decode_ms_per_token=10, busy_ms_per_request=0, migrate=True,
                 warm_copies=False)  # fmt: skip
    deps2.index.insert("r0", doc("hot", 100))
    plain = []
    for i, req in enumerate(reqs):
        deps2.clock.t = i * 0.05  # type: ignore[attr-defined]
        plain.append(route(pol2, req, view(*[sum(d.replica == f"r{k}" for d in plain) for k in range(4)])))
    moved = [d for d in plain if d.replica != "r0"]
    assert moved and all(d.pull_from not in (None, d.replica) for d in moved)
    assert not any(d.warm for d in plain)
