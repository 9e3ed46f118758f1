"""Real servers on loopback ports for integration tests: simulated replicas and gateways."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from gateway.config import GatewayConfig, ReplicaConfig
from gateway.runner import gateway_spec, sim_specs
from gateway.servers import ServerGroup, free_port, free_port_block


@dataclass
class Topology:
    base_url: str
    replica_urls: list[str]
    gateway: object = None
    groups: list[ServerGroup] = field(default_factory=list)

    @property
    def replica_ids(self) -> list[str]:
        return [u.split("://", 1)[1] for u in self.replica_urls]


@contextlib.asynccontextmanager
async def running_topology(
    replicas: int = 3, sim_config=None, app_kwargs: dict | None = None, **gateway_settings
) -> AsyncIterator[Topology]:
    """Start ``replicas`` simulated replicas and one gateway in this event loop (``app_kwargs``
    go to the gateway's ``GatewayApp``, e.g. its ``clock``)."""
    from gateway.sim.config import SimConfig

    sim_config = sim_config or SimConfig()
    host = "127.0.0.1"
    first = free_port_block(replicas)
    sims = ServerGroup(sim_specs(replicas, host, first, sim_config))
    await sims.start()
    urls = [f"http://{host}:{first + i}" for i in range(replicas)]
    cfg = GatewayConfig(
        host=host, port=free_port(), replicas=tuple(ReplicaConfig(u) for u in urls),
        log_level="warning", **gateway_settings,
    ).validate()
    spec = gateway_spec(cfg, **(app_kwargs or {}))
    gw = ServerGroup([spec])
    try:
        await gw.start()
        yield Topology(f"http://{host}:{cfg.port}", urls, spec.app, [gw, sims])
    finally:
        await gw.stop()
        await sims.stop()


def wait_ready(url: str, timeout: float = 60.0) -> None:
    """Poll ``url`` until it answers 200 (start-up of a subprocess; not event ordering)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            resp = httpx.get(url, timeout=1.0)
            if resp.status_code == 200:
                return
            last = resp.status_code
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout}s: {last!r}")


def poll_until(fn, timeout: float, what: str, interval: float = 0.05):
    """Poll ``fn`` until it returns a truthy value, and return it (state another process shows us:
    a scrape landing, a server's counters; not the order of our own events)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not seen after {timeout}s: last {value!r}")
        time.sleep(interval)


def spawn_ready(cmd: list[str], ready_url: str, timeout: float = 60.0, **popen) -> subprocess.Popen:
    """Start ``cmd`` and wait until ``ready_url`` answers 200; kill it if it never does."""
    proc = subprocess.Popen(cmd, **popen)
    try:
        wait_ready(ready_url, timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait(timeout=10)
        raise
    return proc


@dataclass
class Cluster:
    """Several gateways sharing state (one Redis, or one MemoryStore) in front of the same sims."""

    base_urls: list[str]
    replica_urls: list[str]
    apps: list
    groups: list[ServerGroup]  # one per gateway, then the sims

    @property
    def replica_ids(self) -> list[str]:
        return [u.split("://", 1)[1] for u in self.replica_urls]

    async def stop_gateway(self, i: int) -> None:
        await self.groups[i].stop()


@contextlib.asynccontextmanager
async def running_gateways(
    gateways: int = 2, replicas: int = 3, sim_config=None, store=None, sync_settings=None,
    **gateway_settings,
) -> AsyncIterator[Cluster]:
    """``replicas`` simulated replicas and ``gateways`` gateways sharing state, in this event loop.

    Pass ``redis_url=...`` (a gateway setting) for Redis, or ``store=`` one shared store object.
    """
    from gateway.sim.config import SimConfig

    sim_config = sim_config or SimConfig()
    host = "127.0.0.1"
    first = free_port_block(replicas)
    sims = ServerGroup(sim_specs(replicas, host, first, sim_config))
    await sims.start()
    urls = [f"http://{host}:{first + i}" for i in range(replicas)]
    groups: list[ServerGroup] = []
    apps = []
    bases = []
    try:
        for i in range(gateways):
            cfg = GatewayConfig(
                host=host, port=free_port(), replicas=tuple(ReplicaConfig(u) for u in urls),
                log_level="warning", gateway_id=f"gw{i}", **gateway_settings,
            ).validate()
            spec = gateway_spec(cfg, store=store, sync_settings=sync_settings)
            group = ServerGroup([spec])
            await group.start()
            groups.append(group)
            apps.append(spec.app)
            bases.append(f"http://{host}:{cfg.port}")
        yield Cluster(bases, urls, apps, [*groups, sims])
    finally:
        for group in groups:
            await group.stop()
        await sims.stop()
