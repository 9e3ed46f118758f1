"""Background replica checks: liveness, model discovery and load scraping (vLLM /metrics).

The probes go out on the proxy's own upstream client (:class:`~gateway.upstream.UpstreamClient`:
the fast client, or httpx where configured), on its pooled keep-alive connections.  On httpx
a round of three GETs to four replicas took about 17 ms of the event loop's CPU every
``health_interval_s``, in one burst that delayed whichever requests were relaying at that moment
(a few ms: the tail of a benchmark's TTFT); on the fast client 1.6 ms, and the probes keep a
warm connection to every replica for the first requests after start-up.  ``/v1/models`` is asked
every ``models_every`` rounds (30 s at the default interval), at once while a replica has no
models and when it comes back up (a restart may bring another model): an engine's models do not
change while it runs, so the other rounds cost two GETs, not three.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import orjson

from . import fastclient as fc
from .replicas import Replica, ReplicaPool, parse_engine_metrics
from .upstream import UpstreamClient

log = logging.getLogger("kvgate.health")

MODELS_EVERY = 15  # health rounds between two /v1/models probes of a replica that stays up


async def _get(client: UpstreamClient, base_url: str, path: str, timeout: float) -> tuple[int, bytes]:
    """``GET base_url + path``: (status, body), within ``timeout`` seconds (head and body)."""

    async def fetch() -> tuple[int, bytes]:
        resp = await client.request("GET", base_url, path)
        try:
            return resp.status, await resp.aread()
        finally:
            await resp.aclose()

    return await asyncio.wait_for(fetch(), timeout)


async def check_replica(
    client: UpstreamClient, rep: Replica, timeout: float, patience: int = 1,
    models_every: int = MODELS_EVERY,
) -> bool:  # fmt: skip
    """One round for one replica; updates it in place and returns its health.

    A replica is down at once when it says so (``/health`` answers other than 200) or when it
    cannot be reached (refused, reset).  A probe that times out only counts a failure, and takes
    the replica out after ``patience`` in a row (with the request path's failures: both count
    ``rep.failures``): a busy engine's API server can answer its probes seconds late while it
    serves requests fine.  Once ``/health`` said 200, a slow or failed ``/v1/models`` or
    ``/metrics`` leaves the replica up (``metrics_ok`` says whether its load is fresh)."""
    try:
        status, _ = await _get(client, rep.url, "/health", timeout)
    except (TimeoutError, fc.TimeoutException) as exc:
        log.debug("health check of %s timed out: %r", rep.id, exc)
        rep.failures += 1
        return _set_health(rep, rep.healthy and rep.failures < patience)
    except fc.HTTPError as exc:
        log.debug("health check of %s failed: %r", rep.id, exc)
        rep.failures += 1
        return _set_health(rep, False)
    if status != 200:
        rep.failures += 1
        return _set_health(rep, False)
    rep.failures = 0
    if not rep.healthy:
        rep.models_due = 0  # back up: perhaps restarted with another model
    try:
        rep.models_due -= 1
        if not rep.static_models and (rep.models_due < 0 or not rep.models):
            status, body = await _get(client, rep.url, "/v1/models", timeout)
            data = orjson.loads(body).get("data", []) if status == 200 else []
            ids = frozenset(m["id"] for m in data if isinstance(m, dict) and "id" in m)
            if ids:
                rep.models = ids
                rep.models_due = models_every - 1
        status, body = await _get(client, rep.url, "/metrics", timeout)
        rep.metrics_ok = status == 200
        if rep.metrics_ok:
            values = parse_engine_metrics(body.decode("utf-8", "replace"))
            rep.record_engine(int(values.get("running", 0)), int(values.get("waiting", 0)),
                              float(values.get("kv_usage", 0.0)))  # fmt: skip
            rep.kv_tokens = int(values.get("kv_tokens", 0))
            rep.pull_ms_per_token = values.get("pull_ms_per_token", -1.0)
    except (TimeoutError, fc.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.debug("models/metrics of %s failed: %r", rep.id, exc)
        rep.metrics_ok = False
    return _set_health(rep, True)


def _set_health(rep: Replica, alive: bool) -> bool:
    if rep.healthy != alive:
        log.warning("replica %s is now %s", rep.id, "healthy" if alive else "unhealthy")
    rep.healthy = alive
    return alive


async def check_all(client: UpstreamClient, pool: ReplicaPool, timeout: float) -> None:
    await asyncio.gather(*(check_replica(client, r, timeout, pool.eject_after) for r in pool))


async def health_loop(
    client: UpstreamClient, pool: ReplicaPool, interval: float, timeout: float,
    after: Callable[[ReplicaPool], None] = lambda pool: None,
) -> None:  # fmt: skip
    """Check every replica each ``interval``, then call ``after`` with the pool."""
    while True:
        await asyncio.sleep(interval)
        await check_all(client, pool, timeout)
        after(pool)
