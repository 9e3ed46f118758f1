"""The report of ``kvgate bench routing`` (:mod:`gateway.bench.routing`): its table (markdown,
printed and written to ``routing.md``), the rows and every round's runs as JSON, a PNG plot of hit
rates and TTFT, and the README's ``bench:routing`` block when ``--readme`` is given."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

from .tables import markdown_table, replace_block

if TYPE_CHECKING:
    from .routing import Row

HEADERS = ["workload", "target", "hit rate", "of ideal", "engine hit", "TTFT p50 ms", "TTFT p99 ms", "E2E p50 ms",
           "E2E p99 ms", "req/s", "max/mean load", "failed"]


def table_rows(rows: list[Row]) -> list[list[str]]:
    return [[r.workload, r.target, f"{r.hit_rate:.1%}", f"{r.hit_rate / r.ideal_hit_rate:.0%}" if r.ideal_hit_rate else "-",
             f"{r.engine_hit_rate:.1%}",
             f"{r.ttft_p50_ms:.1f}", f"{r.ttft_p99_ms:.1f}", f"{r.e2e_p50_ms:.0f}", f"{r.e2e_p99_ms:.0f}",
             f"{r.throughput_rps:.1f}", f"{r.max_over_mean_load:.2f}", str(r.failures)] for r in rows]


def _rate_note(args: argparse.Namespace) -> str:
    rate = getattr(args, "rate_scale", 1.0)
    return f"arrivals at {rate:g}x each workload's rate; " if rate != 1.0 else ""


def write_report(rows: list[Row], args: argparse.Namespace, final: bool = True,
                 runs: list[dict] | None = None) -> None:
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    setup = (f"{args.replicas} simulated replicas, {args.prefill_ms_per_token} ms/prefill token, "
             f"{args.decode_ms_per_token} ms/decode token, {args.max_running} running, cache per replica = "
             f"{args.cache_fraction:.2f} of the workload's distinct blocks; "
             f"{_rate_note(args)}{_rounds_note(args)}{stamp}")
    md = f"Routing quality ({setup}):\n\n" + markdown_table(HEADERS, table_rows(rows)) + "\n"
    if final:
        print(md)
    with open(os.path.join(args.out, "routing.md"), "w") as fh:
        fh.write(md)
    with open(os.path.join(args.out, "routing.json"), "w") as fh:
        json.dump({"setup": setup, "rows": [asdict(r) for r in rows], "runs": runs or []}, fh, indent=2)
    png = os.path.join(args.out, "routing.png")
    if plot(rows, png):
        if args.readme and final:  # the README's picture lives in the repository, not in --out
            root = os.path.dirname(os.path.abspath(args.readme))
            os.makedirs(os.path.join(root, "docs", "bench"), exist_ok=True)
            shutil.copyfile(png, os.path.join(root, "docs", "bench", "routing.png"))
            png = "docs/bench/routing.png"
        md += f"\n![routing benchmark]({png})\n"
    if args.readme and final:
        replace_block(args.readme, "routing", md)


def _rounds_note(args: argparse.Namespace) -> str:
    n = max(1, getattr(args, "rounds", 1))
    return f"median of {n} rounds, targets in a rotated order each round; " if n > 1 else ""


def plot(rows: list[Row], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    workloads = sorted({r.workload for r in rows}, key=[r.workload for r in rows].index)
    fig, axes = plt.subplots(len(workloads), 2, figsize=(13, 3.6 * len(workloads)), squeeze=False)
    for i, w in enumerate(workloads):
        sub = [r for r in rows if r.workload == w]
        names = [r.target for r in sub]
        ax = axes[i][0]
        ax.barh(names, [r.hit_rate * 100 for r in sub], color="tab:blue")
        ax.axvline(sub[0].ideal_hit_rate * 100, color="k", ls="--", lw=1, label="ideal (one infinite cache)")
        ax.set_xlabel("cache hit rate %")
        ax.set_title(f"{w}: hit rate")
        ax.legend(loc="lower right", fontsize=7)
        ax.invert_yaxis()
        ax = axes[i][1]
        y = range(len(sub))
        ax.barh([v - 0.2 for v in y], [r.ttft_p50_ms for r in sub], height=0.4, label="p50")
        ax.barh([v + 0.2 for v in y], [r.ttft_p99_ms for r in sub], height=0.4, label="p99")
        ax.set_yticks(list(y), names)
        ax.set_xlabel("TTFT ms")
        ax.set_title(f"{w}: time to first token")
        ax.legend(fontsize=7)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
