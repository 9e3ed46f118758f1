"""What the CLI subcommands run: servers built from config, on one event loop."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
from collections.abc import Mapping

from .app import build_app
from .config import GatewayConfig, ReplicaConfig, load_config
from .logs import setup_logging
from .servers import ServerGroup, ServerSpec

log = logging.getLogger("kvgate")


def gateway_spec(cfg: GatewayConfig, **app_kwargs) -> ServerSpec:
    """A server for a gateway; ``app_kwargs`` go to :class:`GatewayApp` (e.g. a shared ``store``)."""
    return ServerSpec(build_app(cfg, **app_kwargs), cfg.host, cfg.port,
                      graceful_timeout=cfg.shutdown_grace_s, server=cfg.http_server)


async def run_serve(overrides: Mapping, config_file: str | None, env: Mapping[str, str]) -> int:
    cfg = load_config(overrides, env, config_file)
    setup_logging(cfg.log_level)
    if not cfg.replicas:
        log.warning("no replicas configured: every inference request will get 503")
    group = ServerGroup([gateway_spec(cfg)])
    log.warning("kvgate serving on http://%s:%d (policy %s)", cfg.host, cfg.port, cfg.policy)
    await group.run_until_signal(settle_gc)
    return 0


def settle_gc() -> None:
    """Once a server process is up: what start-up built (modules, the app, what its lifespan made)
    lives as long as the process, so move it out of the cyclic GC's reach, and its collections
    stop walking it (full ones took 20-40 ms under load).  After start-up, not before: the
    lifespan builds the proxy, the policy's tables and the metrics."""
    gc.collect()
    gc.freeze()


def sim_specs(n: int, host: str, first_port: int, config) -> list[ServerSpec]:
    from .sim.runner import sim_specs as specs

    return specs(n, host, first_port, config)


async def run_sim(args: argparse.Namespace) -> int:
    from .sim.cli_args import sim_config_from_args

    setup_logging("warning")
    config = sim_config_from_args(args)
    group = ServerGroup(sim_specs(args.replicas, args.host, args.port, config))
    for i in range(args.replicas):
        print(f"sim replica {i}: http://{args.host}:{args.port + i}/v1 (model {config.model})", flush=True)
    await group.run_until_signal(settle_gc)
    return 0


DEMO_HELP = """
kvgate demo is up: gateway {base} in front of {n} simulated replicas ({replicas}).

  curl {base}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}' -i

  python -c "from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello!'}}]))"

Response headers x-kvgate-replica / x-kvgate-policy / x-kvgate-predicted-cached-tokens say where each
request went and why; usage.prompt_tokens_details.cached_tokens says what the replica had cached.
Metrics: {base}/metrics   Replicas: {base}/admin/replicas   Stop: Ctrl-C
"""


async def run_demo(args: argparse.Namespace) -> int:
    from .sim.config import SimConfig

    sim_cfg = SimConfig()
    host = "127.0.0.1"
    urls = [f"http://{host}:{args.sim_port + i}" for i in range(args.replicas)]
    overrides: dict = {"port": args.port, "log_level": args.log_level}
    if args.policy:
        overrides["policy"] = args.policy
    cfg = load_config(overrides, env={})
    cfg = GatewayConfig(**{**cfg.__dict__, "replicas": tuple(ReplicaConfig(u) for u in urls)}).validate()
    setup_logging(cfg.log_level)
    n_gateways = max(1, getattr(args, "gateways", 1) or 1)
    redis_url = getattr(args, "redis_url", None) or ""
    local_redis = shared_store = None
    if n_gateways > 1 and not redis_url:
        redis_url, local_redis, shared_store = await _demo_store()
    cfgs = [
        dataclasses.replace(cfg, port=cfg.port + i, redis_url=redis_url, gateway_id=f"demo-gw{i}").validate()
        if n_gateways > 1 else cfg
        for i in range(n_gateways)
    ]
    sims = ServerGroup(sim_specs(args.replicas, host, args.sim_port, sim_cfg))
    try:
        await sims.start()
        gateway = ServerGroup([gateway_spec(c, store=shared_store) for c in cfgs])
        base = f"http://{cfg.host}:{cfg.port}"
        print(DEMO_HELP.format(base=base, n=args.replicas, replicas=", ".join(urls), model=sim_cfg.model), flush=True)
        if n_gateways > 1:
            shared = redis_url or "an embedded store (no redis-server found)"
            others = ", ".join(f"http://{c.host}:{c.port}" for c in cfgs)
            print(f"{n_gateways} gateways share sessions, prefixes and load through {shared}: {others}\n"
                  "send a session's turns to either one; GET /health shows the store.", flush=True)
        await gateway.run_until_signal()
    finally:
        await sims.stop()
        if local_redis is not None:
            await asyncio.to_thread(local_redis.stop)
    print("kvgate demo stopped", flush=True)
    return 0


async def _demo_store():
    """A redis-server of our own on a free port when one is installed, else one shared MemoryStore."""
    from .state import MemoryStore
    from .state.redis_server import LocalRedis, find_redis_server

    if find_redis_server() is None:
        return "", None, MemoryStore()
    server = LocalRedis()
    try:
        await asyncio.to_thread(server.start)
    except (OSError, RuntimeError) as exc:
        log.warning("could not start redis-server (%s); using an embedded shared store", exc)
        return "", None, MemoryStore()
    return server.url, server, None
