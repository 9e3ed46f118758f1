"""argparse wiring for ``kvgate agent`` (imports neither torch nor zmq: the gateway's CLI builds
its parser without them; ``run_agent`` imports the service only when the command runs)."""

from __future__ import annotations

import argparse
import sys

_GIB = 1 << 30


def add_agent_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="agent", help="agent name (events, logs, shared store)")
    p.add_argument("--host", default="127.0.0.1", help="control API address")
    p.add_argument("--port", type=int, default=8100, help="control API port (default 8100)")
    p.add_argument("--data-host", default=None, help="data port address (default: --host)")
    p.add_argument("--data-port", type=int, default=8101, help="TCP block port (0: any free)")
    p.add_argument("--data-unix", metavar="PATH", default=None,
                   help="also serve blocks on this Unix socket: the engine-local connector's "
                        "cheap way in (peer address unix:PATH)")
    p.add_argument("--events", default="tcp://*:5557",
                   help="ZMQ PUB endpoint for vLLM-format KV events ('*' binds, else connects; "
                   "'none' disables)")  # fmt: skip
    p.add_argument("--replay", default=None, help="ZMQ ROUTER endpoint for event replays")
    p.add_argument("--topic", default="kv-events", help="ZMQ topic (default kv-events)")
    p.add_argument("--redis-url", default="",
                   help="shared store: also publish held prefixes to the gateways' Redis stream")
    p.add_argument("--replica-id", default="",
                   help="the gateway's id of this agent's engine (needed with --redis-url)")
    p.add_argument("--namespace", default="kvgate", help="shared-store key namespace")
    p.add_argument("--gpu-gib", type=float, default=1.0, help="GPU tier size, GiB")
    p.add_argument("--cpu-gib", type=float, default=4.0, help="CPU tier size, GiB")
    p.add_argument("--disk-gib", type=float, default=0.0, help="disk tier size, GiB")
    p.add_argument("--disk-dir", default=None, help="disk tier folder")
    p.add_argument("--device", default=None,
                   help="device of the GPU tier (default cuda when present, else cpu)")
    r = p.add_argument_group("hot-prefix replication")
    r.add_argument("--peer", action="append", default=[], metavar="URL",
                   help="another agent's control API, e.g. http://10.0.0.2:8100 (repeat; the "
                   "same list on every agent is fine: an agent skips itself)")  # fmt: skip
    for flag, kind, default, text in (
        ("--replicate-interval", float, 5.0, "seconds between replication rounds, 0: off"),
        ("--replicate-k", int, 2, "nodes a hot prefix should live on"),
        ("--replicate-min-rate", float, 4.0, "decayed hits that make a prefix hot"),
        ("--replicate-half-life", float, 60.0, "half-life of hit counts, seconds"),
        ("--replicate-max-blocks", int, 4096, "blocks pushed per round at most"),
        ("--replicate-max-mib", float, 1024.0, "MiB pushed per round at most"),
    ):
        r.add_argument(flag, type=kind, default=default, help=f"{text} (default {default:g})")
    p.add_argument("--log-level", default="warning")


def agent_config_from_args(args: argparse.Namespace):
    """An :class:`~worker_agent.service.AgentConfig` (raises ``ValueError`` when invalid)."""
    from .replication import ReplicationConfig
    from .service import AgentConfig

    replication = ReplicationConfig(
        k=args.replicate_k, min_rate=args.replicate_min_rate,
        half_life_s=args.replicate_half_life, interval_s=args.replicate_interval,
        max_blocks=args.replicate_max_blocks, max_bytes=int(args.replicate_max_mib * (1 << 20)),
    )  # fmt: skip
    events = None if args.events.lower() in ("", "none", "off") else args.events
    return AgentConfig(
        name=args.name,
        host=args.host,
        port=args.port,
        data_host=args.data_host or args.host,
        data_port=args.data_port,
        data_unix=args.data_unix,
        events_endpoint=events,
        replay_endpoint=args.replay,
        topic=args.topic,
        redis_url=args.redis_url,
        replica_id=args.replica_id,
        namespace=args.namespace,
        gpu_bytes=int(args.gpu_gib * _GIB),
        cpu_bytes=int(args.cpu_gib * _GIB),
        disk_bytes=int(args.disk_gib * _GIB),
        disk_dir=args.disk_dir,
        device=args.device,
        peers=tuple(args.peer),
        replication=replication,
    )


async def run_agent(args: argparse.Namespace) -> int:
    """Serve one agent until SIGINT/SIGTERM (what ``kvgate agent`` runs)."""
    from gateway.servers import ServerGroup, ServerSpec

    from .api import build_app
    from .service import AgentService

    try:
        config = agent_config_from_args(args)
    except ValueError as exc:
        print(f"kvgate agent: configuration error: {exc}", file=sys.stderr)
        return 2
    app = build_app(AgentService(config))
    spec = ServerSpec(app, config.host, config.port, log_level=args.log_level)
    await ServerGroup([spec]).run_until_signal()
    return 0
