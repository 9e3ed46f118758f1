"""Registry, params validation, shared deps and the contract every built-in policy keeps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from policies import (
    DEFAULT_POLICY,
    ClusterView,
    Outcome,
    Policy,
    PolicyDeps,
    ReplicaState,
    RequestFeatures,
    default_registry,
)
from policies.deps import resolve_deps
from policies.errors import NoReplicaError, PolicyConfigError
from policies.hashing import chain_hashes

ALL = ["cache_aware", "least_load", "prefix", "random", "round_robin", "session"]


def view(*loads: int, **extra: object) -> ClusterView:
    return ClusterView(
        tuple(
            ReplicaState(f"r{i}", in_flight=x, models=frozenset({"m"}), **extra)
            for i, x in enumerate(loads)
        )
    )


def feat(model: str = "m", session: str | None = "s") -> RequestFeatures:
    hashes = tuple(chain_hashes([b"a", b"b", b"c"], 1))
    return RequestFeatures(model, hashes, 64, 192, 16, session)


def test_every_policy_is_registered_and_the_default_is_cache_aware() -> None:
    reg = default_registry()
    assert reg.names() == ALL
    assert DEFAULT_POLICY == "cache_aware"
    assert all(reg.describe()[n] for n in ALL)


@pytest.mark.parametrize("name", ALL)
def test_each_policy_keeps_the_contract(name: str) -> None:
    pol = default_registry().build(name, {}, None)
    assert isinstance(pol, Policy)
    v = view(0, 2, 1)
    d = pol.select(feat(), v)
    assert sorted(d.candidates()) == ["r0", "r1", "r2"]  # the pick plus every alternate, once
    assert d.reason
    pol.on_dispatch(feat(), d, v)
    pol.on_complete(feat(), d.replica, Outcome(ok=True, cached_tokens=0, predicted_cached_tokens=0))


@pytest.mark.parametrize("name", ALL)
def test_unknown_model_raises_no_replica(name: str) -> None:
    pol = default_registry().build(name, {}, None)
    with pytest.raises(NoReplicaError):
        pol.select(feat(model="other"), view(0, 0))


@pytest.mark.parametrize("name", ALL)
def test_unhealthy_and_draining_replicas_are_never_picked(name: str) -> None:
    pol = default_registry().build(name, {}, None)
    v = ClusterView(
        (
            ReplicaState("sick", healthy=False),
            ReplicaState("leaving", draining=True),
            ReplicaState("ok", in_flight=50),
        )
    )
    for k in range(20):
        d = pol.select(RequestFeatures("m", (k + 1,), session_key=f"s{k}"), v)
        assert d.candidates() == ("ok",)
    with pytest.raises(NoReplicaError):
        pol.select(feat(), ClusterView((ReplicaState("sick", healthy=False),)))


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("cache_aware", {"max_running": 0}),
        ("cache_aware", {"tie_ms": -1}),
        ("cache_aware", {"prefill_ms_per_token": "fast"}),
        ("cache_aware", {"load_factor": 0.9}),
        ("cache_aware", {"max_running": 2.5}),
        ("cache_aware", {"no_such_param": 1}),
        ("prefix", {"cache_threshold": 1.5}),
        ("prefix", {"balance_rel_threshold": 0.5}),
        ("prefix", {"balance_abs_threshold": -1}),
        ("session", {"load_slack": -1}),
        ("session", {"load_factor": True}),
        ("no_such_policy", {}),
    ],
)
def test_bad_config_fails_at_build_time(name: str, params: dict) -> None:
    with pytest.raises(PolicyConfigError):
        default_registry().build(name, params, None)


def test_params_from_strings_are_coerced() -> None:
    reg = default_registry()
    p = reg.parse_params(
        "cache_aware", {"tie_ms": "50", "learn_capacity": "false", "max_running": "32"}
    )
    assert (p.tie_ms, p.learn_capacity, p.max_running) == (50.0, False, 32)


def test_migrate_takes_a_word_or_a_yaml_boolean() -> None:
    reg = default_registry()
    assert reg.parse_params("cache_aware", {}).migrate == "auto"
    assert reg.parse_params("cache_aware", {"migrate": True}).migrate == "true"  # YAML's true
    assert reg.parse_params("cache_aware", {"migrate": False}).migrate == "false"
    assert reg.parse_params("cache_aware", {"migrate": "Off"}).migrate == "Off"
    with pytest.raises(PolicyConfigError, match="migrate must be auto, true or false"):
        reg.parse_params("cache_aware", {"migrate": "sometimes"})
    with pytest.raises(PolicyConfigError, match="expected a string"):
        reg.parse_params("cache_aware", {"migrate": 1})


def test_policies_share_the_deps_they_are_given() -> None:
    deps = PolicyDeps()
    reg = default_registry()
    prefix = reg.build("prefix", {}, deps)
    aware = reg.build("cache_aware", {}, deps)
    sticky = reg.build("session", {}, deps)
    v = view(0, 0, 0, 0)
    d = prefix.select(feat(), v)
    prefix.on_dispatch(feat(), d, v)
    assert aware.select(feat(), view(1, 1, 1, 1)).predicted_cached_tokens == 192
    aware.on_dispatch(feat(session="x"), d, v)
    assert deps.sessions.peek("x") == d.replica
    assert sticky.select(feat(session="x"), v).replica == d.replica


def test_fresh_deps_are_private() -> None:
    reg = default_registry()
    a = reg.build("prefix", {}, None)
    b = reg.build("prefix", {}, None)
    v = view(0, 0, 0, 0)
    d = a.select(feat(), v)
    a.on_dispatch(feat(), d, v)
    assert a.select(feat(), v).reason == "prefix-hit"
    assert b.select(feat(), v).reason == "cold-rendezvous"


def test_deps_must_look_like_policy_deps() -> None:
    assert isinstance(resolve_deps(None), PolicyDeps)
    with pytest.raises(TypeError):
        resolve_deps(object())


def test_simple_policies() -> None:
    reg = default_registry()
    rr = reg.build("round_robin")
    v = view(0, 0, 0)
    seen = []
    for _ in range(6):
        d = rr.select(feat(), v)
        rr.on_dispatch(feat(), d, v)
        seen.append(d.replica)
    assert seen == ["r0", "r1", "r2", "r0", "r1", "r2"]
    assert reg.build("least_load", {"choices": 0}).select(feat(), view(3, 1, 2)).replica == "r1"
    a, b = reg.build("random", {"seed": 7}), reg.build("random", {"seed": 7})
    assert [a.select(feat(), v).replica for _ in range(20)] == [
        b.select(feat(), v).replica for _ in range(20)
    ]


def test_policies_package_imports_no_io_libraries() -> None:
    root = Path(__file__).resolve().parents[1]
    code = (
        "import sys, policies, policies.bench_policy\n"
        "bad = {'httpx', 'redis', 'fastapi', 'starlette', 'uvicorn', 'torch'} & set(sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)


def test_policy_bench_keeps_a_steady_in_flight_window_and_reports_every_policy(capsys) -> None:
    from gateway.cli import main as cli_main
    from policies.bench_policy import POLICIES, bench_policy

    res = bench_policy("cache_aware", replicas=4, hashes=16, sessions=10, requests=40, in_flight=8)
    for scenario in ("warm", "cold"):
        mean, p50, p99, select = res[scenario]
        assert 0 < p50 <= p99 and mean > 0 and 0 < select < p99
    argv = ["bench", "policy", "--replicas", "4", "--hashes", "16", "--sessions", "10",
            "--requests", "40", "--memory-blocks", "2048", "--rounds", "2"]  # fmt: skip
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines()]
    assert all(name in rows for name in POLICIES), out
    assert "32 in flight" in out and "MB per million blocks" in out and "median of 2" in out
