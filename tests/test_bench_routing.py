"""The routing benchmark's pure parts, and a short end-to-end run of `kvgate bench routing`."""

from __future__ import annotations

import json
import subprocess
import sys

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
         "--targets", "kvgate/round_robin,oracle", "--scale", "0.05", "--replicas", "2",
         "--decode-ms-per-token", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = int(len(shared_prefix().requests) * 0.05)
    data = json.loads((out / "routing.json").read_text())
    rows = {r["target"]: r for r in data["rows"]}
    assert set(rows) == {"kvgate/round_robin", "oracle"}
    for r in rows.values():
        assert r["failures"] == 0 and r["requests"] == expected and sum(r["per_replica"]) == expected
        assert 0 < r["hit_rate"] <= r["ideal_hit_rate"] + 1e-9
    assert rows["oracle"]["hit_rate"] >= rows["kvgate/round_robin"]["hit_rate"]
    assert "| shared_prefix | oracle" in (out / "routing.md").read_text()
