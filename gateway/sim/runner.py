"""Run many simulated replicas in one process, on consecutive ports of one host."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gateway.servers import ServerGroup, ServerSpec

from .config import SimConfig
from .server import build_sim_app

DEFAULT_GRACEFUL_TIMEOUT = 3.0  # hanging/stalled requests only end when their client leaves


def replica_config(config: SimConfig, index: int, port: int) -> SimConfig:
    """Replica ``index``'s config: its own name (unless set) and fault seed ``seed + index``."""
    return replace(config, name=config.name or f"sim-{port}", seed=config.seed + index)


def sim_specs_for_ports(
    ports: Sequence[int],
    host: str = "127.0.0.1",
    config: SimConfig | None = None,
    *,
    log_level: str = "warning",
    graceful_timeout: float = DEFAULT_GRACEFUL_TIMEOUT,
) -> list[ServerSpec]:
    """One :class:`ServerSpec` per port, each serving its own simulated replica."""
    base = config if config is not None else SimConfig()
    return [
        ServerSpec(
            build_sim_app(replica_config(base, i, port)),
            host,
            port,
            log_level=log_level,
            graceful_timeout=graceful_timeout,
        )
        for i, port in enumerate(ports)
    ]


def sim_specs(
    n: int,
    host: str = "127.0.0.1",
    base_port: int = 9001,
    config: SimConfig | None = None,
    **kwargs: object,
) -> list[ServerSpec]:
    """``n`` replicas on ports ``base_port .. base_port + n - 1``."""
    if n < 1:
        raise ValueError("need at least one replica")
    return sim_specs_for_ports(range(base_port, base_port + n), host, config, **kwargs)  # type: ignore[arg-type]


def sim_urls(specs: Sequence[ServerSpec]) -> list[str]:
    return [f"http://{s.host}:{s.port}" for s in specs]


async def start_sims(
    n: int,
    host: str = "127.0.0.1",
    base_port: int = 9001,
    config: SimConfig | None = None,
    **kwargs: object,
) -> ServerGroup:
    """Start ``n`` replicas and return the running group (``await group.stop()`` to end)."""
    group = ServerGroup(sim_specs(n, host, base_port, config, **kwargs))
    await group.start()
    return group


async def run_sims(
    n: int,
    host: str = "127.0.0.1",
    base_port: int = 9001,
    config: SimConfig | None = None,
    **kwargs: object,
) -> None:
    """Serve ``n`` replicas until SIGINT/SIGTERM (what ``kvgate sim`` runs)."""
    await ServerGroup(sim_specs(n, host, base_port, config, **kwargs)).run_until_signal()
