"""Report of ``kvgate bench transfer``: each row against a baseline timed in the same rounds.

Input: ``{row: [seconds of round 1, round 2, ...]}`` (warm-up excluded) and the bytes each round
moved.  A row's throughput is ``bytes / median(seconds)``; its ratio against a baseline is the
median over rounds of ``baseline seconds / row seconds`` in the same round (paired, so a noisy
neighbour slowing one round slows both sides of that round's ratio).

Goals (issue #6): tier moves >= 0.70 of memcpy, TCP >= 0.80 of the raw loopback copy.  A disk
move's goal is judged against memcpy where the machine's raw file I/O of the same bytes reaches
0.70 of memcpy, and against that raw file I/O (the disk's own limit) where it does not.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

from gateway.bench.tables import markdown_table

GOAL = {"tier": 0.70, "disk": 0.70, "tcp": 0.80}
Times = dict[str, list[float]]


class Row(NamedTuple):
    name: str
    baseline: str
    goal: str | None = None  # a key of GOAL
    also: str | None = None  # a second baseline, reported beside the first


ROWS = [
    Row("tier host copy", "memcpy", "tier"),
    Row("tier CPU->disk", "memcpy", "disk", "raw file write"),
    Row("tier disk->CPU", "memcpy", "disk", "raw file read"),
    Row("disk->CPU, verify off", "memcpy", None, "raw file read"),
    Row("disk->CPU, per block", "memcpy", None, "raw file read"),
    Row("tcp fetch", "raw loopback peer->us", "tcp", "raw ... distinct memory"),
    Row("tcp fetch, verify off", "raw loopback peer->us", None, "raw ... distinct memory"),
    Row("tcp push", "raw loopback us->peer", "tcp"),
    Row("tcp push, hash on send", "raw loopback us->peer"),  # the agent pushes known checksums
    Row("gloo blocks", "gloo raw send"),
]
BY_NAME = {r.name: r for r in ROWS}


def ratio(times: Times, row: str, base: str) -> float:
    """Median over rounds of baseline time / row time (> 1: the row is faster)."""
    return statistics.median(b / r for b, r in zip(times[base], times[row], strict=True))


def gbps(times: Times, row: str, total: int) -> float:
    return total / statistics.median(times[row]) / 1e9


def judged(times: Times, row: Row) -> tuple[str, float, str]:
    """(baseline the goal is judged against, the ratio, why that baseline)."""
    if row.goal == "disk" and row.also in times:
        raw = ratio(times, row.also, "memcpy")
        if raw < GOAL["disk"]:
            why = f"{row.also} itself reaches only {raw:.2f} of memcpy here"
            return row.also, ratio(times, row.name, row.also), why
        why = f"{row.also} reaches {raw:.2f} of memcpy, so memcpy is the limit"
        return row.baseline, ratio(times, row.name, row.baseline), why
    return row.baseline, ratio(times, row.name, row.baseline), ""


def goal_lines(times: Times) -> list[str]:
    """Markdown checklist, one line per row with a goal."""
    lines = []
    for row in ROWS:
        if row.goal is None or row.name not in times:
            continue
        base, r, why = judged(times, row)
        target = GOAL[row.goal]
        extra = [why] if why else []
        for other in (row.baseline, row.also):
            if other and other != base and other in times:
                extra.append(f"{ratio(times, row.name, other):.2f} of {other}")
        note = f" ({'; '.join(extra)})" if extra else ""
        mark = "x" if r >= target else " "
        lines.append(f"- [{mark}] {row.name} >= {target:.2f} of {base}: {r:.2f}{note}")
    return lines


def _cells(times: Times, name: str, total: int) -> list[str]:
    row = BY_NAME.get(name)
    if row is None or row.baseline not in times:
        return [name, f"{gbps(times, name, total):.2f}", "(baseline)", "", ""]
    bases = [b for b in (row.baseline, row.also) if b and b in times]
    ratios = " / ".join(f"{ratio(times, name, b):.2f}" for b in bases)
    goal = ""
    if row.goal:
        base, r, _ = judged(times, row)
        goal = f"{GOAL[row.goal]:.2f} of {base}: {'met' if r >= GOAL[row.goal] else 'not met'}"
    return [name, f"{gbps(times, name, total):.2f}", " / ".join(bases), ratios, goal]


def markdown(times: Times, total: int, setup: str) -> str:
    headers = ["path", "GB/s", "baseline (same rounds)", "ratio", "goal"]
    table = markdown_table(headers, [_cells(times, name, total) for name in times])
    return "\n".join([f"Setup: {setup}.", "", table, "", "Goals:", "", *goal_lines(times), ""])


def report(times: Times, total: int) -> str:
    """The console table: GB/s and ratios per row."""
    lines = [f"{'path':24s} {'GB/s':>6s}  ratio  vs (goal)", "-" * 78]
    for name in times:
        row, note = BY_NAME.get(name), ""
        if row is not None and row.baseline in times:
            note = f"{ratio(times, name, row.baseline):5.2f}  vs {row.baseline}"
            if row.goal:
                base, r, _ = judged(times, row)
                ok = "ok" if r >= GOAL[row.goal] else "below"
                note += f" (goal >= {GOAL[row.goal]:.2f} of {base}: {ok})"
            if row.also in times:
                note += f"; {ratio(times, name, row.also):.2f} vs {row.also}"
        lines.append(f"{name:24s} {gbps(times, name, total):6.2f}  {note}")
    return "\n".join(lines)
