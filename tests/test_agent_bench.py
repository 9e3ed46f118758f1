"""The transfer benchmark's pure report and a tiny tier run (the full run is manual)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from worker_agent.bench_transfer import bench_tiers, make_blocks, report  # noqa: E402


def test_report_ratios_and_goals():
    results = {"memcpy": 1.0, "tier host copy": 2.0, "raw loopback peer->us": 1.0, "tcp fetch": 1.1}
    text = report(results, total=10**9)
    lines = text.splitlines()[2:]

    def row(name: str) -> str:
        return next(line for line in lines if line.startswith(name + " "))

    assert "0.50  vs memcpy (>= 0.70: below)" in row("tier host copy")
    assert "0.91  vs raw loopback peer->us (>= 0.80: ok)" in row("tcp fetch")
    assert row("memcpy").split()[1] == "1.00"  # GB/s of 1e9 bytes in 1 s


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
    }
    assert all(v > 0 for v in out.values())
    assert list(tmp_path.glob("*.kvb")) == []  # the store cleaned up after itself


def test_kvgate_bench_transfer_cli_writes_a_report(tmp_path):
    from gateway.cli import main

    rc = main(["bench", "transfer", "--skip", "tcp", "--skip", "gloo", "--total-mib", "8",
               "--block-mib", "1", "--rounds", "1", "--out", str(tmp_path)])
    text = (tmp_path / "transfer.md").read_text()
    assert rc == 0 and "memcpy" in text and "tier host copy" in text
