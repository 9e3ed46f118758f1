"""Background replica checks: liveness, model discovery and load scraping (vLLM /metrics)."""

from __future__ import annotations

import asyncio
import logging

import httpx

from .replicas import Replica, ReplicaPool, parse_engine_metrics

log = logging.getLogger("kvgate.health")


async def check_replica(client: httpx.AsyncClient, rep: Replica, timeout: float) -> bool:
    """One round for one replica; updates it in place and returns its health."""
    try:
        resp = await client.get(rep.url + "/health", timeout=timeout)
        alive = resp.status_code == 200
        if alive and not rep.static_models:
            models = await client.get(rep.url + "/v1/models", timeout=timeout)
            data = models.json().get("data", []) if models.status_code == 200 else []
            ids = frozenset(m["id"] for m in data if isinstance(m, dict) and "id" in m)
            if ids:
                rep.models = ids
        if alive:
            metrics = await client.get(rep.url + "/metrics", timeout=timeout)
            rep.metrics_ok = metrics.status_code == 200
            if rep.metrics_ok:
                values = parse_engine_metrics(metrics.text)
                rep.record_engine(int(values.get("running", 0)), int(values.get("waiting", 0)),
                                  float(values.get("kv_usage", 0.0)))  # fmt: skip
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        log.debug("health check of %s failed: %r", rep.id, exc)
        alive = False
    was = rep.healthy
    rep.healthy = alive
    if alive:
        rep.failures = 0
    if was != alive:
        log.warning("replica %s is now %s", rep.id, "healthy" if alive else "unhealthy")
    return alive


async def check_all(client: httpx.AsyncClient, pool: ReplicaPool, timeout: float) -> None:
    await asyncio.gather(*(check_replica(client, r, timeout) for r in pool))


async def health_loop(client: httpx.AsyncClient, pool: ReplicaPool, interval: float, timeout: float) -> None:
    while True:
        await asyncio.sleep(interval)
        await check_all(client, pool, timeout)
