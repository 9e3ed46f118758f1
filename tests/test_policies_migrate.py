"""``cache_aware`` with migration: spill away from an overloaded holder, pull its prefix along."""

from __future__ import annotations

import pytest

from policies import ClusterView, PolicyDeps, PrefixIndex, ReplicaState, RequestFeatures
from policies import default_registry as registry
from policies.errors import PolicyConfigError
from policies.hashing import chain_hashes
from policies.sessions import SessionTable

TPH = 64
PF = 0.1  # ms per prefill token (the default)
# slot = 16 * 20 / 4 = 80 ms per request ahead once 4 are running
# The TTFT model alone: no spill of a full replica, no price on recomputing or evicting (the load
# bound and the penalties are tested in the cache_aware tests).
QUEUE = dict(max_running=4, avg_output_tokens=16, decode_ms_per_token=20, busy_ms_per_request=2,
             spill_when_full=False, work_weight=0, evict_weight=0)


def doc(name: str, n: int) -> tuple[int, ...]:
    return tuple(chain_hashes([f"{name}{i}".encode() for i in range(n)], 5))


def view(*loads: int) -> ClusterView:
    return ClusterView(tuple(ReplicaState(f"r{i}", in_flight=x) for i, x in enumerate(loads)))


def feat(hashes: tuple[int, ...]) -> RequestFeatures:
    return RequestFeatures("m", hashes, TPH, len(hashes) * TPH)


def build(**params: object):
    clock = lambda: 0.0  # noqa: E731
    deps = PolicyDeps(clock=clock, index=PrefixIndex(), sessions=SessionTable(clock=clock))
    deps.index.insert("r0", doc("a", 100))  # r0 holds 6400 tokens of the document
    return registry().build("cache_aware", {**QUEUE, **params}, deps), deps


def test_default_is_unchanged_and_never_hints():
    pol, _ = build(load_slack=100)  # no bound: only the TTFT model decides
    d = pol.select(feat(doc("a", 101)), view(12, 0, 0))  # r0: 9 ahead = 720 ms; others 640 ms
    assert d.replica != "r0" and d.reason == "load-fallback"
    assert d.pull_from is None and d.pull_tokens == 0 and d.predicted_cached_tokens == 0


def test_spill_pulls_from_the_overloaded_holder():
    pol, _ = build(migrate=True, load_slack=100)
    req = feat(doc("a", 101))
    d = pol.select(req, view(12, 0, 3))
    assert d.replica == "r1" and d.reason == "migrate"
    assert d.pull_from == "r0" and d.pull_tokens == 100 * TPH
    assert d.predicted_cached_tokens == 100 * TPH
    pull_ms = 2.0 + 100 * TPH * 0.01
    assert d.scores["pull_ms"] == pytest.approx(pull_ms)
    assert d.scores["prefill_ms"] == pytest.approx(1 * TPH * PF + pull_ms)
    assert d.scores["ttft_ms"] == pytest.approx(d.scores["prefill_ms"])  # r1 is idle
    assert d.alternates[0] == "r2"  # also a cheap pull, but 3 requests busier


def linked(loads: tuple[int, ...], links: tuple[float, ...]) -> ClusterView:
    """Replicas whose engines advertise a pull cost (ms per token; < 0: none)."""
    return ClusterView(tuple(ReplicaState(f"r{i}", in_flight=x, pull_ms_per_token=ms)
                             for i, (x, ms) in enumerate(zip(loads, links, strict=True))))  # fmt: skip


def test_auto_pulls_only_between_replicas_that_advertise_pulls():
    pol, _ = build(load_slack=100)  # migrate=auto, the default
    req = feat(doc("a", 101))
    d = pol.select(req, linked((12, 0, 3), (0.01, 0.01, 0.01)))
    assert d.replica == "r1" and d.reason == "migrate" and d.pull_from == "r0"
    assert d.scores["pull_ms"] == pytest.approx(2.0 + 100 * TPH * 0.01)
    # r1 advertises nothing: r2 (3 busier, but it can pull) gets the pull
    d = pol.select(req, linked((12, 0, 3), (0.01, -1, 0.01)))
    assert d.replica == "r2" and d.pull_from == "r0"
    # the holder cannot serve a pull: nobody pulls, the spill recomputes
    d = pol.select(req, linked((12, 0, 3), (-1, 0.01, 0.01)))
    assert d.pull_from is None and d.reason == "load-fallback"


def test_a_pull_is_priced_at_the_slower_end_of_its_link():
    pol, _ = build(load_slack=100)
    d = pol.select(feat(doc("a", 101)), linked((12, 0), (0.03, 0.01)))  # the holder's side: 0.03
    assert d.replica == "r1" and d.scores["pull_ms"] == pytest.approx(2.0 + 100 * TPH * 0.03)


@pytest.mark.parametrize("value", [False, "false", "off"])
def test_migrate_false_never_pulls_even_when_advertised(value):
    pol, _ = build(load_slack=100, migrate=value)
    d = pol.select(feat(doc("a", 101)), linked((12, 0, 0), (0.01, 0.01, 0.01)))
    assert d.pull_from is None and d.reason == "load-fallback"


def test_migrate_true_prices_an_advertised_link_and_defaults_the_rest():
    pol, _ = build(load_slack=100, migrate=True, transfer_ms_per_token=0.02)
    d = pol.select(feat(doc("a", 101)), linked((12, 0), (-1, 0.005)))  # holder: default 0.02
    assert d.replica == "r1" and d.scores["pull_ms"] == pytest.approx(2.0 + 100 * TPH * 0.02)
    d = pol.select(feat(doc("a", 101)), linked((12, 0), (0.005, 0.001)))
    assert d.scores["pull_ms"] == pytest.approx(2.0 + 100 * TPH * 0.005)


def test_transfer_cost_makes_a_non_holder_win_where_recompute_would_lose():
    # r0 has 5 requests ahead (400 ms of queue); recomputing 6400 tokens costs 640 ms elsewhere
    off, _ = build(load_slack=100)
    on, _ = build(migrate=True, load_slack=100)
    req = feat(doc("a", 101))
    assert off.select(req, view(8, 0)).replica == "r0"  # 400 + 16 ms < 640 ms
    d = on.select(req, view(8, 0))
    assert d.replica == "r1" and d.pull_from == "r0"  # 6.4 + 66 ms beats r0's queue


def test_holder_keeps_the_request_when_it_is_not_overloaded():
    pol, _ = build(migrate=True)
    d = pol.select(feat(doc("a", 101)), view(1, 0, 0))
    assert d.replica == "r0" and d.reason == "prefix-hit" and d.pull_from is None


def test_no_hint_when_transfer_is_not_cheaper_or_the_gap_is_small():
    pricey, _ = build(migrate=True, load_slack=100, transfer_ms_per_token=PF)
    d = pricey.select(feat(doc("a", 101)), view(12, 0, 0))
    assert d.pull_from is None and d.reason == "load-fallback"
    pol, deps = build(migrate=True, load_slack=100, migrate_min_tokens=3 * TPH, tie_ms=1)
    deps.index.insert("r1", doc("a", 98))  # r1 is 2 blocks short of r0: not worth a pull
    d = pol.select(feat(doc("a", 101)), view(12, 0, 0))
    assert d.replica == "r1" and d.pull_from is None and d.predicted_cached_tokens == 98 * TPH


def test_partial_holder_pulls_only_the_difference_from_the_least_loaded_holder():
    pol, deps = build(migrate=True, load_slack=100)
    deps.index.insert("r2", doc("a", 100))  # a second full holder, less loaded than r0
    deps.index.insert("r1", doc("a", 30))
    d = pol.select(feat(doc("a", 101)), view(14, 0, 12))
    assert d.replica == "r1" and d.pull_from == "r2" and d.pull_tokens == 70 * TPH
    assert d.predicted_cached_tokens == 100 * TPH


def test_dispatch_records_the_pulled_prefix_on_the_chosen_replica():
    pol, deps = build(migrate=True, load_slack=100)
    req = feat(doc("a", 101))
    v = view(12, 0, 0)
    d = pol.select(req, v)
    pol.on_dispatch(req, d, v)
    assert deps.index.match(req.prefix_hashes)[d.replica] == 101
    again = pol.select(req, view(12, 1, 0))
    assert again.replica == d.replica and again.pull_from is None  # it holds it now


@pytest.mark.parametrize(
    "bad", [{"migrate_min_tokens": 0}, {"transfer_ms_per_token": -1}, {"migrate": "maybe"}]
)
def test_bad_migration_params_fail_at_build(bad):
    with pytest.raises(PolicyConfigError):
        build(**bad)


def test_a_pull_must_win_by_more_than_a_tie_and_the_margin():
    # r0: 1 request ahead (80 ms) + 4 x 2 ms busy + 6.4 ms prefill = 94.4 ms; r1 pulling: 72.4 ms.
    pol, _ = build(migrate=True)  # no margin: 22 ms saved is more than a tie
    d = pol.select(feat(doc("a", 101)), view(4, 0))
    assert d.replica == "r1" and d.pull_from == "r0" and d.reason == "migrate"
    # r1 pulling at 2 + 6400 x 0.013 + 6.4 = 91.6 ms, 2.8 ms faster: a tie, r0 keeps it
    tied, _ = build(migrate=True, transfer_ms_per_token=0.013)
    d = tied.select(feat(doc("a", 101)), view(4, 0))
    assert d.replica == "r0" and d.pull_from is None and d.reason == "prefix-hit"
    wide, _ = build(migrate=True, pull_margin_ms=100)  # a copy must save 100 ms more than a tie
    d = wide.select(feat(doc("a", 101)), view(4, 0))
    assert d.replica == "r0" and d.pull_from is None and d.reason == "prefix-hit"
    d = wide.select(feat(doc("a", 101)), view(6, 0))  # 3 ahead: 252.4 ms > 72.4 + 5 + 100
    assert d.replica == "r1" and d.pull_from == "r0"


def test_a_move_made_anyway_pulls_without_the_margin():
    # Transfer nearly as dear as prefill: r1 pulling 2 + 6400 x 0.09 + 6.4 = 584.4 ms, cold
    # 646.4 ms; r0: 8 ahead (640 ms) + 11 x 2 ms busy + 6.4 ms = 668.4 ms.  The pull is not 100 ms
    # better than staying, but the cold move beats staying by more than a tie: the request
    # leaves r0 either way, and with the pull it computes 1 block instead of 101.
    pol, _ = build(migrate=True, load_slack=100, transfer_ms_per_token=0.09)
    d = pol.select(feat(doc("a", 101)), view(11, 0))
    assert d.replica == "r1" and d.pull_from == "r0" and d.reason == "migrate"
    assert d.predicted_cached_tokens == 100 * TPH
    off, _ = build(load_slack=100, transfer_ms_per_token=0.09)
    d = off.select(feat(doc("a", 101)), view(11, 0))
    assert d.replica == "r1" and d.reason == "load-fallback" and d.predicted_cached_tokens == 0


def test_a_pull_learns_what_it_really_took():
    from policies.types import Outcome

    pol, deps = build(migrate=True, load_slack=100, service_alpha=0.5)

    def pull(name: str):  # a fresh document on r0 only, asked for while r0 is overloaded
        deps.index.insert("r0", doc(name, 100))
        req = feat(doc(name, 101))
        d = pol.select(req, view(12, 0, 3))
        assert d.pull_from == "r0" and d.replica == "r1"
        return req, d

    req, d = pull("a")
    base = d.scores["pull_ms"]
    pol.on_dispatch(req, d, view(12, 0, 3))
    slow = (d.scores["ttft_ms"] + 30) / 1000  # the pull took 30 ms more than predicted
    pol.on_complete(req, d.replica, Outcome(True, 6464, 6400, slow + 0.1, slow, 6400))
    req, d = pull("b")
    assert d.scores["pull_ms"] == pytest.approx(base + 15)  # half way (alpha 0.5)
    # a request that did not pull teaches nothing; a wild outlier counts as 50 ms at most
    pol.on_complete(feat(doc("z", 3)), "r2", Outcome(True, 192, 0, 9.0, 9.0, 0))
    pol.on_dispatch(req, d, view(12, 0, 3))
    late = (d.scores["ttft_ms"] + 5000) / 1000
    pol.on_complete(req, d.replica, Outcome(True, 6464, 6400, late, late, 6400))
    _, d = pull("c")
    assert d.scores["pull_ms"] == pytest.approx(base + 15 + 0.5 * (50 - 15))
