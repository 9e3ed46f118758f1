"""``kvgate bench proxy``: what a proxy in front of the replicas costs, against instant replicas.

Setup: two mock replicas that answer instantly (``--backend mock``, the default: the asyncio
server of :mod:`gateway.bench.mock_upstream`, one process; or ``--backend sim``: ``kvgate sim
--instant``), and in front of them, each in its own process: nginx (plain reverse proxy, upstream
keep-alive, no buffering: the practical floor), sglang-router and vllm-router (``round_robin``;
skipped with a note when not installed) and kvgate (``kvgate serve``, ``round_robin``, log level
warning; ``kvgate/uvicorn`` is the same on uvicorn instead of kvgate's HTTP server,
``kvgate/httpx`` with ``upstream_client: httpx``).  ``direct`` sends the load
straight to replica 0 (the baseline).

Load: wrk (``-t1``, ``--latency``) posting a chat body, streaming (the replica sends ``--chunks``
SSE events, each its own write) and not, at each ``--connections`` level.  One run interleaves
everything: for each round, for each cell, every target (starting one further along each round),
``--duration`` seconds each; the report takes medians over rounds.  Per target and cell: req/s,
latency p50/p99, added p50/p99 against ``direct`` in the same round, and the target's CPU time per
request (utime + stime of its process tree from /proc, before and after the cell, over the
requests completed).  The replica's CPU per request and the CPU other processes used during the
cell (noise) are recorded too.  Nothing is pinned.

Writes ``--out``/proxy.md and proxy.json; ``--readme FILE`` replaces the block between
``<!-- bench:proxy -->`` and ``<!-- /bench:proxy -->``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import httpx

from ..servers import free_port
from . import peers
from .procs import Proc
from .tables import markdown_table, replace_block

MODES = ("stream", "json")
DEFAULT_TARGETS = ("direct", "nginx", "sglang-router", "vllm-router", "kvgate", "kvgate/uvicorn",
                   "kvgate/httpx")
VARIANTS = {  # kvgate with one setting changed: what each of its parts buys, same run
    "kvgate/uvicorn": {"KVGATE_HTTP_SERVER": "uvicorn"},
    "kvgate/httpx": {"KVGATE_UPSTREAM_CLIENT": "httpx"},
}

WRK_SCRIPT = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{body}'
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRKJSON {{\\"requests\\":%d,\\"duration_us\\":%d,\\"bytes\\":%d,\\"connect\\":%d,\\"read\\":%d," ..
    "\\"write\\":%d,\\"status\\":%d,\\"timeout\\":%d,\\"p50\\":%d,\\"p90\\":%d,\\"p99\\":%d," ..
    "\\"max\\":%d,\\"mean\\":%.1f}}\\n",
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean))
end
"""


def request_body(mode: str, chunks: int) -> str:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say something short."}],
        "max_tokens": max(1, chunks - 2),  # role chunk + tokens + final chunk (the sim's framing)
    }
    if mode == "stream":
        body["stream"] = True
    return json.dumps(body, separators=(",", ":"))


@dataclass
class Cell:
    mode: str  # stream | json
    connections: int

    @property
    def name(self) -> str:
        return f"{self.mode} c={self.connections}"


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


@dataclass
class Target:
    name: str
    url: str  # base URL the load goes to
    proc: Proc | None  # None: direct (no process of its own)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=int, default=3, help="whole seconds per cell per round (default 3)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the report takes medians (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="whole seconds of load per target and mode before round 1")
    p.add_argument("--connections", default="1,32", help="concurrency levels (default 1,32)")
    p.add_argument("--modes", default="stream,json", help="stream, json or both (default both)")
    p.add_argument("--chunks", type=int, default=16, help="SSE events per streamed response (default 16)")
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                   help="comma-separated, from: " + ", ".join(DEFAULT_TARGETS) + " (default all)")
    p.add_argument("--compare-tree", action="append", default=[], metavar="NAME=DIR",
                   help="also run kvgate from another checkout DIR as target NAME (A/B of changes)")
    p.add_argument("--backend", choices=("mock", "sim"), default="mock",
                   help="mock: the asyncio mock replica (default); sim: kvgate sim --instant")
    p.add_argument("--mock-mode", choices=("spread", "burst"), default="spread",
                   help="mock stream writes: one per loop iteration (default) or back to back")
    p.add_argument("--wrk", default=None, help="wrk executable (default: from PATH)")
    p.add_argument("--wrk-threads", type=int, default=1)
    p.add_argument("--peers-bin", action="append", default=[], metavar="DIR",
                   help="extra folder to look for sglang-router / vllm-router / nginx in (repeatable)")
    p.add_argument("--out", default="bench-results", help="folder for proxy.md and proxy.json")
    p.add_argument("--readme", default=None, help="README to update between bench:proxy markers")


# ---------------------------------------------------------------------------------- processes
def backend_proc(kind: str, port: int, replicas: int, chunks: int, mock_mode: str) -> Proc:
    last = f"http://127.0.0.1:{port + replicas - 1}/health"
    if kind == "mock":
        argv = [sys.executable, "-m", "gateway.bench.mock_upstream", "--port", str(port),
                "--replicas", str(replicas), "--chunks", str(chunks), "--mode", mock_mode]
    else:
        argv = [sys.executable, "-m", "gateway.cli", "sim", "--replicas", str(replicas), "--port", str(port),
                "--instant", "--default-max-tokens", str(max(1, chunks - 2))]
    return Proc(f"replicas-{kind}", argv, last)


def build_targets(names: Sequence[str], urls: list[str], workdir: str, extra_dirs: Sequence[str],
                  compare: Sequence[str]) -> tuple[list[Target], list[str]]:
    """The targets to run and notes on the ones skipped."""
    targets: list[Target] = []
    notes: list[str] = []
    for name in names:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        try:
            if name == "direct":
                targets.append(Target(name, urls[0], None))
            elif name == "nginx":
                exe = peers.find_peer("nginx", [*extra_dirs, "/usr/sbin"])
                if exe is None:
                    notes.append("nginx: not installed (apt-get install nginx-light), skipped")
                    continue
                targets.append(Target(name, base, peers.nginx_proc(urls, port, os.path.join(workdir, "nginx"), exe=exe)))
            elif name in ("sglang-router", "vllm-router"):
                exe = peers.find_peer(name, extra_dirs)
                if exe is None:
                    notes.append(f"{name}: not installed (pip install {name}), skipped")
                    continue
                make = peers.sglang_router_proc if name == "sglang-router" else peers.vllm_router_proc
                targets.append(Target(name, base, make(urls, port, "round_robin", exe=exe)))
            elif name == "kvgate":
                targets.append(Target(name, base, peers.kvgate_proc(urls, port)))
            elif name in VARIANTS:
                proc = peers.kvgate_proc(urls, port, name=name.replace("/", "-"), env=VARIANTS[name])
                targets.append(Target(name, base, proc))
            else:
                raise SystemExit(f"unknown target {name!r}; known: {', '.join(DEFAULT_TARGETS)}")
        except FileNotFoundError as exc:
            notes.append(f"{name}: {exc}, skipped")
    for item in compare:
        label, sep, tree = item.partition("=")
        if not sep or not os.path.isdir(tree):
            raise SystemExit(f"--compare-tree takes NAME=DIR, got {item!r}")
        port = free_port()
        targets.append(Target(label, f"http://127.0.0.1:{port}",
                              peers.kvgate_proc(urls, port, name=label.replace("/", "_"), source_tree=tree)))
    return targets, notes


def check_target(t: Target, chunks: int) -> None:
    """One streamed and one plain request through the target must come back whole."""
    url = t.url + "/v1/chat/completions"
    with httpx.Client(timeout=10) as c:
        r = c.post(url, content=request_body("json", chunks), headers={"content-type": "application/json"})
        if r.status_code != 200 or "choices" not in r.json():
            raise RuntimeError(f"{t.name}: bad JSON answer {r.status_code}: {r.text[:200]}")
        r = c.post(url, content=request_body("stream", chunks), headers={"content-type": "application/json"})
        events = [ln for ln in r.text.split("\n") if ln.startswith("data: ")]
        if r.status_code != 200 or events[-1:] != ["data: [DONE]"] or len(events) < chunks:
            raise RuntimeError(f"{t.name}: bad stream {r.status_code}: {len(events)} events")


# ---------------------------------------------------------------------------------- measuring
_WRK_JSON = re.compile(r"^WRKJSON (\{.*\})$", re.M)


def run_wrk(wrk: str, url: str, script: str, connections: int, duration: int, threads: int) -> dict:
    argv = [wrk, f"-t{min(threads, connections)}", f"-c{connections}", f"-d{duration}s", "--latency",
            "--timeout", "10s", "-s", script, url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 30)
    m = _WRK_JSON.search(out.stdout)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stdout[-500:]} {out.stderr[-500:]}")
    return json.loads(m.group(1))


def measure(t: Target, cell: Cell, rnd: int, *, wrk: str, script: str, duration: int, threads: int,
            replica_pid: int) -> Sample:
    pid = t.proc.pid if t.proc else None
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0 = peers.machine_busy_seconds()
    cpu0 = peers.tree_cpu_seconds(pid) if pid else 0.0
    rep0 = peers.tree_cpu_seconds(replica_pid)
    res = run_wrk(wrk, t.url + "/v1/chat/completions", script, cell.connections, duration, threads)
    cpu1 = peers.tree_cpu_seconds(pid) if pid else 0.0
    rep1 = peers.tree_cpu_seconds(replica_pid)
    busy1 = peers.machine_busy_seconds()
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    wrk_cpu = (children1.ru_utime + children1.ru_stime) - (children0.ru_utime + children0.ru_stime)
    secs = res["duration_us"] / 1e6
    errors = res["connect"] + res["read"] + res["write"] + res["status"] + res["timeout"]
    others = max(0.0, (busy1 - busy0) - (cpu1 - cpu0) - (rep1 - rep0) - wrk_cpu)
    return Sample(
        target=t.name, cell=cell.name, round=rnd, requests=res["requests"], errors=errors, duration_s=secs,
        rps=res["requests"] / secs if secs else 0.0, p50_ms=res["p50"] / 1000, p90_ms=res["p90"] / 1000,
        p99_ms=res["p99"] / 1000, mean_ms=res["mean"] / 1000, target_cpu_s=cpu1 - cpu0,
        replica_cpu_s=rep1 - rep0, wrk_cpu_s=wrk_cpu, others_cpu_s=others,
    )


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


# ---------------------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> int:
    wrk = args.wrk or shutil.which("wrk")
    if wrk is None:
        print("kvgate bench proxy: wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    if args.duration < 1 or args.rounds < 1 or args.warmup < 0:
        raise SystemExit("--duration and --rounds must be >= 1 (wrk takes whole seconds)")
    connections = [int(c) for c in args.connections.split(",") if c.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not connections or any(c < 1 for c in connections) or set(modes) - set(MODES) or not modes:
        raise SystemExit("--connections takes positive integers; --modes takes stream and/or json")
    names = [n.strip() for n in args.targets.split(",") if n.strip()]
    if "direct" not in names:
        names.insert(0, "direct")  # the baseline for added latency
    cells = [Cell(m, c) for c in connections for m in modes]
    workdir = tempfile.mkdtemp(prefix="kvgate-bench-proxy-")
    log_dir = os.path.join(args.out, "logs")
    scripts = {}
    for mode in modes:
        scripts[mode] = os.path.join(workdir, f"{mode}.lua")
        with open(scripts[mode], "w", encoding="utf-8") as fh:
            fh.write(WRK_SCRIPT.format(body=request_body(mode, args.chunks)))
    first = free_port()
    urls = [f"http://127.0.0.1:{first + i}" for i in range(2)]
    backend = backend_proc(args.backend, first, 2, args.chunks, args.mock_mode)
    targets, notes = build_targets(names, urls, workdir, args.peers_bin, args.compare_tree)
    samples: list[Sample] = []
    started: list[Proc] = []
    try:
        backend.start(timeout=60, log_dir=log_dir)
        started.append(backend)
        for t in list(targets):
            try:
                if t.proc is not None:
                    t.proc.start(timeout=90, log_dir=log_dir)
                    started.append(t.proc)
                check_target(t, args.chunks)
            except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as exc:
                if t.name == "direct":
                    raise
                notes.append(f"{t.name}: did not start or answer properly ({exc}), skipped")
                print(f"skipping {t.name}: {exc}", file=sys.stderr)
                targets.remove(t)
        env = environment(wrk, args.peers_bin)
        if args.warmup > 0:
            for t in targets:
                for mode in modes:
                    run_wrk(wrk, t.url + "/v1/chat/completions", scripts[mode], max(connections), args.warmup,
                            args.wrk_threads)
        total = args.rounds * len(cells) * len(targets)
        done = 0
        for rnd in range(args.rounds):
            for cell in cells:
                order = targets[rnd % len(targets):] + targets[: rnd % len(targets)]
                for t in order:
                    s = measure(t, cell, rnd, wrk=wrk, script=scripts[cell.mode], duration=args.duration,
                                threads=args.wrk_threads, replica_pid=backend.pid)
                    samples.append(s)
                    done += 1
                    cpu = f"{s.cpu_us_per_req:6.0f} us/req" if t.proc else "      -      "
                    print(f"[{done:3d}/{total}] round {rnd + 1} {cell.name:<12} {t.name:<14} {s.rps:9,.0f} req/s "
                          f"p50 {s.p50_ms:6.2f} p99 {s.p99_ms:7.2f} ms  {cpu}  errors {s.errors}",
                          file=sys.stderr, flush=True)
    finally:
        for p in reversed(started):
            p.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    summaries = summarize(samples, targets, cells)
    print(write_report(summaries, samples, args, notes, env, connections))
    return 0
