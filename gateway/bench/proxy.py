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
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from ..servers import free_port
from . import peers
from .procs import Proc
from .proxy_report import (  # noqa: F401  (re-exported: tests use them as bench.*)
    HEADERS,
    MODES,
    Sample,
    Summary,
    environment,
    goals,
    summarize,
    table,
    write_report,
)

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
