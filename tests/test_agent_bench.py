"""The transfer benchmark's pure report and a tiny tier run (the full run is manual)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from worker_agent.bench_report import goal_lines, markdown, ratio, report  # noqa: E402
from worker_agent.bench_transfer import bench_tiers, make_blocks  # noqa: E402


def test_ratios_are_paired_per_round():
    # round 2 was slowed for both (a noisy neighbour): paired ratios stay 0.5, 0.5, 0.5
    times = {"memcpy": [1.0, 4.0, 1.0], "tier host copy": [2.0, 8.0, 2.0]}
    assert ratio(times, "tier host copy", "memcpy") == 0.5


def test_report_ratios_and_goals():
    times = {
        "memcpy": [1.0, 1.0],
        "tier host copy": [2.0, 2.0],
        "raw loopback peer->us": [1.0, 1.0],
        "tcp fetch": [1.1, 1.1],
    }
    lines = report(times, total=10**9).splitlines()[2:]

    def row(name: str) -> str:
        return next(line for line in lines if line.startswith(name + " "))

    assert "0.50  vs memcpy (goal >= 0.70 of memcpy: below)" in row("tier host copy")
    assert "0.91  vs raw loopback peer->us (goal >= 0.80 of raw loopback peer->us: ok)" in row(
        "tcp fetch"
    )
    assert row("memcpy").split()[1] == "1.00"  # GB/s of 1e9 bytes in 1 s


def test_disk_goal_falls_back_to_raw_file_io_only_where_the_disk_cannot_reach_memcpy():
    slow_disk = {
        "memcpy": [1.0],
        "raw file write": [4.0],  # raw writes: 0.25 of memcpy
        "tier CPU->disk": [5.0],  # 0.80 of raw writes, 0.20 of memcpy
        "raw file read": [1.1],  # raw reads: 0.91 of memcpy
        "tier disk->CPU": [2.0],  # 0.50 of memcpy
    }
    lines = goal_lines(slow_disk)
    assert lines[0].startswith("- [x] tier CPU->disk >= 0.70 of raw file write: 0.80")
    assert "0.20 of memcpy" in lines[0]
    assert lines[1].startswith("- [ ] tier disk->CPU >= 0.70 of memcpy: 0.50")
    md = markdown(slow_disk, 10**9, "test setup")
    assert md.startswith("Setup: test setup.") and "| tier CPU->disk " in md
    assert "0.70 of raw file write: met" in md and "0.70 of memcpy: not met" in md


def test_tier_bench_runs_every_row(tmp_path):
    blocks = make_blocks(4, 64 << 10)
    assert all(t.nbytes == 64 << 10 for t in blocks.values())
    out = bench_tiers(blocks, rounds=1, disk_dir=str(tmp_path))
    assert set(out) == {
        "memcpy",
        "tier host copy",
        "raw file write",
        "tier CPU->disk",
        "raw file read",
        "tier disk->CPU",
        "disk->CPU, verify off",
        "disk->CPU, per block",
    }
    assert all(len(v) == 1 and v[0] > 0 for v in out.values())  # one timed round each
    assert list(tmp_path.glob("*.kvb")) == []  # the store cleaned up after itself


def test_kvgate_bench_transfer_cli_writes_a_report(tmp_path):
    from gateway.cli import main

    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- bench:transfer -->\nold\n<!-- /bench:transfer -->\n\nafter\n")
    rc = main(["bench", "transfer", "--skip", "tcp", "--skip", "gloo", "--total-mib", "8",
               "--block-mib", "1", "--rounds", "1", "--out", str(tmp_path), "--readme", str(readme)])
    text = (tmp_path / "transfer.md").read_text()
    assert rc == 0 and "| memcpy " in text and "- [" in text
    updated = readme.read_text()
    assert text.strip() in updated and "old" not in updated and updated.endswith("after\n")
