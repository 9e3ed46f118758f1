"""PrefixDemand (pure) and how cache_aware uses it: a prefix asked for faster than its holders'
slots can serve gets another copy before the holder queues; held requests queue behind."""

from __future__ import annotations

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
    (which is when the greedy pick would leave it, with a backlog built)."""
    params = dict(max_running=3, decode_ms_per_token=10, busy_ms_per_request=0)
    placed = _place(build(deps, **params), deps, 5)
    assert placed == ["r0"] * 4 + [placed[4]] and placed[4] != "r0"
    deps2 = PolicyDeps(clock=FakeClock(), index=PrefixIndex())
    assert _place(build(deps2, **params, replicate_util=0), deps2, 5) == ["r0"] * 5


def test_a_copy_comes_once_half_the_holders_slots_are_busy_with_the_prefix(deps) -> None:
    """Six requests a second, each holding a slot ~0.33 s, keep about two of the holder's three
    slots busy: under ``replicate_util`` 1 it stays there (and queues at every burst); by default
    (0.5) the fifth request makes the copy, while the other replicas are idle."""
    params = dict(max_running=3, decode_ms_per_token=10, busy_ms_per_request=0)
    placed = _place(build(deps, **params), deps, 5, gap=0.16)
    assert placed[:4] == ["r0"] * 4 and placed[4] != "r0"
    deps2 = PolicyDeps(clock=FakeClock(), index=PrefixIndex())
    assert _place(build(deps2, **params, replicate_util=1), deps2, 5, gap=0.16) == ["r0"] * 5


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
