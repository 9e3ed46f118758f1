"""Pure pieces of the shared state: backoff, link state, codec, the policy wrapper, accounting."""

from __future__ import annotations

import pytest

from gateway.config import ReplicaConfig
from gateway.replicas import ReplicaPool
from gateway.state import (
    Backoff,
    Event,
    MemoryStore,
    SharedPolicy,
    StateSync,
    StoreLink,
    SyncSettings,
    check_store_url,
    make_store,
)
from gateway.state.events import decode, encode, format_id, pack_hashes, parse_id, unpack_hashes
from policies import PolicyDeps, default_registry
from policies.types import ClusterView, Decision, ReplicaState, RequestFeatures


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_backoff_grows_exponentially_to_the_cap_with_bounded_jitter():
    b = Backoff(base_s=0.1, cap_s=1.0, jitter=0.5)
    assert b.delay(0) == 0.0
    assert [b.delay(n, 1.0) for n in (1, 2, 3, 4, 5, 50)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert b.delay(3, 0.0) == pytest.approx(0.2)  # jitter takes off at most half
    assert Backoff(jitter=0.0).delay(2, 0.0) == Backoff(jitter=0.0).delay(2, 1.0)
    with pytest.raises(ValueError):
        Backoff(base_s=2.0, cap_s=1.0)


def test_store_link_schedules_probes_and_reports_transitions():
    clock = FakeClock()
    link = StoreLink(Backoff(base_s=0.1, cap_s=0.4, jitter=0.0), clock, rng=lambda: 0.5)
    assert not link.up and link.probe_in() == 0.0  # unknown until it answers
    assert link.succeeded() is True and link.up and link.down_for() == 0.0
    assert link.succeeded() is False
    assert link.failed("boom") is True and not link.up and link.last_error == "boom"
    assert link.probe_in() == pytest.approx(0.1)
    clock.t += 0.05
    assert link.probe_in() == pytest.approx(0.05) and link.down_for() == pytest.approx(0.05)
    assert link.failed("again") is False
    assert link.probe_in() == pytest.approx(0.2)
    link.failed("x")
    link.failed("x")
    assert link.probe_in() == pytest.approx(0.4)  # capped
    assert link.succeeded() is True and link.failures == 0 and link.transitions == 3


def test_event_codec_round_trips_and_rejects_garbage():
    e = Event("10.0.0.1:8000", (0, 1, 2**64 - 1), "user:ü", "gw", "abc", 7, 1_700_000_000_123_456)
    assert decode(encode(e)) == e
    no_session = Event("r", (), None, "gw", "n", 1, 2)
    empty_session = Event("r", (5,), "", "gw", "n", 1, 2)
    assert decode(encode(no_session)) == no_session and decode(encode(empty_session)) == empty_session
    assert unpack_hashes(pack_hashes((5, 6))) == (5, 6) and len(pack_hashes((5, 6))) == 16
    with pytest.raises(OverflowError):
        pack_hashes((2**64,))
    blob = encode(e)
    for bad in (b"", blob[:10], b"\x02" + blob[1:], blob[:-3], blob[: len(blob) - 24 - 3]):
        with pytest.raises(ValueError):
            decode(bad)
    assert parse_id("17-3") == (17, 3) and parse_id(b"5") == (5, 0) and format_id(4, 2) == "4-2"
    assert parse_id("10-0") > parse_id("9-99")


def test_store_urls_are_checked_and_an_empty_url_means_memory():
    check_store_url("")
    check_store_url("redis://h:6379/0")
    with pytest.raises(ValueError):
        check_store_url("http://h:6379")
    assert isinstance(make_store(""), MemoryStore)
    assert make_store("redis://127.0.0.1:1/0").backend == "redis"


class _Spy:
    name = "spy"
    extra = 42

    def __init__(self) -> None:
        self.calls: list[str] = []

    def select(self, req, view):
        self.calls.append("select")
        return Decision("r2", ("r1",), "because", 64)

    def on_dispatch(self, req, decision, view):
        self.calls.append("dispatch")

    def on_complete(self, req, replica_id, outcome):
        self.calls.append("complete")


class _Recorder:
    def __init__(self) -> None:
        self.records: list[tuple] = []

    def record(self, replica, hashes, session):
        self.records.append((replica, hashes, session))


def test_shared_policy_delegates_and_records_each_dispatch():
    inner, rec = _Spy(), _Recorder()
    policy = SharedPolicy(inner, rec)
    req = RequestFeatures("tiny", (1, 2, 3), session_key="s")
    view = ClusterView((ReplicaState("r1"), ReplicaState("r2")))
    decision = policy.select(req, view)
    policy.on_dispatch(req, decision, view)
    policy.on_complete(req, "r2", None)
    assert inner.calls == ["select", "dispatch", "complete"]
    assert rec.records == [("r2", (1, 2, 3), "s")]
    assert policy.name == "spy" and policy.extra == 42


def test_shared_policy_around_a_real_policy_keeps_its_local_view_up_to_date():
    deps = PolicyDeps()
    rec = _Recorder()
    policy = SharedPolicy(default_registry().build("cache_aware", {}, deps), rec)
    req = RequestFeatures("tiny", (7, 8), prompt_tokens=128, session_key="k")
    view = ClusterView((ReplicaState("a"), ReplicaState("b")))
    d = policy.select(req, view)
    policy.on_dispatch(req, d, view)
    assert deps.index.match((7, 8)) == {d.replica: 2} and deps.sessions.peek("k") == d.replica
    assert rec.records == [(d.replica, (7, 8), "k")] and policy.name == "cache_aware"


def test_replica_state_adds_other_gateways_in_flight():
    pool = ReplicaPool([ReplicaConfig("http://a:1", id="a"), ReplicaConfig("http://b:1", id="b")])
    pool.begin("a")
    pool.set_remote_in_flight({"a": 2, "b": 5, "gone": 9})
    assert pool.snapshot().by_id("a").in_flight == 3 and pool.snapshot().by_id("b").in_flight == 5
    assert pool.get("a").to_json()["remote_in_flight"] == 2 and pool.get("a").in_flight == 1
    pool.set_remote_in_flight({})
    assert pool.snapshot().by_id("b").in_flight == 0


def test_a_request_the_heartbeat_reports_late_is_not_also_counted_as_another_clients():
    """B scraped a replica while gateway A's request ran there, before A's heartbeat said so."""
    pool = ReplicaPool([ReplicaConfig("http://a:1", id="a")])
    rep = pool.get("a")
    rep.record_engine(running=2, waiting=1, kv_usage=0.1)  # 3 there; we know of none of them
    assert pool.snapshot().by_id("a").load == 3
    pool.set_remote_in_flight({"a": 1})  # one of them was A's
    state = pool.snapshot().by_id("a")
    assert state.load == 3 and state.in_flight == 1 and state.waiting == 1
    pool.set_remote_in_flight({})  # A's finished: the other two stay until the next scrape
    assert pool.snapshot().by_id("a").load == 2
    pool.set_remote_in_flight({"a": 3})  # A has 3 now: no client beyond the gateways is left
    state = pool.snapshot().by_id("a")
    assert state.load == 3 and state.waiting == 0
    rep.record_engine(running=4, waiting=0, kv_usage=0.1)  # a new scrape starts afresh
    assert pool.snapshot().by_id("a").load == 4


async def test_memory_store_expiry_follows_its_injected_clock():
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    await store.publish([Event("r1", (), "s")], session_ttl_s=10)
    await store.publish_load("gw", {"r1": 1}, ttl_s=2)
    clock.t += 1.5
    assert await store.get_session("s") == "r1" and await store.read_load() == {"gw": {"r1": 1}}
    clock.t += 1.0
    assert await store.read_load() == {}
    clock.t += 10
    assert await store.get_session("s") is None
    assert [kv async for kv in store.sessions()] == []


def _sync(store, clock=None) -> StateSync:
    clock = clock or FakeClock()
    return StateSync(store, PolicyDeps(clock=clock), None, "me", SyncSettings(), wall=lambda: 1000.0)


def test_apply_skips_duplicates_and_flags_trimmed_gaps():
    s = _sync(MemoryStore())

    def ev(seq, session):
        return Event("r1", (seq,), session, "other", "o1", seq, 10**9)

    s._apply([("1-0", ev(1, "a")), ("2-0", ev(2, "b")), ("3-0", ev(2, "b"))])
    assert s.stats["applied"] == 2 and s.stats["duplicates"] == 1 and not s._snapshot_needed
    s._apply([("4-0", ev(5, "c")), ("5-0", None)])
    assert s.stats["gaps"] == 1 and s._snapshot_needed and s.stats["malformed"] == 1
    assert s._last_id == "5-0" and s.sessions.peek("c") == "r1"


def test_apply_ignores_stale_sessions_and_rebinds_own_in_stream_order():
    s = _sync(MemoryStore())
    old = Event("r1", (1,), "stale", "other", "o1", 1, 10**9 - int(s.sessions.ttl_s * 1e6) - 1)
    mine = Event("r9", (2,), "own", "me", s.nonce, 1, 10**9)
    s._apply([("1-0", old), ("2-0", mine)])
    assert s.sessions.peek("stale") is None and s.index.match((1,)) == {"r1": 1}
    assert s.sessions.peek("own") == "r9" and s.index.match((2,)) == {}


def test_record_is_bounded_and_drops_the_oldest():
    s = StateSync(MemoryStore(), PolicyDeps(), None, "me", SyncSettings(outbox_max=3))
    for i in range(5):
        s.record(f"r{i}", (), None)
    assert s.status()["outbox"] == 3 and s.stats["dropped"] == 2
    batch, _ = s._take()
    assert [e.replica for e in batch] == ["r2", "r3", "r4"] and [e.seq for e in batch] == [1, 2, 3]
    s._put_back([("x", (), None, 0.0)] * 5)
    assert s.status()["outbox"] == 3 and s.stats["dropped"] == 4


def test_serve_reads_redis_and_gateway_id_from_cli_env_and_config_file(tmp_path):
    from gateway.app import GatewayApp
    from gateway.cli import _serve_overrides, build_parser
    from gateway.config import GatewayConfig, load_config
    from gateway.errors import ConfigError

    args = build_parser().parse_args(["serve", "--redis", "redis://h:1/0", "--gateway-id", "g1"])
    cfg = load_config(_serve_overrides(args), env={})
    assert (cfg.redis_url, cfg.gateway_id) == ("redis://h:1/0", "g1")
    f = tmp_path / "kvgate.yaml"
    f.write_text("redis_url: redis://x:2/0\ngateway_id: from-file\n")
    cfg = load_config({}, env={}, config_file=str(f))
    assert (cfg.redis_url, cfg.gateway_id) == ("redis://x:2/0", "from-file")
    assert load_config({}, env={"KVGATE_REDIS_URL": "redis://e:3/0"}).redis_url == "redis://e:3/0"
    with pytest.raises(ConfigError):
        GatewayApp(GatewayConfig(redis_url="http://not-redis:6379"))
    demo = build_parser().parse_args(["demo", "--gateways", "2"])
    assert demo.gateways == 2 and demo.redis_url is None
