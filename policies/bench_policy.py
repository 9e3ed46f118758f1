"""Microbenchmark: per-request policy cost and prefix-index memory.

Run ``kvgate bench policy`` or ``python -m policies.bench_policy`` (``--help`` for options).
For every policy it measures the per-request cost (below) at ``--replicas`` replicas with
``--hashes``-hash prompts (512 hashes x 64 tokens = 32k tokens) against a warm index:

* ``warm``: the next turn of a known conversation (its chain + 1 new hash; mostly a hit),
* ``cold``: a prompt nobody has seen (512 new hashes to record),

the p50 of ``select`` alone (the decision, on the request's path; the hooks are bookkeeping),
and the index's memory per million recorded blocks, measured with tracemalloc (hash ints
included).

``--rounds`` repeats every policy's run (each on fresh state, the policies in turn within a
round) and reports the median of each figure: one run's mean moves by a third between runs on a
shared machine.

A request's cost is everything the gateway calls for it: ``select``, ``on_dispatch``, and later
``on_first_token`` and ``on_complete``.  The benchmark keeps ``--in-flight`` requests outstanding
(8 per replica by default) and finishes the oldest after each dispatch, so the policy's
per-request state sits at the size a steady load gives it (with no request ever finishing, the
in-flight bookkeeping grows to its caps, which no gateway reaches).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc
from collections import deque

from . import PolicyDeps, PrefixIndex, default_registry, native
from .base import rendezvous_order
from .types import ClusterView, Outcome, ReplicaState, RequestFeatures

POLICIES = ("round_robin", "random", "least_load", "session", "prefix", "cache_aware")


def _chain(rng: random.Random, n: int, prefix: tuple[int, ...] = ()) -> tuple[int, ...]:
    return prefix + tuple(rng.getrandbits(64) for _ in range(n))


def _view(rng: random.Random, n: int) -> ClusterView:
    return ClusterView(
        tuple(
            ReplicaState(f"r{i}", in_flight=rng.randint(0, 12), models=frozenset({"m"}))
            for i in range(n)
        )
    )


def _features(chain: tuple[int, ...], key: str | None) -> RequestFeatures:
    return RequestFeatures("m", chain, 64, len(chain) * 64, 256, key)


def _finish(policy, req: RequestFeatures, decision) -> None:
    """What the gateway reports once the request's first token and its end came back."""
    policy.on_first_token(req, decision.replica)
    cached = decision.predicted_cached_tokens
    policy.on_complete(req, decision.replica, Outcome(True, req.prompt_tokens, cached, 0.3, 0.02, cached))


def bench_policy(name: str, replicas: int, hashes: int, sessions: int, requests: int,
                 in_flight: int | None = None) -> dict:  # fmt: skip
    window = 8 * replicas if in_flight is None else in_flight
    rng = random.Random(1)
    deps = PolicyDeps(clock=time.monotonic, index=PrefixIndex(default_capacity=1 << 17))
    policy = default_registry().build(name, {}, deps)
    system = _chain(rng, 32)
    convs = [_chain(rng, hashes - 32 - 1, system) for _ in range(sessions)]
    outstanding: deque = deque()
    for i, chain in enumerate(convs):  # warm the index and the session table
        view = _view(rng, replicas)
        req = _features(chain, f"s{i}")
        decision = policy.select(req, view)
        policy.on_dispatch(req, decision, view)
        outstanding.append((req, decision))
        if len(outstanding) > window:
            _finish(policy, *outstanding.popleft())
    out = {}
    for scenario in ("warm", "cold"):
        reqs = []
        for _ in range(requests):
            i = rng.randrange(sessions)
            if scenario == "warm":
                convs[i] = _chain(rng, 1, convs[i])
                reqs.append(_features(convs[i], f"s{i}"))
            else:
                reqs.append(_features(_chain(rng, hashes - 32, system), f"new{rng.random()}"))
        views = [_view(rng, replicas) for _ in range(64)]
        times = []
        picks = []  # select alone: the part on the request's path before it is sent
        clock = time.perf_counter_ns
        gc.disable()
        for k, req in enumerate(reqs):
            v = views[k % 64]
            t0 = clock()
            decision = policy.select(req, v)
            t1 = clock()
            policy.on_dispatch(req, decision, v)
            outstanding.append((req, decision))
            if len(outstanding) > window:
                _finish(policy, *outstanding.popleft())
            times.append(clock() - t0)
            picks.append(t1 - t0)
        gc.enable()
        times.sort()
        out[scenario] = (
            statistics.fmean(times) / 1e3,
            times[len(times) // 2] / 1e3,
            times[int(len(times) * 0.99)] / 1e3,
            statistics.median(picks) / 1e3,
        )
    return out


def bench_memory(blocks: int, chain_len: int, replicas: int, copies: int) -> tuple[float, float]:
    """Bytes per recorded block (and per block-holding) for ``blocks`` distinct blocks."""
    ids = [f"r{i}" for i in range(replicas)]
    states = [ReplicaState(r) for r in ids]
    rng = random.Random(2)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(default_capacity=blocks, max_total_blocks=blocks)
    for _ in range(blocks // chain_len):
        chain = _chain(rng, chain_len)
        for r in rendezvous_order(chain[0], states)[:copies]:
            index.insert(r.id, chain)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    total = index.stats()["total_blocks"]
    return used / total, used / (total * copies)


def _median_run(runs: list[dict]) -> dict:
    """Each scenario's (mean, p50, p99, select p50), each the median over the runs."""
    return {
        s: tuple(statistics.median(r[s][i] for r in runs) for i in range(4)) for s in ("warm", "cold")
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--hashes", type=int, default=512, help="prefix hashes per prompt (x64 tokens)")
    ap.add_argument("--sessions", type=int, default=400, help="conversations in the warm index")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--in-flight", type=int, default=None,
                    help="requests outstanding at once (default 8 per replica)")
    ap.add_argument("--memory-blocks", type=int, default=1 << 20)
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="runs per policy; medians are reported")


def run(args: argparse.Namespace) -> int:
    """Print the cost table (and each policy's mean against round_robin's in the same run) and
    the index's memory per million blocks."""
    names = [n for n in args.policies.split(",") if n]
    unknown = sorted(set(names) - set(POLICIES))
    if unknown:
        raise SystemExit(f"unknown policies: {', '.join(unknown)} (known: {', '.join(POLICIES)})")
    print(
        f"per request: select + on_dispatch + on_first_token + on_complete, {args.replicas} "
        f"replicas, {args.hashes} hashes ({args.hashes * 64} tokens), {args.sessions} warm "
        f"conversations, {args.in_flight or 8 * args.replicas} in flight, microseconds, median of "
        f"{max(1, args.rounds)} run(s); policy modules "
        f"{'compiled (mypyc)' if native.compiled() else 'from source'}"
    )
    print(
        f"{'policy':<12} {'warm mean':>10} {'p50':>8} {'p99':>8} {'select':>7}   {'cold mean':>10} "
        f"{'p50':>8} {'p99':>8} {'select':>7}   {'warm x rr':>9} {'cold x rr':>9}"
    )
    sizes = (args.replicas, args.hashes, args.sessions, args.requests, args.in_flight)
    order = ["round_robin", *[n for n in names if n != "round_robin"]]
    runs: dict[str, list[dict]] = {n: [] for n in order}
    for _ in range(max(1, args.rounds)):
        for name in order:
            runs[name].append(bench_policy(name, *sizes))
    results = {n: _median_run(r) for n, r in runs.items()}
    base = results["round_robin"]
    for name in names:
        w, c = results[name]["warm"], results[name]["cold"]
        print(
            f"{name:<12} {w[0]:>10.1f} {w[1]:>8.1f} {w[2]:>8.1f} {w[3]:>7.1f}   {c[0]:>10.1f} "
            f"{c[1]:>8.1f} {c[2]:>8.1f} {c[3]:>7.1f}   {w[0] / base['warm'][0]:>9.1f} "
            f"{c[0] / base['cold'][0]:>9.1f}"
        )
    for copies in (1, 2):
        per_block, per_holding = bench_memory(
            args.memory_blocks, args.hashes, args.replicas, copies
        )
        print(
            f"index memory, {args.memory_blocks} distinct blocks held by {copies} replica(s) each: "
            f"{per_block:.0f} B/block -> {per_block:.0f} MB per million blocks "
            f"({per_holding:.0f} B per replica-block)"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
