"""``kvgate bench routing``: routing quality of every kvgate policy and the peer routers.

One run: for each workload, start simulated replicas (cache per replica = ``--cache-fraction`` of
the workload's distinct prefix blocks), then for each target start the router, warm it up, reset
the replicas' caches and counters, replay the workload's script (the same arrivals for everyone),
and stop it.  Targets: every kvgate policy (``cache_aware`` with its default ``migrate=auto``: the
simulated replicas advertise KV pulls from peers, ``--kv-bandwidth-gbps`` / ``--kv-block-bytes``,
so a spill may pull the holder's blocks), ``kvgate/cache_aware+migrate=false`` (the same without
pulls, as in front of engines that cannot pull), ``sglang-router`` (cache_aware), ``vllm-router``
(cache_aware, consistent_hash, sticky_least_loaded) when installed, and an oracle that hashes the
group/session straight to a replica (the best reachable hit rate with perfect affinity).  On
request (``--targets all,pooled``), ``pooled``: the script sent straight to one more simulated
replica that has every replica's slots and a cache that holds everything -- one first-come,
first-served queue over all the slots where every repeat is a hit, the best a router that serves
requests in their order of arrival can do; a router whose TTFT p50 is below it serves some
requests out of their turn (makes earlier ones wait longer than later ones).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
from dataclasses import asdict, dataclass

import httpx
import xxhash

from ..servers import free_port, free_port_block
from .loadgen import Result, percentile, run_workload
from .peers import find_peer, sglang_router_proc, vllm_router_proc
from .procs import Proc
from .routing_report import write_report
from .workloads import WORKLOADS, BenchRequest, Workload, footprint

KVGATE_POLICIES = ("round_robin", "least_load", "session", "prefix", "cache_aware")
NO_PULL = "kvgate/cache_aware+migrate=false"  # cache_aware where the engines cannot pull
POOLED = "pooled"  # one replica with all the slots and an unbounded cache, no router: the fair bound
PEERS = {
    "sglang-router/cache_aware": ("sglang-router", "cache_aware"),
    "vllm-router/cache_aware": ("vllm-router", "cache_aware"),
    "vllm-router/consistent_hash": ("vllm-router", "consistent_hash"),
    "vllm-router/sticky_least_loaded": ("vllm-router", "sticky_least_loaded"),
}


@dataclass
class Row:
    workload: str
    target: str
    requests: int
    failures: int
    hit_rate: float
    ideal_hit_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    throughput_rps: float
    max_over_mean_load: float
    per_replica: list[int]
    # tokens the replicas did not compute (cached, or pulled from a peer) over the prompt tokens
    # of everything they served, the gateway's own warms (``Decision.warm``) included: the work
    # a hit rate counted over client requests leaves out
    engine_hit_rate: float = 0.0
    # the mean says how much waiting there was in all, which no order of service changes: a
    # median can drop by making a few wait much longer (routing.json only, not the table)
    ttft_mean_ms: float = 0.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="comma-separated (default: all, as in the README table)")
    p.add_argument("--targets", default="all",
                   help="comma-separated target names, or 'all' ('all,pooled' adds the pooled reference)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--prefill-ms-per-token", type=float, default=0.1)
    p.add_argument("--decode-ms-per-token", type=float, default=10.0)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--kv-bandwidth-gbps", type=float, default=100.0,
                   help="replica-to-replica KV bandwidth of the simulated replicas, Gbit/s")
    p.add_argument("--kv-block-bytes", type=int, default=2 << 20,
                   help="KV bytes of one 16-token block (default 2 MiB: an 8B model)")
    p.add_argument("--cache-fraction", type=float, default=1 / 3,
                   help="per-replica cache as a fraction of the workload's distinct blocks")
    p.add_argument("--scale", type=float, default=1.0, help="fraction of each workload's requests")
    p.add_argument("--rate-scale", type=float, default=1.0,
                   help="multiplies each workload's arrival rate (e.g. 0.8: a load the replicas "
                        "sustain where the default rate overloads them)")
    p.add_argument("--rounds", type=int, default=1,
                   help="replay every workload this many times per target, targets in a rotated order "
                        "each round; the table reports each metric's median over the rounds")
    p.add_argument("--out", default="bench-results", help="folder for routing.md/json/png")
    p.add_argument("--readme", default=None, help="README to update between bench:routing markers")


def target_names(requested: str, *, need_peers: bool = False) -> list[str]:
    """The targets to run.  ``all`` leaves out the peer routers that are not installed, with a
    warning on stderr, or (``need_peers``: a table for the README) refuses to run without them;
    it does not include ``pooled``, which is named on its own (``all,pooled``)."""
    names = [f"kvgate/{p}" for p in KVGATE_POLICIES] + [NO_PULL]
    tools = {tool for tool, _ in PEERS.values()}
    found = {tool for tool in tools if find_peer(tool)}
    names += [n for n, (tool, _) in PEERS.items() if tool in found]
    names.append("oracle")
    wanted = [n.strip() for n in requested.split(",") if n.strip()]
    if "all" in wanted:  # "all", or e.g. "all,pooled"
        missing = sorted(tools - found)
        if missing:
            msg = f"peer routers not installed: {', '.join(missing)} (pip install -e '.[bench]')"
            if need_peers:
                raise SystemExit(f"{msg}; --readme compares against every peer")
            print(f"warning: {msg}; their targets are left out", file=sys.stderr)
        wanted = names + [n for n in wanted if n != "all"]
    unknown = [n for n in wanted if n not in names and n != POOLED]
    if unknown:
        raise SystemExit(f"unknown or unavailable target(s): {unknown}; available: {names + [POOLED]}")
    return list(dict.fromkeys(wanted))


def router_proc(name: str, urls: list[str], port: int, sim_args: dict) -> Proc | None:
    ready = f"http://127.0.0.1:{port}/health"
    if name in ("oracle", POOLED):
        return None
    if name.startswith("kvgate/"):
        policy = name.split("/", 1)[1].split("+", 1)[0]
        argv = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--policy", policy,
                "--log-level", "warning"]
        for u in urls:
            argv += ["--replica", u]
        if policy == "cache_aware":
            argv += ["--policy-param", f"prefill_ms_per_token={sim_args['prefill_ms_per_token']}",
                     "--policy-param", f"decode_ms_per_token={sim_args['decode_ms_per_token']}",
                     "--policy-param", f"max_running={sim_args['max_running']}"]
        if name == NO_PULL:  # the replicas advertise pulls (kvgate:kv_pull_info): ignore them
            argv += ["--policy-param", "migrate=false"]
        return Proc(name.replace("/", "_"), argv, ready)
    tool, policy = PEERS[name]
    make = sglang_router_proc if tool == "sglang-router" else vllm_router_proc
    proc = make(urls, port, policy)
    proc.name = name.replace("/", "_")  # its log file: one per target
    return proc


def oracle_route(urls: list[str]):
    def route(req: BenchRequest) -> str:
        seed = xxhash.xxh3_64_intdigest(req.key.encode())
        return max(urls, key=lambda u: xxhash.xxh3_64_intdigest(u.encode(), seed))
    return route


def _progress(label: str):
    def show(done: int, total: int) -> None:
        if sys.stderr.isatty() or done == total:
            width = 30
            filled = int(width * done / max(total, 1))
            sys.stderr.write(f"\r  {label:<34} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
            if done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()
    return show


def _sim_state(urls: list[str]) -> list[dict]:
    return [httpx.get(u + "/sim/state", timeout=5).json() for u in urls]


def _reset(urls: list[str]) -> None:
    for u in urls:
        httpx.post(u + "/sim/reset", timeout=5).raise_for_status()


def summarize(workload: Workload, target: str, results: list[Result], wall: float,
              per_replica: list[int], ideal: float, engine_hit: float = 0.0) -> Row:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttft = [r.ttft_s * 1000 for r in ok]
    e2e = [r.e2e_s * 1000 for r in ok]
    mean = sum(per_replica) / len(per_replica) if per_replica else 0
    return Row(
        workload.name, target, len(results), len(results) - len(ok), cached / prompt if prompt else 0.0,
        ideal, percentile(ttft, 0.5), percentile(ttft, 0.99), percentile(e2e, 0.5), percentile(e2e, 0.99),
        len(ok) / wall if wall else 0.0, max(per_replica) / mean if mean else 0.0, per_replica,
        engine_hit, statistics.fmean(ttft) if ttft else 0.0,
    )


def run_target(name: str, workload: Workload, urls: list[str], sim_args: dict, ideal: float,
               log_dir: str, pooled_url: str = "") -> Row:
    if name == POOLED:  # straight to the pooled replica, as the oracle goes straight to its pick
        urls = [pooled_url]
    port = free_port()
    proc = router_proc(name, urls, port, sim_args)
    if proc is not None:
        proc.start(timeout=90, log_dir=log_dir)
    try:
        base = f"http://127.0.0.1:{port}"
        route = oracle_route(urls) if proc is None else (lambda req: base)
        if proc is not None:  # warm the router's connections, then start from cold caches
            warm = httpx.post(base + "/v1/chat/completions", timeout=30, json={
                "model": workload.model, "max_tokens": 1, "messages": [{"role": "user", "content": "warm up"}]})
            if warm.status_code != 200:
                raise RuntimeError(f"{name}: warm-up failed with {warm.status_code}: {warm.text[:200]}")
        _reset(urls)
        results, wall = asyncio.run(run_workload(workload, route, progress=_progress(f"{workload.name} {name}")))
        states = _sim_state(urls)
        per_replica = [s["requests_served"] + s["requests_aborted"] for s in states]
        queried = sum(s["prefix_queries"] for s in states)
        # not computed: found in the replica's cache, or pulled from a peer's (migration)
        saved = sum(s["prefix_hits"] + s["kv_pulled_tokens"] for s in states)
        engine_hit = saved / queried if queried else 0.0
    finally:
        if proc is not None:
            proc.stop()
    return summarize(workload, name, results, wall, per_replica, ideal, engine_hit)


def rotated(targets: list[str], r: int) -> list[str]:
    """Round ``r``'s order: each target starts a round once in every len(targets) rounds, so none
    always follows the same one (or always runs first on freshly started replicas)."""
    k = r % len(targets) if targets else 0
    return targets[k:] + targets[:k]


def median_row(runs: list[Row]) -> Row:
    """One row for several runs of a target: the median of every measured figure, failures and
    requests summed, per-replica counts of the run with the median TTFT p99."""
    if len(runs) == 1:
        return runs[0]
    med = statistics.median
    by_p99 = sorted(runs, key=lambda r: r.ttft_p99_ms)[(len(runs) - 1) // 2]
    return Row(
        runs[0].workload, runs[0].target, sum(r.requests for r in runs), sum(r.failures for r in runs),
        med(r.hit_rate for r in runs), runs[0].ideal_hit_rate, med(r.ttft_p50_ms for r in runs),
        med(r.ttft_p99_ms for r in runs), med(r.e2e_p50_ms for r in runs), med(r.e2e_p99_ms for r in runs),
        med(r.throughput_rps for r in runs), med(r.max_over_mean_load for r in runs), by_p99.per_replica,
        med(r.engine_hit_rate for r in runs), med(r.ttft_mean_ms for r in runs),
    )


def warm_up(workload: Workload, urls: list[str]) -> None:
    """Replay the first requests straight to the replicas (then reset them): the first measured
    target must not pay for the simulator's own start (imports, first allocations)."""
    head = Workload(workload.name, workload.requests[: max(1, len(workload.requests) // 10)],
                    model=workload.model, params=workload.params)
    asyncio.run(run_workload(head, oracle_route(urls)))
    _reset(urls)


def _sim_proc(name: str, args: argparse.Namespace, replicas: int, port: int, cache_blocks: int,
              max_running: int, extra: tuple[str, ...] | list[str] = ()) -> Proc:
    """``kvgate sim`` with ``replicas`` replicas on ports from ``port``, at the bench's timings."""
    return Proc(name, [
        sys.executable, "-m", "gateway.cli", "sim", "--replicas", str(replicas), "--port", str(port),
        "--cache-blocks", str(cache_blocks), "--max-running", str(max_running),
        "--prefill-ms-per-token", str(args.prefill_ms_per_token),
        "--decode-ms-per-token", str(args.decode_ms_per_token), *extra],
        f"http://127.0.0.1:{port + replicas - 1}/health")


@contextlib.contextmanager
def _pooled_replica(args: argparse.Namespace, distinct_blocks: int, log_dir: str):
    """The ``pooled`` target's replica: every replica's slots in one, a cache twice the
    workload's distinct blocks (it never evicts); yields its URL."""
    port = free_port()
    proc = _sim_proc("pooled", args, 1, port, max(16, 2 * distinct_blocks), args.replicas * args.max_running)
    with proc.start(timeout=60, log_dir=log_dir):
        yield f"http://127.0.0.1:{port}"


def _scaled(name: str, scale: float, rate_scale: float = 1.0) -> Workload:
    """Workload ``name`` with ``scale`` of its requests, arriving at ``rate_scale`` x its rate."""
    if scale <= 0 or rate_scale <= 0:
        raise SystemExit("--scale and --rate-scale must be > 0")
    factory = WORKLOADS[name]
    w = factory()
    if scale != 1.0 or rate_scale != 1.0:
        n = max(10, int(w.params["requests"] * scale))
        w = factory(requests=n, rate=w.params["rate"] * rate_scale)
    return w


def run(args: argparse.Namespace) -> int:
    targets = target_names(args.targets, need_peers=bool(args.readme))
    rows: list[Row] = []
    sim_args = dict(prefill_ms_per_token=args.prefill_ms_per_token, decode_ms_per_token=args.decode_ms_per_token,
                    max_running=args.max_running, kv_bandwidth_gbps=args.kv_bandwidth_gbps,
                    kv_block_bytes=args.kv_block_bytes)
    log_dir = os.path.join(args.out, "logs")
    all_runs: list[dict] = []
    for wname in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        if wname not in WORKLOADS:
            raise SystemExit(f"unknown workload {wname!r}; known: {sorted(WORKLOADS)}")
        workload = _scaled(wname, args.scale, args.rate_scale)
        fp = footprint(workload)
        cache_blocks = max(16, int(fp.distinct_blocks * args.cache_fraction))
        first = free_port_block(args.replicas)
        sims = _sim_proc("sims", args, args.replicas, first, cache_blocks, args.max_running,
                         ["--kv-bandwidth-gbps", str(args.kv_bandwidth_gbps),
                          "--kv-block-bytes", str(args.kv_block_bytes)])
        urls = [f"http://127.0.0.1:{first + i}" for i in range(args.replicas)]
        print(f"{wname}: {len(workload.requests)} requests over {workload.duration_s:.0f}s, "
              f"ideal hit rate {fp.ideal_hit_rate:.1%}, {fp.distinct_blocks} distinct blocks, "
              f"{cache_blocks} cached blocks per replica", file=sys.stderr)
        with contextlib.ExitStack() as stack:
            stack.enter_context(sims.start(timeout=60, log_dir=log_dir))
            warm_up(workload, urls)
            pooled_url = ""
            if POOLED in targets:
                pooled_url = stack.enter_context(_pooled_replica(args, fp.distinct_blocks, log_dir))
                warm_up(workload, [pooled_url])
            runs: dict[str, list[Row]] = {name: [] for name in targets}
            for r in range(max(1, args.rounds)):
                for name in rotated(targets, r):
                    runs[name].append(run_target(name, workload, urls, sim_args, fp.ideal_hit_rate, log_dir,
                                                 pooled_url))
            rows += [median_row(runs[name]) for name in targets]
            all_runs.extend(asdict(row) | {"round": i} for name in targets for i, row in enumerate(runs[name]))
        write_report(rows, args, final=False, runs=all_runs)  # keep what was measured so far
    write_report(rows, args, runs=all_runs)
    return 0
