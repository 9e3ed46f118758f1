"""The ``kvgate`` command line: serve, sim, demo (and more as they land)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from policies.errors import PolicyConfigError

from .errors import ConfigError

DESCRIPTION = """kvgate: a KV-cache-aware, OpenAI-compatible gateway for LLM replicas.

subcommands:
  serve   run the gateway in front of replicas (--replica URL, --config FILE, KVGATE_* env)
  sim     run simulated OpenAI-compatible LLM replicas with a prefix cache
  demo    run a gateway and 3 simulated replicas in one process, with usage examples
  up      run compose.yaml's services (gateways, replicas, redis, nginx...) as local processes
  agent   run a worker agent: tiered KV block store, block data port, KV events, control API
  bench   benchmarks (routing quality, proxy overhead, KV transfers, policy cost): `kvgate bench NAME --help`
"""

# name -> (module with add_arguments(parser) and run(args) -> int, one-line summary)
BENCHES = {
    "routing": ("gateway.bench.routing", "routing quality of every policy and the peer routers"),
    "proxy": ("gateway.bench.proxy", "gateway overhead against instant mock replicas"),
    "transfer": ("worker_agent.bench_transfer", "KV tier moves and transports vs the machine's limits"),
    "policy": ("policies.bench_policy", "per-request policy cost and the prefix index's memory"),
}


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (also KVGATE_CONFIG)")
    p.add_argument("--host", help="listen address (default 127.0.0.1; KVGATE_HOST)")
    p.add_argument("--port", type=int, help="listen port (default 8000; KVGATE_PORT)")
    p.add_argument(
        "--replica", action="append", dest="replicas", metavar="URL",
        help="replica base URL, repeatable (KVGATE_REPLICAS=url1,url2)",
    )
    p.add_argument("--policy", help="routing policy (default cache_aware; KVGATE_POLICY)")
    p.add_argument(
        "--policy-param", action="append", default=[], metavar="KEY=VALUE",
        help="policy parameter, repeatable",
    )
    p.add_argument("--log-level", help="debug|info|warning|error (default info)")
    p.add_argument("--api-key", action="append", dest="api_keys", metavar="KEY",
                   help="accepted client API key, repeatable (none: no auth)")
    p.add_argument("--redis", dest="redis_url", metavar="URL",
                   help="share sessions, prefix index and load with other gateways through Redis, "
                   "e.g. redis://10.0.0.5:6379/0 (default: embedded, this gateway only; KVGATE_REDIS_URL)")
    p.add_argument("--gateway-id", help="this gateway's id in the shared state "
                   "(default host:port plus a random suffix; KVGATE_GATEWAY_ID)")


def _serve_overrides(args: argparse.Namespace) -> dict:
    params: dict[str, str] = {}
    for item in args.policy_param:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--policy-param takes KEY=VALUE, got {item!r}")
        params[key] = value
    out = {
        "host": args.host, "port": args.port, "replicas": args.replicas, "policy": args.policy,
        "log_level": args.log_level, "api_keys": args.api_keys,
        "redis_url": args.redis_url, "gateway_id": args.gateway_id,
    }
    if params:
        out["policy_params"] = params
    return out


def build_parser() -> argparse.ArgumentParser:
    from .sim.cli_args import add_sim_arguments

    parser = argparse.ArgumentParser(
        prog="kvgate", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    serve = sub.add_parser("serve", help="run the gateway", description="Run the kvgate gateway.")
    _add_serve_args(serve)

    sim = sub.add_parser(
        "sim", help="run simulated LLM replicas",
        description="Simulated OpenAI-compatible replicas (prefix cache, timing model, fault knobs), "
        "several in one process on consecutive ports.",
    )
    sim.add_argument("--replicas", type=int, default=1, help="how many replicas (default 1)")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=9001, help="first port (default 9001)")
    add_sim_arguments(sim)

    demo = sub.add_parser(
        "demo", help="gateway + 3 simulated replicas in one process",
        description="Start a gateway and simulated replicas, print how to talk to them, "
        "run until Ctrl-C.",
    )
    demo.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    demo.add_argument("--replicas", type=int, default=3, help="simulated replicas (default 3)")
    demo.add_argument("--sim-port", type=int, default=9001, help="first replica port (default 9001)")
    demo.add_argument("--policy", default=None, help="routing policy (default: the gateway's default)")
    demo.add_argument("--log-level", default="warning")
    demo.add_argument(
        "--gateways", type=int, default=1,
        help="gateways sharing state, on consecutive ports (default 1); with 2 or more the demo "
        "starts a local redis-server when one is installed, else they share an embedded store",
    )
    demo.add_argument("--redis", dest="redis_url", metavar="URL",
                      help="with --gateways: share state through this Redis instead")

    from .up import add_up_arguments

    up = sub.add_parser(
        "up", help="run compose.yaml's services as local processes",
        description="Run the services of a compose file as local processes, without Docker "
        "(ports mapped as gateway/up.py documents), until Ctrl-C.",
    )
    add_up_arguments(up)

    from worker_agent.cli_args import add_agent_arguments  # argparse only: no torch, no zmq

    agent = sub.add_parser(
        "agent", help="run a worker agent (needs the 'agent' extra: torch, msgpack, pyzmq)",
        description="A worker agent: tiered KV block store, TCP data port, vLLM-format KV events "
        "over ZMQ (and the shared store with --redis-url), HTTP control API.",
    )
    add_agent_arguments(agent)

    bench = sub.add_parser(
        "bench", help="run a benchmark",
        description="Benchmarks that print tables and write markdown/JSON/PNG reports:\n"
        + "\n".join(f"  {n:<9} {summary}" for n, (_, summary) in BENCHES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("bench", choices=sorted(BENCHES), help="which benchmark")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="its options (see NAME --help)")
    return parser


def run_bench(name: str, argv: list[str]) -> int:
    import importlib

    module = importlib.import_module(BENCHES[name][0])
    parser = argparse.ArgumentParser(prog=f"kvgate bench {name}", description=BENCHES[name][1])
    module.add_arguments(parser)
    return module.run(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        return run_bench(args.bench, args.bench_args)
    from .servers import install_uvloop

    install_uvloop()
    try:
        if args.command == "serve":
            from .runner import run_serve

            return asyncio.run(run_serve(_serve_overrides(args), args.config, os.environ))
        if args.command == "sim":
            from .runner import run_sim

            return asyncio.run(run_sim(args))
        if args.command == "demo":
            from .runner import run_demo

            return asyncio.run(run_demo(args))
        if args.command == "up":
            from .up import run_up

            return run_up(args)
        if args.command == "agent":
            from worker_agent.cli_args import run_agent

            return asyncio.run(run_agent(args))
    except (ConfigError, PolicyConfigError) as exc:
        print(f"kvgate: configuration error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        if args.command != "agent":
            raise
        print(f"kvgate agent: {exc}; install the agent extra: pip install 'kvgate[agent]'",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
