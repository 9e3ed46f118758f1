"""The ``cache_aware`` policy: predicted TTFT, bounded load, rendezvous ties, learning from outcomes."""

from __future__ import annotations

from collections import Counter

import pytest

from policies import (
    ClusterView,
    Outcome,
    PolicyDeps,
    PrefixIndex,
    ReplicaState,
    RequestFeatures,
    default_registry,
)
from policies.cache_aware_scores import erlang_c, work_factor
from policies.errors import NoReplicaError
from policies.hashing import chain_hashes
from policies.sessions import SessionTable

TPH = 64  # tokens per hash; with the default 0.1 ms/token one block of prefill is 6.4 ms


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def doc(name: str, n: int) -> tuple[int, ...]:
    return tuple(chain_hashes([f"{name}{i}".encode() for i in range(n)], 5))


def view(*loads: int, ids: list[str] | None = None) -> ClusterView:
    ids = ids or [f"r{i}" for i in range(len(loads))]
    return ClusterView(
        tuple(ReplicaState(rid, in_flight=x) for rid, x in zip(ids, loads, strict=True))
    )


def feat(hashes: tuple[int, ...], session: str | None = None, model: str = "m") -> RequestFeatures:
    return RequestFeatures(model, hashes, TPH, len(hashes) * TPH, 0, session)


@pytest.fixture
def deps() -> PolicyDeps:
    clock = FakeClock()
    return PolicyDeps(clock=clock, index=PrefixIndex(), sessions=SessionTable(clock=clock))


def build(deps: PolicyDeps | None, **params: object):
    return default_registry().build("cache_aware", params, deps)


def route(pol, req: RequestFeatures, v: ClusterView):
    d = pol.select(req, v)
    pol.on_dispatch(req, d, v)
    return d


# ---------------------------------------------------------------- scoring


def test_prefix_holder_wins_at_equal_load(deps: PolicyDeps) -> None:
    deps.index.insert("r2", doc("a", 50))
    d = build(deps).select(feat(doc("a", 60)), view(0, 0, 0, 0))
    assert d.replica == "r2"
    assert d.reason == "prefix-hit"
    assert d.predicted_cached_tokens == 50 * TPH
    assert d.scores["prefill_ms"] == pytest.approx(10 * TPH * 0.1)
    assert d.scores["matched_blocks"] == 50


def test_queue_model_charges_only_past_max_running(deps: PolicyDeps) -> None:
    pol = build(
        deps, max_running=4, avg_output_tokens=16, decode_ms_per_token=20, busy_ms_per_request=2
    )
    # Below 4 in flight only interference; past it each request ahead costs 16 * 20 / 4 = 80 ms.
    assert [pol.queue_ms(x) for x in (0, 2, 3, 4, 6)] == [0, 4, 6, 8 + 80, 12 + 240]
    assert pol.queue_ms(2, waiting=2) == 4 + 160  # the engine says it is queueing


def test_engine_reported_waiting_counts_as_queue(deps: PolicyDeps) -> None:
    deps.index.insert("r0", doc("w", 20))  # saves 128 ms
    pol = build(deps, load_slack=100)
    busy = ClusterView((ReplicaState("r0", running=3, waiting=3), ReplicaState("r1", in_flight=3)))
    d = pol.select(feat(doc("w", 20)), busy)
    assert d.replica == "r1" and d.reason == "load-fallback"
    assert pol.select(feat(doc("w", 20)), view(6, 3)).replica == "r0"  # same load, no queue


def test_queue_delay_is_traded_against_prefill_saved(deps: PolicyDeps) -> None:
    deps.index.insert("r1", doc("small", 10))  # saves 64 ms
    deps.index.insert("r2", doc("big", 100))  # saves 640 ms
    # Take the bound, interference and penalties out: a request beyond the 4 slots costs 80 ms.
    pol = build(deps, load_slack=100, max_running=4, avg_output_tokens=16, busy_ms_per_request=0,
                work_weight=0, evict_weight=0)  # fmt: skip
    small = pol.select(feat(doc("small", 100)), view(0, 6, 0, 0))  # 3 ahead: 240 ms > 64 saved
    assert small.replica != "r1" and small.reason == "load-fallback"
    big = pol.select(feat(doc("big", 100)), view(0, 0, 8, 0))  # 5 ahead: 400 ms < 640 saved
    assert big.replica == "r2" and big.reason == "prefix-hit"
    far = pol.select(feat(doc("big", 100)), view(0, 0, 14, 0))  # 11 ahead: 880 ms > 640 saved
    assert far.replica != "r2"


def test_bounded_load_guard_overrides_a_big_hit(deps: PolicyDeps) -> None:
    deps.index.insert("r0", doc("a", 500))
    pol = build(deps, load_factor=1.25, load_slack=1)
    d = pol.select(feat(doc("a", 500)), view(6, 1, 1, 1))  # limit 1.25 * 2.25 + 1 = 3.8
    assert d.replica != "r0"
    assert d.reason == "load-fallback"
    assert d.alternates[-1] == "r0"  # over the bound: last
    assert pol.select(feat(doc("a", 500)), view(2, 1, 1, 1)).replica == "r0"  # limit 2.56


def test_alternates_are_ordered_by_predicted_ttft(deps: PolicyDeps) -> None:
    d = build(deps, tie_ms=0, load_slack=100).select(feat(doc("x", 4)), view(0, 3, 1, 2))
    assert d.scores["queue_ms"] == 0
    assert d.candidates() == ("r0", "r2", "r3", "r1")


def test_a_hit_within_the_tie_window_goes_to_the_less_loaded(deps: PolicyDeps) -> None:
    deps.index.insert("r3", doc("q", 1))  # 6.4 ms saved, 4 ms of interference: a tie
    deps.index.insert("r3", doc("long", 10))  # 64 ms saved: no tie
    pol = build(deps)
    busy = view(0, 0, 0, 2)
    assert pol.select(feat(doc("q", 1) + doc("t", 3)), busy).replica != "r3"
    assert pol.select(feat(doc("q", 1) + doc("t", 3)), view(0, 0, 0, 0)).replica == "r3"
    assert pol.select(feat(doc("long", 10) + doc("t", 3)), busy).replica == "r3"
    assert build(deps, tie_ms=0).select(feat(doc("q", 1) + doc("t", 3)), busy).replica == "r3"


# ---------------------------------------------------------------- ties and spreading


def test_cold_prefixes_spread_evenly_and_gateways_agree(deps: PolicyDeps) -> None:
    a = build(deps)
    b = build(None)  # another gateway, its own empty state
    v = view(*[0] * 8)
    picks = Counter()
    for k in range(4000):
        req = feat(doc(f"c{k}-", 8), session=f"user{k}")
        da, db = a.select(req, v), b.select(req, v)
        assert da.replica == db.replica
        assert da.reason == "cold-rendezvous"
        picks[da.replica] += 1
    assert len(picks) == 8
    assert max(picks.values()) < 1.2 * 500 and min(picks.values()) > 0.8 * 500


def test_cold_rendezvous_is_stable_when_a_replica_leaves(deps: PolicyDeps) -> None:
    pol = build(deps)
    ids = [f"r{i}" for i in range(6)]
    reqs = [feat(doc(f"k{k}-", 2), session=f"k{k}") for k in range(600)]
    before = [pol.select(r, view(*[0] * 6, ids=ids)).replica for r in reqs]
    rest = [i for i in ids if i != "r4"]
    after = [pol.select(r, view(*[0] * 5, ids=rest)).replica for r in reqs]
    moved = [i for i, (x, y) in enumerate(zip(before, after, strict=True)) if x != y]
    assert moved == [i for i, x in enumerate(before) if x == "r4"]


def test_misses_do_not_pile_onto_one_replica_at_low_concurrency(deps: PolicyDeps) -> None:
    pol = build(deps)
    loads = [0] * 8
    for k in range(16):  # 16 concurrent cold requests, none finishes
        d = route(pol, feat(doc(f"m{k}-", 500), session=f"s{k}"), view(*loads))
        loads[int(d.replica[1:])] += 1
    assert max(loads) <= 3
    assert sum(1 for x in loads if x) >= 6


def test_a_hot_prefix_is_replicated_instead_of_herding(deps: PolicyDeps) -> None:
    pol = build(deps, load_factor=1.25, load_slack=1)
    loads = [0] * 4
    shared = doc("hot", 400)
    for k in range(40):  # one long shared document, many users, nothing completes
        d = route(pol, feat(shared + doc(f"u{k}-", 2), session=f"u{k}"), view(*loads))
        loads[int(d.replica[1:])] += 1
        assert max(loads) <= 1.25 * sum(loads) / 4 + 2
    assert len(deps.index.match(shared)) >= 3  # the document was copied, not herded onto one


# ---------------------------------------------------------------- sessions and dispatch


def test_conversation_turns_follow_the_cache(deps: PolicyDeps) -> None:
    pol = build(deps)
    first = route(pol, feat(doc("chat", 20), session="s1"), view(0, 0, 0, 0))
    assert first.reason == "cold-rendezvous"
    assert deps.sessions.peek("s1") == first.replica
    for turn in range(21, 25):
        deps.clock.t += 5.0  # type: ignore[attr-defined]  # the previous turn has answered
        d = route(pol, feat(doc("chat", turn * 2), session="s1"), view(1, 1, 1, 1))
        assert d.replica == first.replica
        assert d.reason == "session"
        assert d.predicted_cached_tokens == (turn * 2 - 2 if turn > 21 else 20) * TPH
    assert deps.index.match(doc("chat", 48)) == {first.replica: 48}


def test_session_binding_breaks_ties_when_the_index_forgot(deps: PolicyDeps) -> None:
    deps.sessions.bind("s9", "r3")
    d = build(deps).select(feat(doc("fresh", 5), session="s9"), view(0, 0, 0, 0))
    assert d.replica == "r3" and d.reason == "session"


def test_select_has_no_side_effects(deps: PolicyDeps) -> None:
    pol = build(deps)
    for _ in range(3):
        pol.select(feat(doc("z", 9), session="s"), view(0, 0))
    assert deps.index.stats()["total_blocks"] == 0
    assert len(deps.sessions) == 0


def test_index_forgets_evicted_prefixes_instead_of_chasing_them(deps: PolicyDeps) -> None:
    deps.index.set_capacity("r0", 100)
    pol = build(deps)
    old = doc("old", 60)
    deps.index.insert("r0", old)
    assert pol.select(feat(old), view(0, 0, 0)).replica == "r0"
    for k in range(3):  # r0 computes other prompts: its engine evicted the old one
        deps.index.insert("r0", doc(f"new{k}-", 60))
    assert deps.index.match(old) == {}
    d = pol.select(feat(old), view(0, 0, 0))
    assert d.reason == "cold-rendezvous"


# ---------------------------------------------------------------- outcomes


def test_shortfall_on_old_holdings_shrinks_the_learned_capacity(deps: PolicyDeps) -> None:
    pol = build(deps)
    for k in range(10):
        deps.index.insert("r0", doc(f"d{k}-", 50), now=0.0)
    deps.clock.t = 60.0  # type: ignore[attr-defined]
    req = feat(doc("d0-", 50))
    d = route(pol, req, view(0, 0))
    assert d.replica == "r0"
    deps.clock.t = 61.0  # type: ignore[attr-defined]
    outcome = Outcome(
        ok=True, cached_tokens=0, latency_s=1.0, predicted_cached_tokens=d.predicted_cached_tokens
    )
    pol.on_complete(req, "r0", outcome)
    assert deps.index.capacity("r0") == int(500 * 0.9)
    assert deps.index.blocks("r0") <= deps.index.capacity("r0")


def test_shortfall_on_a_prefix_still_being_computed_teaches_nothing(deps: PolicyDeps) -> None:
    pol = build(deps, wait_for_prefill=False)
    v = view(0, 0, 0, 0)
    shared = doc("new-doc", 100)
    first = feat(shared + doc("a", 1), session="a")
    second = feat(shared + doc("b", 1), session="b")
    d1 = route(pol, first, v)
    deps.clock.t = 0.5  # type: ignore[attr-defined]
    d2 = route(pol, second, v)  # the first one is still prefilling the document
    assert d2.replica == d1.replica and d2.predicted_cached_tokens == 0
    deps.clock.t = 3.0  # type: ignore[attr-defined]
    out = Outcome(ok=True, cached_tokens=0, latency_s=2.5, predicted_cached_tokens=100 * TPH)
    pol.on_complete(second, d2.replica, out)
    assert deps.index.capacity(d2.replica) == deps.index.default_capacity


@pytest.mark.parametrize("engine_block_tokens", [1, 4 * TPH])
def test_prefix_shorter_than_an_engine_block_is_not_taken_for_an_eviction(
    deps: PolicyDeps, engine_block_tokens: int
) -> None:
    """An engine with 4-hash blocks caches nothing of a 2-hash shared prefix (it reports 0)."""
    pol = build(deps, engine_block_tokens=engine_block_tokens)
    for k in range(10):
        deps.index.insert("r0", doc(f"d{k}-", 50), now=0.0)
    system = doc("sys", 2)
    deps.index.insert("r0", system, now=0.0)
    deps.clock.t = 60.0  # type: ignore[attr-defined]
    req = feat(system + doc("question", 1))
    d = route(pol, req, view(0))
    deps.clock.t = 61.0  # type: ignore[attr-defined]
    predicted = d.predicted_cached_tokens
    out = Outcome(ok=True, cached_tokens=0, latency_s=1.0, predicted_cached_tokens=predicted)
    pol.on_complete(req, "r0", out)
    if engine_block_tokens == 1:  # counted in hashes: a miss, taken for an eviction
        assert d.predicted_cached_tokens == 2 * TPH
        assert deps.index.capacity("r0") < deps.index.default_capacity
    else:  # counted in engine blocks: predicted 0 as reported, nothing learned
        assert d.predicted_cached_tokens == 0
        assert deps.index.capacity("r0") == deps.index.default_capacity


def test_engine_blocks_round_down_and_leave_the_last_token(deps: PolicyDeps) -> None:
    pol = build(deps, engine_block_tokens=2 * TPH)
    deps.index.insert("r0", doc("p", 5))
    assert pol.select(feat(doc("p", 7)), view(0)).predicted_cached_tokens == 4 * TPH
    whole = feat(doc("p", 4))  # all 4 hashes held: the engine still computes the last token
    assert pol.select(whole, view(0)).predicted_cached_tokens == 2 * TPH
    with pytest.raises(ValueError):
        build(deps, engine_block_tokens=0)


def test_learning_can_be_switched_off_and_needs_a_prediction(deps: PolicyDeps) -> None:
    deps.index.insert("r0", doc("d", 50))
    req = feat(doc("d", 50))
    build(deps, learn_capacity=False).on_complete(
        req, "r0", Outcome(ok=True, cached_tokens=0, predicted_cached_tokens=3200)
    )
    build(deps).on_complete(req, "r0", Outcome(ok=True, cached_tokens=0))
    assert deps.index.capacity("r0") == deps.index.default_capacity


def test_failure_before_first_token_forgets_what_was_not_cached(deps: PolicyDeps) -> None:
    pol = build(deps)
    deps.index.insert("r1", doc("f", 25))
    req = feat(doc("f", 30))
    d = route(pol, req, view(0, 0, 0))
    assert d.replica == "r1" and deps.index.match(req.prefix_hashes) == {"r1": 30}
    pol.on_complete(req, "r1", Outcome(ok=False, predicted_cached_tokens=d.predicted_cached_tokens))
    assert deps.index.match(req.prefix_hashes) == {"r1": 25}


def test_unknown_model_raises(deps: PolicyDeps) -> None:
    v = ClusterView((ReplicaState("r0", models=frozenset({"llama"})),))
    with pytest.raises(NoReplicaError):
        build(deps).select(feat(doc("a", 2), model="other"), v)


# ---------------------------------------------------------------- prefills in flight


def test_a_prefix_still_being_computed_is_predicted_cold_until_ready(deps: PolicyDeps) -> None:
    pol = build(deps, wait_for_prefill=False)
    shared = doc("doc", 100)  # 640 ms of prefill
    d1 = route(pol, feat(shared + doc("a", 1)), view(0, 0, 0, 0))
    deps.clock.t = 0.3  # type: ignore[attr-defined]
    d2 = pol.select(feat(shared + doc("b", 1)), view(1, 1, 1, 1))
    assert d2.replica == d1.replica  # a copy is coming there anyway: no second copy elsewhere
    assert d2.predicted_cached_tokens == 0
    deps.clock.t = 0.9  # type: ignore[attr-defined]  # 640 ms and the 25% + 10 ms margin
    d3 = pol.select(feat(shared + doc("c", 1)), view(1, 1, 1, 1))
    assert d3.replica == d1.replica and d3.predicted_cached_tokens == 100 * TPH


def test_a_follower_waits_for_the_prefill_in_flight_when_that_is_sooner(deps: PolicyDeps) -> None:
    pol = build(deps)
    shared = doc("doc", 100)  # 640 ms of prefill
    d1 = route(pol, feat(shared + doc("a", 1)), view(0, 0, 0, 0))
    ready_at = (d1.scores["ttft_ms"] + 10) / 1000  # the leader's predicted TTFT + the margin
    # right behind the leader, waiting (656 ms) loses to recomputing (646 ms): no hold
    now = pol.select(feat(shared + doc("b", 1)), view(1, 1, 1, 1))
    assert now.hold_s == 0 and now.predicted_cached_tokens == 0 and now.reason != "prefill-wait"
    deps.clock.t = 0.3  # type: ignore[attr-defined]
    d2 = route(pol, feat(shared + doc("b", 1)), view(1, 1, 1, 1))
    assert d2.replica == d1.replica and d2.reason == "prefill-wait"
    assert d2.hold_s == pytest.approx(ready_at - 0.3)
    assert d2.predicted_cached_tokens == 100 * TPH
    assert d2.scores["ttft_ms"] == pytest.approx(d2.hold_s * 1000 + TPH * 0.1 + 2)  # + 1 in flight
    assert d2.scores["queue_ms"] == pytest.approx(2)
    # the held follower computes one block: not a prefill a third request should wait for
    deps.clock.t = ready_at  # type: ignore[attr-defined]
    d3 = pol.select(feat(shared + doc("b", 1)), view(2, 1, 1, 1))
    assert d3.replica == d1.replica and d3.hold_s == 0 and d3.reason == "prefix-hit"
    assert d3.predicted_cached_tokens == 101 * TPH


def test_the_leaders_first_token_ends_the_wait_whatever_was_predicted(deps: PolicyDeps) -> None:
    pol = build(deps)
    shared = doc("doc", 100)  # 640 ms of prefill predicted
    leader = feat(shared + doc("a", 1))
    d1 = route(pol, leader, view(0, 0, 0, 0))
    deps.clock.t = 0.3  # type: ignore[attr-defined]
    follower = feat(shared + doc("b", 1))
    d2 = route(pol, follower, view(1, 1, 1, 1))
    assert d2.reason == "prefill-wait"
    assert pol.hold_left(follower, d1.replica) == pytest.approx(d2.hold_s)
    other = "r0" if d1.replica != "r0" else "r1"
    pol.on_first_token(leader, other)  # another replica's first token changes nothing
    assert pol.hold_left(follower, d1.replica) == pytest.approx(d2.hold_s)
    deps.clock.t = 0.4  # type: ignore[attr-defined]  # the engine was faster than predicted
    pol.on_first_token(leader, d1.replica)
    assert pol.hold_left(follower, d1.replica) <= 0
    d3 = pol.select(feat(shared + doc("c", 1)), view(2, 1, 1, 1))
    assert d3.replica == d1.replica and d3.hold_s == 0 and d3.reason == "prefix-hit"
    assert d3.predicted_cached_tokens == 100 * TPH


def test_a_finished_or_failed_request_ends_the_wait_for_its_prefill(deps: PolicyDeps) -> None:
    pol = build(deps)
    shared = doc("doc", 100)
    leader = feat(shared + doc("a", 1))
    d1 = route(pol, leader, view(0, 0, 0, 0))
    deps.clock.t = 0.3  # type: ignore[attr-defined]
    follower = feat(shared + doc("b", 1))
    assert pol.hold_left(follower, d1.replica) > 0
    pol.on_complete(leader, d1.replica, Outcome(ok=False, latency_s=0.3))  # died before a token
    assert pol.hold_left(follower, d1.replica) <= 0
    assert pol.hold_left(feat(doc("unknown", 3)), d1.replica) == 0


def test_a_burst_that_filled_the_holder_is_waited_for_as_long_as_it_runs(deps: PolicyDeps) -> None:
    """8 requests of 64 tokens (10 ms each) fill r0 at once: the next slot frees when they end,
    ~640 ms later, not after an average slot's 80 ms, so a 32-block prompt (205 ms) goes cold.
    (Copying by demand off: the burst keeps all 8 slots busy, which would copy the prefix.)"""
    pol = build(deps, max_running=8, decode_ms_per_token=10, avg_output_tokens=64,
                busy_ms_per_request=0, replicate_util=0)  # fmt: skip
    system = doc("sys", 32)
    burst = [RequestFeatures("m", system + doc(f"q{i}-", 1), TPH, 33 * TPH, 64, None, True)
             for i in range(8)]  # fmt: skip
    deps.index.insert("r0", system)
    for req in burst:
        d = pol.select(req, view(0, 0, 0, 0))
        assert d.replica == "r0"
        pol.on_dispatch(req, d, view(0, 0, 0, 0))
    deps.clock.t = 0.1  # type: ignore[attr-defined]
    assert pol.queue_ms(8, 0, "r0", 0.1) == pytest.approx(540 + 6.4, abs=1)
    assert pol.queue_ms(8) == pytest.approx(80)  # the average share (no replica named)
    nxt = RequestFeatures("m", system + doc("late", 1), TPH, 33 * TPH, 64, None, True)
    d = pol.select(nxt, view(8, 0, 0, 0))
    assert d.replica != "r0" and d.reason == "load-fallback"
    for req in burst:  # done: r0 is free again
        pol.on_complete(req, "r0", Outcome(ok=True, latency_s=0.65, ttft_s=0.01))
    deps.clock.t = 0.7  # type: ignore[attr-defined]
    assert pol.select(nxt, view(0, 0, 0, 0)).replica == "r0"


def test_a_spill_in_flight_keeps_the_holder_eligible_over_the_bound(deps: PolicyDeps) -> None:
    pol = build(deps, load_factor=1.0, load_slack=0, max_running=64)
    hot = doc("hot", 100)
    deps.index.insert("r0", hot)
    v = view(6, 1, 1, 1)  # r0 is over the bound: the first request spills, cold
    first = route(pol, feat(hot + doc("a", 1)), v)
    assert first.replica != "r0" and first.reason == "load-fallback"
    deps.clock.t = 0.1  # type: ignore[attr-defined]
    second = pol.select(feat(hot + doc("b", 1)), v)  # the copy is still being computed
    assert second.replica == "r0" and second.predicted_cached_tokens == 100 * TPH
    deps.clock.t = 1.0  # type: ignore[attr-defined]
    third = pol.select(feat(hot + doc("c", 1)), v)  # the copy is ready: the bound holds again
    assert third.replica == first.replica and third.reason == "prefix-hit"


def test_the_queue_model_learns_how_long_a_request_holds_its_slot(deps: PolicyDeps) -> None:
    pol = build(deps, max_running=4, avg_output_tokens=100, decode_ms_per_token=20,
                busy_ms_per_request=0, service_alpha=0.5)  # fmt: skip
    assert pol.queue_ms(4) == 500  # prior: 100 tokens * 20 ms / 4 slots
    req = RequestFeatures("m", doc("s", 2), TPH, 2 * TPH, 0, None, stream=True)
    for _ in range(20):  # the requests really hold a slot 0.4 s after their first token
        pol.on_complete(req, "r0", Outcome(ok=True, latency_s=0.5, ttft_s=0.1))
    assert pol.queue_ms(4) == pytest.approx(100, rel=0.01)
    unary = RequestFeatures("m", doc("s", 2), TPH, 2 * TPH, 0, None, stream=False)
    pol.on_complete(unary, "r0", Outcome(ok=True, latency_s=0.5, ttft_s=0.5))  # no token timing
    assert pol.queue_ms(4) == pytest.approx(100, rel=0.01)


def test_cold_prefixes_prefer_the_smaller_cache_footprint(deps: PolicyDeps) -> None:
    pol = build(deps)
    deps.index.insert("r0", doc("big", 300))
    deps.index.insert("r1", doc("mid", 200))
    deps.index.insert("r2", doc("small", 100))
    d = pol.select(feat(doc("new", 10)), view(0, 0, 0, 2))  # r3 is empty but busier
    assert d.replica == "r2" and d.reason == "cold-rendezvous"


def test_a_follower_does_not_delay_the_prefix_an_earlier_request_computes(deps: PolicyDeps) -> None:
    pol = build(deps, wait_for_prefill=False)
    shared = doc("sys", 50)  # 320 ms of prefill
    d1 = route(pol, feat(shared + doc("q1-", 1)), view(0, 0, 0, 0))
    deps.clock.t = 0.1  # type: ignore[attr-defined]
    d2 = route(pol, feat(shared + doc("q2-", 1)), view(1, 1, 1, 1))  # recomputes the prefix
    assert d2.replica == d1.replica and d2.predicted_cached_tokens == 0
    deps.clock.t = 0.5  # type: ignore[attr-defined]  # the first is done, the second is not
    d3 = pol.select(feat(shared + doc("q3-", 1)), view(1, 1, 1, 1))
    assert d3.replica == d1.replica and d3.predicted_cached_tokens == 50 * TPH


def test_a_queueing_replica_above_its_fair_share_spills_before_the_slack(
    deps: PolicyDeps,
) -> None:
    deps.index.insert("r0", doc("hot", 100))
    # textbook limit: 1.25 * 4.75 + 4 = 9.9; one request ahead costs only 16 * 20 / 8 = 40 ms
    pol = build(deps, max_running=8, load_slack=4, avg_output_tokens=16, spill_when_full=True)
    d = pol.select(feat(doc("hot", 100)), view(9, 4, 3, 3))  # one already waits for a slot
    assert d.replica != "r0" and d.reason == "load-fallback"
    assert pol.select(feat(doc("hot", 100)), view(8, 4, 3, 3)).replica == "r0"  # full, no queue
    assert pol.select(feat(doc("hot", 100)), view(9, 9, 9, 9)).replica == "r0"  # all queue: fair
    lax = build(deps, max_running=8, load_slack=4, avg_output_tokens=16)  # the default
    assert lax.select(feat(doc("hot", 100)), view(9, 4, 3, 3)).replica == "r0"


def test_a_follower_joins_the_replica_computing_its_prefix_despite_more_load(
    deps: PolicyDeps,
) -> None:
    pol = build(deps, wait_for_prefill=False)
    shared = doc("sys2", 50)
    d1 = route(pol, feat(shared + doc("q1-", 1)), view(0, 0, 0, 0))
    loads = [0, 0, 0, 0]
    loads[int(d1.replica[1:])] = 2  # 4 ms of interference: within the tie window
    deps.clock.t = 0.1  # type: ignore[attr-defined]
    d2 = pol.select(feat(shared + doc("q2-", 1)), view(*loads))
    assert d2.replica == d1.replica and d2.predicted_cached_tokens == 0


# ---------------------------------------------------------------- the price of recomputing


def test_erlang_c_and_the_work_factor() -> None:
    assert erlang_c(1, 0.6) == pytest.approx(0.6)  # one server: an arrival waits while it is busy
    assert erlang_c(2, 0.5) == pytest.approx(1 / 3)
    assert erlang_c(3, 0.0) == 0.0 and erlang_c(3, 1.2) == 1.0
    factors = [work_factor(3, r / 10) for r in range(1, 10)]
    assert factors == sorted(factors) and factors[0] < 0.01 and factors[-1] > 5
    assert work_factor(8, 0.4) < 0.05 < 5 < work_factor(8, 0.95)  # capped at 95%: finite
    assert work_factor(3, 2.0) == work_factor(3, 0.95)


def test_a_saturated_cluster_keeps_a_prefix_on_its_holder_rather_than_recompute_it(
    deps: PolicyDeps,
) -> None:
    deps.index.insert("r0", doc("grp", 20))  # 1,280 tokens: 128 ms of prefill saved on r0
    # 3 slots; a request ahead costs 16 * 20 / 3 = 107 ms: r0's queue (4 ahead) is 427 ms.
    params = dict(max_running=3, avg_output_tokens=16, busy_ms_per_request=0, load_slack=100,
                  evict_weight=0)  # fmt: skip
    greedy = build(deps, work_weight=0, **params)
    assert greedy.select(feat(doc("grp", 21)), view(6, 2, 2, 2)).reason == "load-fallback"
    pol = build(deps, **params)  # every slot busy: a recompute delays whoever comes next
    d = pol.select(feat(doc("grp", 21)), view(6, 2, 2, 2))
    assert d.replica == "r0" and d.reason == "prefix-hit"
    assert d.scores["ttft_ms"] == pytest.approx(427 + 6.4, abs=1)  # the penalty is not a TTFT
    assert d.scores["penalty_ms"] > 0
    quiet = pol.select(feat(doc("grp", 21)), view(6, 0, 0, 0))  # a third busy: as greedy
    assert quiet.replica != "r0" and quiet.reason == "load-fallback"


def test_a_recompute_that_would_evict_another_prefix_costs_that_prefix_too(
    deps: PolicyDeps,
) -> None:
    deps.index.insert("r0", doc("grp", 20))  # 128 ms saved on r0
    for rid, blocks in (("r1", 40), ("r2", 40)):
        deps.index.set_capacity(rid, blocks)
    deps.index.insert("r1", doc("other", 40))  # r1's cache is full; r2's is empty
    params = dict(max_running=3, avg_output_tokens=16, busy_ms_per_request=0, load_slack=100,
                  work_weight=0)  # fmt: skip
    pol = build(deps, **params)
    # r0: 2 ahead = 213 ms; a cold copy costs 134 ms where there is room, 269 ms on r1 (it
    # pushes out 21 of r1's blocks, 134 ms to compute again).
    d = pol.select(feat(doc("grp", 21)), view(4, 1, 1))
    assert d.replica == "r2" and d.reason == "load-fallback"
    deps.index.insert("r2", doc("more", 40))  # now r2 is full too
    d = pol.select(feat(doc("grp", 21)), view(4, 1, 1))
    assert d.replica == "r0" and d.reason == "prefix-hit"
    blind = build(deps, **params, evict_weight=0)
    assert blind.select(feat(doc("grp", 21)), view(4, 1, 1)).replica != "r0"
