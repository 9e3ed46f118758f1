"""argparse wiring for ``kvgate sim``: ``add_sim_arguments(parser)`` then
``run_sims(args.replicas, args.host, args.port, sim_config_from_args(args))``.

``--replicas/--host/--port`` are added only with ``server_options=True`` (the CLI adds its own).
"""

from __future__ import annotations

import argparse

from .config import SimConfig, SimFaults

_D = SimConfig()


def add_sim_arguments(parser: argparse.ArgumentParser, *, server_options: bool = False) -> None:
    """Add the simulator's options (``server_options``: also --replicas, --host, --port)."""
    if server_options:
        parser.add_argument(
            "--replicas", type=int, default=4, help="number of replicas (default 4)"
        )
        parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
        parser.add_argument(
            "--port", type=int, default=9001, help="first port; replicas use consecutive ports"
        )
    g = parser.add_argument_group("simulated replica")
    g.add_argument("--model", default=_D.model, help=f"served model name (default {_D.model})")
    g.add_argument("--block-size", type=int, default=_D.block_size, help="tokens per KV block")
    g.add_argument(
        "--cache-blocks", type=int, default=_D.cache_blocks, help="prefix-cache capacity in blocks"
    )
    g.add_argument(
        "--max-running", type=int, default=_D.max_running, help="requests run at once; rest queue"
    )
    g.add_argument(
        "--prefill-ms-per-token",
        type=float,
        default=_D.prefill_s_per_token * 1000,
        help="prefill time per uncached prompt token, ms",
    )
    g.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=_D.decode_s_per_token * 1000,
        help="time per output token after the first, ms",
    )
    g.add_argument(
        "--default-max-tokens",
        type=int,
        default=_D.default_max_tokens,
        help="output tokens when the request sets no limit",
    )
    g.add_argument("--seed", type=int, default=_D.seed, help="fault RNG seed (replica i: seed+i)")
    g.add_argument(
        "--instant", action="store_true", help="zero prefill and decode time (benchmark backend)"
    )
    k = parser.add_argument_group("KV pulls from peers (kv_transfer_params.kvgate_pull_from)")
    k.add_argument("--kv-bandwidth-gbps", type=float, default=_D.kv_bandwidth_gbps,
                   help="replica-to-replica KV bandwidth, Gbit/s (0: never pull)")
    k.add_argument("--kv-block-bytes", type=int, default=_D.kv_block_bytes,
                   help="KV bytes of one block (default 2 MiB: 8B model, 16 tokens)")
    k.add_argument("--kv-pull-overhead-ms", type=float, default=_D.kv_pull_overhead_s * 1000,
                   help="fixed cost of one pull, ms")
    f = parser.add_argument_group("faults (also settable at runtime: POST /sim/faults)")
    f.add_argument("--error-rate", type=float, default=0.0, help="fraction answered 503")
    f.add_argument("--hang", action="store_true", help="never answer completion requests")
    f.add_argument(
        "--close-after-chunks", type=int, default=None, help="drop streams after N chunks"
    )
    f.add_argument(
        "--stall-after-chunks", type=int, default=None, help="stall streams after N chunks"
    )


def sim_config_from_args(args: argparse.Namespace) -> SimConfig:
    """The :class:`SimConfig` described by parsed arguments (raises ``ValueError`` if invalid)."""
    faults = SimFaults(
        error_rate=args.error_rate,
        hang=args.hang,
        close_after_chunks=args.close_after_chunks,
        stall_after_chunks=args.stall_after_chunks,
    )
    instant = getattr(args, "instant", False)
    return SimConfig(
        model=args.model,
        block_size=args.block_size,
        cache_blocks=args.cache_blocks,
        max_running=args.max_running,
        prefill_s_per_token=0.0 if instant else args.prefill_ms_per_token / 1000,
        decode_s_per_token=0.0 if instant else args.decode_ms_per_token / 1000,
        default_max_tokens=args.default_max_tokens,
        faults=faults,
        seed=args.seed,
        kv_bandwidth_gbps=args.kv_bandwidth_gbps,
        kv_block_bytes=args.kv_block_bytes,
        kv_pull_overhead_s=args.kv_pull_overhead_ms / 1000,
    )
