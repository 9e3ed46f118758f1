"""Shared-state benchmark: ``python -m gateway.state.bench`` prints a table.

* propagation, sync layer: gateway A records a routing decision, gateway B has it in its local
  view (``on_apply``), both StateSyncs in this process (one clock), paced at ``--rate`` per second.
* propagation, gateways: two real gateways (uvicorn) in front of instant mock replicas; requests go
  to A; the lag from A's decision to B's apply (wall clocks, same host); then the same prompts are
  sent to B and must land on the replica A chose ("agree").
* request-path overhead: one gateway with the memory backend and one with Redis (plus a peer
  gateway tailing it), sequential requests in alternating rounds, p50/p99 end to end.
* Redis outage: two gateways under load while redis-server is stopped for ``--outage-s`` seconds;
  failed requests and how long the store was reported down.
* failover: gateway A (its own process) and B share Redis in front of simulated replicas with
  prefix caches; A's view has replica 0 drained, so B only matches A's placements through the
  store.  A is SIGKILLed under load and B takes all its sessions: hit rate before and after.

Needs ``redis-server`` on PATH (or /usr/bin) for the Redis rows; it starts its own on a free port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

import httpx

from policies import PolicyDeps

from ..config import GatewayConfig, ReplicaConfig
from ..servers import ServerGroup, free_port
from .redis_server import LocalRedis, find_redis_server
from .store import MemoryStore
from .sync import StateSync, SyncSettings

CHAT = "/v1/chat/completions"


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))] if xs else float("nan")


def row(name: str, backend: str, xs_s: list[float], extra: str = "") -> list[str]:
    ms = [x * 1000 for x in xs_s]
    return [name, backend, str(len(ms)), f"{pct(ms, 0.5):.2f}", f"{pct(ms, 0.99):.2f}",
            f"{max(ms):.2f}" if ms else "-", extra]


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in rows)])


def make_store(kind: str, redis: LocalRedis | None, ns: str):
    if kind == "memory":
        return MemoryStore()
    from .redis_store import RedisStore

    return RedisStore(redis.url, namespace=ns)


async def bench_sync(kind: str, redis, n: int, rate: float) -> list[str]:
    ns = f"bench-sync-{time.time_ns()}"
    first = make_store(kind, redis, ns)
    stores = [first, first if kind == "memory" else make_store(kind, redis, ns)]
    a = StateSync(stores[0], PolicyDeps(), None, "A")
    b = StateSync(stores[1], PolicyDeps(), None, "B")
    sent: dict[int, float] = {}
    lags: list[float] = []
    done = asyncio.Event()

    def applied(ev) -> None:
        lags.append(time.perf_counter() - sent[ev.hashes[0]])
        if len(lags) == n:
            done.set()

    b.on_apply = applied
    await a.start(5.0)
    await b.start(5.0)
    try:
        for i in range(n):
            sent[i] = time.perf_counter()
            a.record(f"r{i % 4}", (i, 10**9 + i), f"s{i}")
            await asyncio.sleep(1 / rate)
        await asyncio.wait_for(done.wait(), 30)
    finally:
        await a.stop()
        await b.stop()
        if kind == "redis":
            await stores[0].delete_namespace()
            for s in stores:
                await s.close()
    return row("propagation, sync layer", kind, lags, f"{rate:.0f} decisions/s")


@contextlib.asynccontextmanager
async def gateways(n: int, kind: str, redis, replica_urls: list[str], **app_kwargs):
    from ..runner import gateway_spec

    store = MemoryStore() if kind == "memory" else None
    url = redis.url if kind == "redis" else ""
    groups, apps, bases = [], [], []
    try:
        for i in range(n):
            cfg = GatewayConfig(port=free_port(), replicas=tuple(ReplicaConfig(u) for u in replica_urls),
                                policy="cache_aware", log_level="warning", redis_url=url,
                                gateway_id=f"bench-{kind}-{i}").validate()
            spec = gateway_spec(cfg, store=store, **app_kwargs)
            group = ServerGroup([spec])
            await group.start()
            groups.append(group)
            apps.append(spec.app)
            bases.append(f"http://127.0.0.1:{cfg.port}")
        yield bases, apps
    finally:
        for g in groups:
            await g.stop()


def body(i: int, words: int = 200) -> dict:
    return {"model": "tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": f"prompt {i}: " + "lorem ipsum " * words}]}


async def bench_gateways(kind: str, redis, urls: list[str], n: int) -> list[str]:
    lags: list[float] = []
    async with gateways(2, kind, redis, urls) as (bases, apps), httpx.AsyncClient(timeout=10) as c:
        apps[1].state.sync.on_apply = lambda ev: lags.append(time.time() - ev.wall_us / 1e6)
        sem = asyncio.Semaphore(4)
        chosen: dict[int, str] = {}

        async def one(i: int) -> None:
            async with sem:
                r = await c.post(bases[0] + CHAT, json=body(i))
                chosen[i] = r.headers["x-kvgate-replica"]

        await asyncio.gather(*(one(i) for i in range(n)))
        agree = 0
        for i in range(0, n, max(1, n // 50)):
            r = await c.post(bases[1] + CHAT, json=body(i))
            agree += r.headers["x-kvgate-replica"] == chosen[i]
        checked = len(range(0, n, max(1, n // 50)))
    return row("propagation, gateways", kind, lags, f"agree {agree}/{checked}")


async def bench_overhead(redis, urls: list[str], rounds: int, per_round: int) -> list[list[str]]:
    samples: dict[str, list[float]] = {"memory": [], "redis": []}
    async with contextlib.AsyncExitStack() as stack:
        c = await stack.enter_async_context(httpx.AsyncClient(timeout=10))
        mem, _ = await stack.enter_async_context(gateways(1, "memory", None, urls))
        red, _ = await stack.enter_async_context(gateways(1, "redis", redis, urls))
        targets = {"memory": mem[0], "redis": red[0]}
        for base in targets.values():  # warm up connections and caches
            for i in range(50):
                await c.post(base + CHAT, json=body(i, 50))
        for r in range(rounds):
            for kind in (("memory", "redis") if r % 2 == 0 else ("redis", "memory")):
                for i in range(per_round):
                    t0 = time.perf_counter()
                    resp = await c.post(targets[kind] + CHAT, json=body(r * per_round + i, 50))
                    samples[kind].append(time.perf_counter() - t0)
                    assert resp.status_code == 200
    base = pct(samples["memory"], 0.5)
    return [row("request latency", k, v, f"p50 x{pct(v, 0.5) / base:.3f} of memory")
            for k, v in samples.items()]


async def bench_outage(redis: LocalRedis, urls: list[str], outage_s: float) -> list[str]:
    fast = SyncSettings(heartbeat_s=0.2, load_ttl_s=1.0, op_timeout_s=0.5, block_s=0.5)
    results: list[int] = []
    lat: list[float] = []
    async with gateways(2, "redis", redis, urls, sync_settings=fast) as (bases, apps), \
            httpx.AsyncClient(timeout=10) as c:
        stop = asyncio.Event()

        async def load(w: int) -> None:
            i = w
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    r = await c.post(bases[i % 2] + CHAT, json=body(i % 64, 50))
                    results.append(r.status_code)
                except httpx.HTTPError:
                    results.append(0)
                lat.append(time.perf_counter() - t0)
                i += 8

        tasks = [asyncio.create_task(load(w)) for w in range(8)]
        await asyncio.sleep(1.0)
        await asyncio.to_thread(redis.stop)
        t_down = time.monotonic()
        await asyncio.sleep(outage_s)
        degraded = [(await c.get(b + "/health")).json()["status"] for b in bases]
        await asyncio.to_thread(redis.start)
        while [(await c.get(b + "/health")).json()["status"] for b in bases] != ["ok", "ok"]:
            await asyncio.sleep(0.05)
        recovered = time.monotonic() - t_down - outage_s
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*tasks)
    failed = sum(1 for s in results if s != 200)
    return row(f"redis stopped {outage_s:.0f} s under load", "redis", lat,
               f"{len(results)} requests, {failed} failed; health during: {'/'.join(degraded)}; "
               f"ok again {recovered:.2f} s after restart")


async def bench_failover(redis: LocalRedis, requests: int) -> list[str]:
    """Gateway A (its own process, replica 0 drained in its view) is SIGKILLed under load; B serves
    everything.  Hit rate = cached / prompt tokens reported by the simulated replicas."""
    import os
    import signal
    import subprocess
    import sys

    from ..runner import sim_specs
    from ..sim.config import SimConfig

    ports = [free_port() for _ in range(3)]
    sims = ServerGroup([spec for i, p in enumerate(ports) for spec in sim_specs(1, "127.0.0.1", p, SimConfig(seed=i))])
    await sims.start()
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    docs = [f"Reference document {d}. " + f"fact {d} " * 150 for d in range(12)]
    port_a = free_port()
    a = f"http://127.0.0.1:{port_a}"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port_a), "--policy", "cache_aware",
           "--redis", redis.url, "--gateway-id", "bench-a", "--log-level", "error"]
    for u in urls:
        cmd += ["--replica", u]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        async with gateways(1, "redis", redis, urls) as (bases, _), httpx.AsyncClient(timeout=10) as c:
            b = bases[0]
            for _ in range(300):
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get(a + "/ready")).status_code == 200:
                        break
                await asyncio.sleep(0.1)
            await c.post(f"{a}/admin/replicas/{urls[0].split('://')[1]}/drain")
            alive = [True]
            phases: dict[str, list[tuple[int, int, int]]] = {"warm": [], "before": [], "after": []}
            phase = ["warm"]

            async def load(w: int) -> None:
                i = w
                while phase[0] != "stop":
                    sid = i % len(docs)
                    base = a if alive[0] and sid % 2 == 0 else b
                    msgs = [{"role": "system", "content": docs[sid]}, {"role": "user", "content": f"q{i}"}]
                    bucket = phases.get(phase[0], [])
                    try:
                        r = await c.post(base + CHAT, json={"model": "tiny", "messages": msgs, "max_tokens": 4},
                                         headers={"x-session-id": f"doc{sid}"})
                        u = r.json().get("usage", {}) if r.status_code == 200 else {}
                        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                        bucket.append((r.status_code, cached, u.get("prompt_tokens", 0)))
                    except httpx.HTTPError:
                        bucket.append((0, 0, 0))
                    i += 4

            tasks = [asyncio.create_task(load(w)) for w in range(4)]
            for name in ("warm", "before"):
                phase[0] = name
                while len(phases[name]) < requests:
                    await asyncio.sleep(0.01)
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait)
            alive[0] = False
            phase[0] = "settle"
            await asyncio.sleep(0.2)
            phase[0] = "after"
            while len(phases["after"]) < requests:
                await asyncio.sleep(0.01)
            phase[0] = "stop"
            await asyncio.gather(*tasks)
    finally:
        if proc.poll() is None:
            proc.kill()
        await sims.stop()

    def hit(xs) -> float:
        ok = [x for x in xs if x[0] == 200]
        return sum(x[1] for x in ok) / max(1, sum(x[2] for x in ok))

    before, after = hit(phases["before"]), hit(phases["after"])
    failed = sum(1 for x in phases["after"] if x[0] != 200)
    return ["kill gateway A under load", "redis", str(2 * requests), "-", "-", "-",
            f"hit rate {before:.3f} before, {after:.3f} after on B ({after / before:.3f}x); "
            f"{failed} failed after"]


async def main_async(args: argparse.Namespace) -> None:
    from ..bench.mock_upstream import serve as serve_mock

    ports = [free_port() for _ in range(3)]
    mocks = await serve_mock("127.0.0.1", ports, chunks=4)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    redis = LocalRedis() if find_redis_server() else None
    if redis is not None:
        await asyncio.to_thread(redis.start)
    kinds = ["memory"] + (["redis"] if redis is not None else [])
    rows: list[list[str]] = []
    try:
        for kind in kinds:
            rows.append(await bench_sync(kind, redis, args.events, args.rate))
            rows.append(await bench_sync(kind, redis, 50, 20.0))
        for kind in kinds:
            rows.append(await bench_gateways(kind, redis, urls, args.requests))
        if redis is not None:
            rows.extend(await bench_overhead(redis, urls, args.rounds, args.per_round))
            if args.outage_s > 0:
                rows.append(await bench_outage(redis, urls, args.outage_s))
            rows.append(await bench_failover(redis, args.failover_requests))
    finally:
        for m in mocks:
            m.close()
        if redis is not None:
            await asyncio.to_thread(redis.stop)
    print(table(["what", "backend", "n", "p50 ms", "p99 ms", "max ms", "notes"], rows))
    if redis is None:
        print("\n(redis-server not found: Redis rows skipped)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.state.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=1000, help="sync-layer decisions (default 1000)")
    p.add_argument("--rate", type=float, default=500.0, help="sync-layer decisions per second")
    p.add_argument("--requests", type=int, default=400, help="requests for gateway propagation")
    p.add_argument("--rounds", type=int, default=10, help="alternating overhead rounds")
    p.add_argument("--per-round", type=int, default=200, help="requests per overhead round")
    p.add_argument("--outage-s", type=float, default=10.0, help="Redis outage length (0: skip)")
    p.add_argument("--failover-requests", type=int, default=200, help="requests per failover phase")
    args = p.parse_args(argv)
    from ..servers import install_uvloop

    install_uvloop()
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
