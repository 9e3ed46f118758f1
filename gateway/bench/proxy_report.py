"""``kvgate bench proxy``'s results: the samples, their medians over rounds, and the report.

:func:`summarize` folds the per-round :class:`Sample` records into one :class:`Summary` per target
and cell; :func:`table`, :func:`goals` and :func:`write_report` turn those into proxy.md (the
table and the goals checklist), proxy.json and the README block.  The measuring is in
:mod:`gateway.bench.proxy`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from . import peers
from .tables import markdown_table, replace_block

if TYPE_CHECKING:  # annotations only: proxy imports this module, not the reverse
    from .proxy import Cell, Target

MODES = ("stream", "json")


@dataclass
class Sample:
    """One target in one cell of one round."""

    target: str
    cell: str
    round: int
    requests: int
    errors: int
    duration_s: float
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    target_cpu_s: float
    replica_cpu_s: float
    wrk_cpu_s: float
    others_cpu_s: float  # CPU everything else on the machine used meanwhile (noise)

    @property
    def cpu_us_per_req(self) -> float:
        return self.target_cpu_s / self.requests * 1e6 if self.requests else float("nan")

    @property
    def replica_us_per_req(self) -> float:
        return self.replica_cpu_s / self.requests * 1e6 if self.requests else float("nan")


@dataclass
class Summary:
    target: str
    cell: str
    rps: float
    p50_ms: float
    p99_ms: float
    added_p50_ms: float | None
    added_p99_ms: float | None
    cpu_us_per_req: float | None
    replica_us_per_req: float
    errors: int
    rounds: int
    others_cpu_pct: float
    samples: list[dict] = field(default_factory=list)


def summarize(samples: list[Sample], targets: list[Target], cells: list[Cell]) -> list[Summary]:
    out = []
    by = {(s.target, s.cell, s.round): s for s in samples}
    for cell in cells:
        for t in targets:
            mine = [s for s in samples if s.target == t.name and s.cell == cell.name]
            if not mine:
                continue
            added50, added99 = [], []
            for s in mine:
                d = by.get(("direct", cell.name, s.round))
                if d is not None:
                    added50.append(s.p50_ms - d.p50_ms)
                    added99.append(s.p99_ms - d.p99_ms)
            has_direct = t.name != "direct" and added50
            out.append(Summary(
                target=t.name, cell=cell.name,
                rps=statistics.median(s.rps for s in mine),
                p50_ms=statistics.median(s.p50_ms for s in mine),
                p99_ms=statistics.median(s.p99_ms for s in mine),
                added_p50_ms=statistics.median(added50) if has_direct else None,
                added_p99_ms=statistics.median(added99) if has_direct else None,
                cpu_us_per_req=statistics.median(s.cpu_us_per_req for s in mine) if t.proc else None,
                replica_us_per_req=statistics.median(s.replica_us_per_req for s in mine),
                errors=sum(s.errors for s in mine), rounds=len(mine),
                others_cpu_pct=100 * statistics.median(s.others_cpu_s / s.duration_s for s in mine),
                samples=[asdict(s) for s in mine],
            ))
    return out

# ---------------------------------------------------------------------------------- report
def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


HEADERS = ["cell", "target", "req/s", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms",
           "proxy CPU us/req", "replica CPU us/req", "errors"]


def table(summaries: list[Summary]) -> str:
    rows = [[s.cell, s.target, f"{s.rps:,.0f}", f"{s.p50_ms:.2f}", f"{s.p99_ms:.2f}",
             _f(s.added_p50_ms, "+.2f"), _f(s.added_p99_ms, "+.2f"), _f(s.cpu_us_per_req, ".0f"),
             f"{s.replica_us_per_req:.0f}", str(s.errors)] for s in summaries]
    return markdown_table(HEADERS, rows)


def goals(summaries: list[Summary], connections: Sequence[int]) -> list[str]:
    """The issue's goals for kvgate, checked against vllm-router measured in the same run."""
    get = {(s.target, s.cell): s for s in summaries}
    hi = max(connections)
    lines = []

    def check(label: str, ok: bool, detail: str) -> None:
        lines.append(f"- [{'x' if ok else ' '}] {label}: {detail}")

    k, v = get.get(("kvgate", f"stream c={hi}")), get.get(("vllm-router", f"stream c={hi}"))
    if k and v and k.added_p50_ms is not None:
        check(f"stream c={hi}: req/s >= vllm-router's", k.rps >= v.rps, f"{k.rps:,.0f} vs {v.rps:,.0f}")
        check(f"stream c={hi}: added p50/p99 <= vllm-router's",
              k.added_p50_ms <= v.added_p50_ms and k.added_p99_ms <= v.added_p99_ms,
              f"{k.added_p50_ms:+.2f}/{k.added_p99_ms:+.2f} ms vs {v.added_p50_ms:+.2f}/{v.added_p99_ms:+.2f} ms")
    if k:
        check(f"stream c={hi}: CPU <= 150 us per stream", k.cpu_us_per_req <= 150, f"{k.cpu_us_per_req:.0f} us")
    k, v = get.get(("kvgate", f"json c={hi}")), get.get(("vllm-router", f"json c={hi}"))
    if k:
        check(f"json c={hi}: CPU <= 100 us per request", k.cpu_us_per_req <= 100, f"{k.cpu_us_per_req:.0f} us")
    if k and v:
        check(f"json c={hi}: req/s >= half of vllm-router's", k.rps >= v.rps / 2, f"{k.rps:,.0f} vs {v.rps:,.0f}")
    for mode in MODES:
        k = get.get(("kvgate", f"{mode} c=1"))
        if k and k.added_p50_ms is not None:
            check(f"{mode} c=1: added p50 <= 0.2 ms", k.added_p50_ms <= 0.2, f"{k.added_p50_ms:+.3f} ms")
    return lines


def environment(wrk: str, extra_dirs: Sequence[str]) -> dict:
    env = {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
           "kernel": platform.release()}
    try:
        env["wrk"] = subprocess.run([wrk, "--version"], capture_output=True, text=True).stdout.split("\n")[0].strip()
    except OSError:
        pass
    nginx = peers.find_peer("nginx", [*extra_dirs, "/usr/sbin"])
    if nginx:
        env["nginx"] = subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip()
    for tool in ("sglang-router", "vllm-router"):
        exe = peers.find_peer(tool, extra_dirs)
        if exe:
            pip = os.path.join(os.path.dirname(exe), "pip")
            if os.path.exists(pip):
                show = subprocess.run([pip, "show", tool], capture_output=True, text=True).stdout
                m = re.search(r"^Version: (\S+)", show, re.M)
                env[tool] = m.group(1) if m else "?"
    return env


def write_report(summaries: list[Summary], samples: list[Sample], args: argparse.Namespace,
                 notes: list[str], env: dict, connections: Sequence[int]) -> str:
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    backend = ("instant mock replicas (`gateway/bench/mock_upstream.py`)" if args.backend == "mock"
               else "instant `kvgate sim` replicas")
    setup = (f"2 {backend}, {args.chunks} SSE events per stream; wrk -t{args.wrk_threads}; "
             f"{args.duration:g} s per cell, median of {args.rounds} interleaved rounds; "
             f"{env.get('cpus')} CPUs shared by everything, nothing pinned; {stamp}")
    noisy = max((s.others_cpu_pct for s in summaries), default=0.0)
    md = [f"Setup: {setup}.", "",
          "Added latency is against `direct` (wrk straight to one replica) in the same round; proxy CPU is the "
          "proxy's process tree (user + system) per completed request.", "",
          table(summaries), ""]
    lines = goals(summaries, connections)
    if lines:
        md += ["Goals (kvgate vs vllm-router, same run):", "", *lines, ""]
    if notes:
        md += ["Notes: " + "; ".join(notes) + ".", ""]
    if noisy > 10:
        md += [f"Other processes used up to {noisy:.0f}% of a core during some cells: numbers are noisy.", ""]
    text = "\n".join(md)
    with open(os.path.join(args.out, "proxy.md"), "w", encoding="utf-8") as fh:
        fh.write(text)
    with open(os.path.join(args.out, "proxy.json"), "w", encoding="utf-8") as fh:
        json.dump({"setup": setup, "environment": env, "notes": notes,
                   "args": {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | list)},
                   "summary": [asdict(s) for s in summaries]}, fh, indent=2)
    if args.readme:
        replace_block(args.readme, "proxy", text)
    return text
