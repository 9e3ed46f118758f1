"""The routing benchmark's pure parts, and a short end-to-end run of `kvgate bench routing`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gateway.bench.loadgen import percentile
from gateway.bench.tables import markdown_table, replace_block
from gateway.bench.workloads import footprint, multi_turn, shared_prefix


def test_workloads_are_deterministic_and_well_formed():
    a, b = shared_prefix(requests=50), shared_prefix(requests=50)
    assert [r.messages for r in a.requests] == [r.messages for r in b.requests]
    assert all(x.arrival_s < y.arrival_s for x, y in zip(a.requests, a.requests[1:], strict=False))
    mt = multi_turn(requests=60)
    by_session: dict[str, list] = {}
    for r in mt.requests:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        assert turns[0].after is None
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert nxt.after == prev.seq
            assert nxt.messages[: len(prev.messages)] == prev.messages  # the conversation grows
            assert nxt.messages[len(prev.messages)]["role"] == "assistant"


def test_ideal_hit_rate_of_one_infinite_cache():
    one_group = shared_prefix(groups=1, requests=20, system_words=400)
    fp = footprint(one_group)
    assert 0.8 < fp.ideal_hit_rate < 1.0  # only the first request and the questions miss
    many = shared_prefix(groups=20, prompts_per_group=1, requests=20, zipf=0.0)
    assert footprint(many).ideal_hit_rate < fp.ideal_hit_rate


def test_percentile_and_tables(tmp_path):
    assert percentile([1, 2, 3, 4], 0.5) == 2.5 and percentile([5], 0.99) == 5
    table = markdown_table(["a", "bb"], [["1", "22"], ["333", "4"]])
    assert table.splitlines()[0] == "| a   | bb |" and len(table.splitlines()) == 4
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- bench:routing -->\nold\n<!-- /bench:routing -->\ntail\n")
    replace_block(str(readme), "routing", "new table")
    text = readme.read_text()
    assert "new table" in text and "old" not in text and text.endswith("tail\n")


def test_bench_routing_end_to_end(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "bench", "routing", "--workloads", "shared_prefix",
         "--targets", "kvgate/round_robin,oracle,pooled", "--scale", "0.05", "--replicas", "2",
         "--decode-ms-per-token", "1", "--rounds", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = int(len(shared_prefix().requests) * 0.05)
    data = json.loads((out / "routing.json").read_text())
    rows = {r["target"]: r for r in data["rows"]}
    assert set(rows) == {"kvgate/round_robin", "oracle", "pooled"}
    for r in rows.values():  # two rounds: each row sums both runs' requests
        assert r["failures"] == 0 and r["requests"] == 2 * expected and sum(r["per_replica"]) == expected
        assert 0 < r["hit_rate"] <= r["ideal_hit_rate"] + 1e-9
        # no warms here: what the replicas computed is what the clients asked for
        assert r["engine_hit_rate"] == pytest.approx(r["hit_rate"], abs=1e-9)
    assert rows["oracle"]["hit_rate"] >= rows["kvgate/round_robin"]["hit_rate"]
    # one replica with every slot and a cache for everything: it served all, and no partition of
    # the cache finds more (what it misses is prompts that arrive while their prefix is computed)
    assert len(rows["pooled"]["per_replica"]) == 1 and rows["pooled"]["max_over_mean_load"] == 1.0
    assert rows["pooled"]["hit_rate"] >= rows["oracle"]["hit_rate"] - 0.02
    assert sorted((r["target"], r["round"]) for r in data["runs"]) == [
        ("kvgate/round_robin", 0), ("kvgate/round_robin", 1), ("oracle", 0), ("oracle", 1),
        ("pooled", 0), ("pooled", 1)]
    md = (out / "routing.md").read_text()
    assert "| shared_prefix | oracle" in md and "median of 2 rounds" in md


def test_rounds_rotate_the_order_and_report_medians():
    from gateway.bench.routing import Row, median_row, rotated

    names = ["a", "b", "c"]
    assert [rotated(names, r)[0] for r in range(3)] == ["a", "b", "c"]  # each starts a round once
    assert rotated(names, 4) == ["b", "c", "a"] and sorted(rotated(names, 2)) == names

    def row(p50: float, p99: float, failures: int = 0) -> Row:
        return Row("w", "t", 10, failures, p50 / 100, 0.9, p50, p99, 2 * p50, 2 * p99, 5.0, 1.0,
                   [int(p99), 10 - int(p99)], ttft_mean_ms=p50 + 1)

    m = median_row([row(10, 3), row(30, 9), row(20, 1, failures=2)])
    assert (m.ttft_p50_ms, m.ttft_p99_ms, m.e2e_p99_ms, m.hit_rate) == (20, 3, 6, 0.2)
    assert m.ttft_mean_ms == 21
    assert (m.requests, m.failures, m.per_replica) == (30, 2, [3, 7])  # the median-p99 run's split
    one = row(5, 5)
    assert median_row([one]) is one


def test_summary_counts_served_requests_and_their_mean_ttft():
    from gateway.bench.loadgen import Result
    from gateway.bench.routing import summarize
    from gateway.bench.workloads import Workload

    results = [Result(0, True, 0.010, 0.1, 100, 50), Result(1, True, 0.030, 0.2, 100, 0),
               Result(2, False, error="503"), Result(3, True, 0.200, 0.4, 200, 150)]
    row = summarize(Workload("w", []), "t", results, 2.0, [2, 1], 0.9, 0.5)
    assert (row.requests, row.failures, row.per_replica) == (4, 1, [2, 1])
    assert row.hit_rate == 200 / 400 and row.throughput_rps == 1.5
    assert abs(row.ttft_mean_ms - 80.0) < 1e-9  # the failed request counts in no latency
    assert row.ttft_p50_ms == 30.0 and abs(row.max_over_mean_load - 2 / 1.5) < 1e-9


def test_hot_prefix_workload_ramps_one_document_up_to_its_share():
    from gateway.bench.workloads import hot_prefix

    w = hot_prefix(requests=600)
    assert [r.messages for r in w.requests] == [r.messages for r in hot_prefix(requests=600).requests]
    keys = [r.key for r in w.requests]
    early, late = keys[:60], keys[200:]
    assert early.count("doc-0") < late.count("doc-0") * len(early) / len(late)  # still ramping
    assert 0.68 < late.count("doc-0") / len(late) < 0.82  # hot_share 0.75 once ramped up
    assert {k for k in keys if k != "doc-0"} <= {f"group-{g}" for g in range(16)}
    rotating = hot_prefix(requests=600, hot_docs=3)
    assert {r.key for r in rotating.requests[450:]} & {"doc-2"} and "doc-2" not in {
        r.key for r in rotating.requests[:200]
    }
    assert footprint(w).ideal_hit_rate > 0.95


def test_the_no_pull_target_turns_pulls_off_and_the_default_leaves_them_to_the_replicas():
    from gateway.bench.routing import NO_PULL, router_proc, target_names

    assert NO_PULL in target_names("all")
    sim_args = dict(prefill_ms_per_token=0.1, decode_ms_per_token=10, max_running=8,
                    kv_bandwidth_gbps=100.0, kv_block_bytes=2 << 20)

    def params(name):
        argv = router_proc(name, ["http://r0"], 1234, sim_args).argv
        assert argv[argv.index("--policy") + 1] == "cache_aware"
        return [argv[i + 1] for i, a in enumerate(argv) if a == "--policy-param"]

    assert "migrate=false" in params(NO_PULL)
    # the default prices pulls from what the replicas advertise, not from bench knobs
    assert not [p for p in params("kvgate/cache_aware") if p.startswith(("migrate", "transfer"))]


def test_a_peer_routers_metrics_port_is_never_its_serving_port(monkeypatch) -> None:
    from gateway.bench import peers

    picks = iter([7001, 7001, 7001, 7002])  # free_port may pick the serving port again
    monkeypatch.setattr(peers, "free_port", lambda: next(picks))
    argv = peers.vllm_router_proc(["http://127.0.0.1:9"], 7001, exe="/bin/true").argv
    assert argv[argv.index("--port") + 1] == "7001"
    assert argv[argv.index("--prometheus-port") + 1] == "7002"


def test_routing_bench_starts_peer_routers_on_two_distinct_ports(monkeypatch) -> None:
    from gateway.bench import peers, routing

    monkeypatch.setattr(peers, "find_peer", lambda name: f"/opt/{name}")
    picks = iter([7001, 7001, 7002, 7004])  # free_port may pick the serving port again
    monkeypatch.setattr(peers, "free_port", lambda: next(picks))
    proc = routing.router_proc("vllm-router/consistent_hash", ["http://127.0.0.1:9"], 7001, {})
    argv = proc.argv
    assert argv[0] == "/opt/vllm-router" and argv[argv.index("--policy") + 1] == "consistent_hash"
    assert argv[argv.index("--port") + 1] == "7001"
    assert argv[argv.index("--prometheus-port") + 1] == "7002"
    assert proc.name == "vllm-router_consistent_hash"  # a log file of its own
    sglang = routing.router_proc("sglang-router/cache_aware", ["http://127.0.0.1:9"], 7003, {}).argv
    assert sglang[:2] == ["/opt/sglang-router", "launch"]


def test_all_targets_without_the_peer_routers_warns_and_a_readme_table_refuses(monkeypatch, capsys) -> None:
    from gateway.bench import routing

    monkeypatch.setattr(routing, "find_peer", lambda name: None)
    names = routing.target_names("all")
    assert not [n for n in names if n in routing.PEERS]
    assert "kvgate/cache_aware" in names and "oracle" in names
    err = capsys.readouterr().err
    assert "sglang-router, vllm-router" in err and "pip install -e '.[bench]'" in err
    with pytest.raises(SystemExit, match="--readme compares against every peer"):
        routing.target_names("all", need_peers=True)
    with pytest.raises(SystemExit, match="unknown or unavailable"):
        routing.target_names("sglang-router/cache_aware")
    monkeypatch.setattr(routing, "find_peer", lambda name: f"/opt/{name}")
    every = routing.target_names("all", need_peers=True)
    assert set(routing.PEERS) <= set(every) and routing.POOLED not in every  # named on its own
    assert routing.target_names("all,pooled") == [*every, routing.POOLED]
    assert routing.target_names("oracle,pooled,oracle") == ["oracle", routing.POOLED]


def test_rate_scale_keeps_the_script_and_stretches_its_arrivals() -> None:
    from gateway.bench.routing import _scaled
    from gateway.bench.routing_report import _rate_note

    base, slow = _scaled("hot_prefix", 0.1), _scaled("hot_prefix", 0.1, 0.8)
    assert len(slow.requests) == len(base.requests) == 80
    assert [r.messages for r in slow.requests] == [r.messages for r in base.requests]
    assert slow.params["rate"] == pytest.approx(0.8 * base.params["rate"])
    assert slow.duration_s == pytest.approx(base.duration_s / 0.8)  # same draws, 1/0.8 the gaps
    assert _scaled("multi_turn", 1.0, 0.5).params["rate"] == pytest.approx(12.0)
    with pytest.raises(SystemExit):
        _scaled("shared_prefix", 0.5, 0.0)

    class Args:
        rate_scale = 0.8

    assert _rate_note(Args()) == "arrivals at 0.8x each workload's rate; "
    Args.rate_scale = 1.0
    assert _rate_note(Args()) == ""
