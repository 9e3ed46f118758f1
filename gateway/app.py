"""The gateway ASGI app.  Everything is built in the lifespan and passed in; no globals.

Hot routes (the POST inference endpoints) are dispatched to :class:`Proxy` as raw ASGI, without
framework overhead; everything else (models, health, readiness, metrics, admin) goes to Starlette.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from policies import PolicyDeps, default_registry, native

from .admin import AdminApi
from .capacity import sync_capacities
from .config import GatewayConfig
from .errors import ConfigError, NotFound, error_body
from .features import ROUTES, tokens_per_hash
from .health import check_all, health_loop
from .metrics import GatewayMetrics
from .proxy import Proxy
from .replicas import ReplicaPool
from .state import (
    SharedPolicy,
    SoloSync,
    StateMetrics,
    StateSync,
    Store,
    SyncSettings,
    check_store_url,
    make_store,
)
from .upstream import make_client, make_upstream
from .wire import send_error

log = logging.getLogger("kvgate.gateway")


def json_response(data: object, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


@dataclass
class GatewayState:
    cfg: GatewayConfig
    pool: ReplicaPool
    proxy: Proxy
    metrics: GatewayMetrics
    started: float
    sync: StateSync | SoloSync


class GatewayApp:
    def __init__(
        self,
        cfg: GatewayConfig,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        policy_deps: object = None,
        store: Store | None = None,
        sync_settings: SyncSettings | None = None,
    ) -> None:
        self.cfg = cfg
        self._transport = transport
        self._clock = clock
        # The local view (prefix index, sessions) the policies share and the state sync feeds.
        self.policy_deps = policy_deps if policy_deps is not None else PolicyDeps(clock=clock)
        self.state: GatewayState | None = None
        # A store passed in is shared (several gateways in one process) and not closed here.
        self._store = store
        self._sync_settings = sync_settings
        try:
            check_store_url(cfg.redis_url)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        # Build the policy now so a bad name or parameter fails before the server binds.
        self._policy = default_registry().build(cfg.policy, cfg.policy_params, self.policy_deps)
        self.control = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/ready", self.ready, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                *AdminApi(self._st, self._forget_replica).routes(),
            ],
            lifespan=self.lifespan,
            exception_handlers={HTTPException: _http_error, Exception: _server_error},
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            kind = ROUTES.get(scope["path"])
            if kind is not None:
                if scope["method"] == "POST" and self.state is not None:
                    return await self.state.proxy.handle(scope, receive, send, kind)
                if scope["method"] != "POST":
                    err = NotFound(f"{scope['method']} {scope['path']} is not supported; use POST")
                    err.status = 405
                    return await send_error(send, err)
        await self.control(scope, receive, send)

    @contextlib.asynccontextmanager
    async def lifespan(self, _app):
        cfg = self.cfg
        pool = ReplicaPool(cfg.replicas, cfg.eject_after_failures)
        metrics = GatewayMetrics()
        # An injected httpx transport (tests) means httpx for the proxy too.
        kind = "httpx" if self._transport is not None else cfg.upstream_client
        client = None if kind != "httpx" else make_client(
            cfg.connect_timeout_s, cfg.read_timeout_s, cfg.max_connections_per_replica, self._transport
        )
        # One client for the proxy, its warms and the health checks (gateway/health.py).
        upstream = make_upstream(
            kind, cfg.connect_timeout_s, cfg.read_timeout_s, cfg.max_connections_per_replica, client
        )
        store = self._store if self._store is not None else make_store(cfg.redis_url)
        gateway_id = cfg.gateway_id or f"{cfg.host}:{cfg.port}-{os.urandom(3).hex()}"
        if self._store is None and not cfg.redis_url:  # an embedded store nobody else can read
            sync = SoloSync(store, gateway_id, StateMetrics(metrics.registry))
            policy = self._policy
        else:
            sync = StateSync(
                store, self.policy_deps, pool, gateway_id, self._sync_settings,
                StateMetrics(metrics.registry), clock=self._clock,
            )
            # The policy reports each dispatch to the shared state; the proxy is unaware of it.
            policy = SharedPolicy(self._policy, sync)
        proxy = Proxy(cfg, pool, policy, upstream, metrics, self._clock)
        index = self.policy_deps.index
        rates = proxy.token_rates

        def capacities(replicas: ReplicaPool) -> None:
            sync_capacities(replicas, index, lambda m: tokens_per_hash(cfg.chunk_bytes, rates.get(m)))

        await check_all(upstream, pool, cfg.connect_timeout_s)
        capacities(pool)
        # Replay the shared stream before serving (bounded); /ready says 503 until it is done.
        await sync.start(wait_s=2.0)
        self.state = GatewayState(cfg, pool, proxy, metrics, self._clock(), sync)
        checker = asyncio.create_task(
            health_loop(upstream, pool, cfg.health_interval_s, cfg.connect_timeout_s, capacities)
        )
        log.info("gateway ready", extra={
            "replicas": [r.id for r in pool], "policy": cfg.policy, "gateway_id": gateway_id,
            "store": store.backend, "state_caught_up": sync.caught_up,
            "policies_compiled": native.compiled(),
        })
        try:
            yield
        finally:
            checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checker
            await proxy.warms.aclose()
            await sync.stop()
            if self._store is None:
                await store.close()
            await upstream.aclose()
            if client is not None:
                await client.aclose()
            self.state = None

    # ------------------------------------------------------------------ control routes
    def _forget_replica(self, replica_id: str) -> None:
        """A removed replica's prefixes and sessions leave the local view at once."""
        self.policy_deps.index.drop_replica(replica_id)
        self.policy_deps.sessions.drop_replica(replica_id)

    def _st(self) -> GatewayState:
        assert self.state is not None, "the app's lifespan has not started"
        return self.state

    async def models(self, request: Request) -> Response:
        now = int(time.time())
        data = [
            {"id": m, "object": "model", "created": now, "owned_by": "kvgate", "replicas": len(reps)}
            for m, reps in sorted(self._st().pool.models().items())
        ]
        return json_response({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        st = self._st()
        healthy = sum(1 for r in st.pool if r.healthy)
        store = st.sync.status()  # status "degraded" while the shared store is unreachable
        return json_response({
            "status": store["status"], "replicas": len(st.pool), "healthy_replicas": healthy,
            "store": store,
        })

    async def ready(self, request: Request) -> Response:
        st = self._st()
        models = st.pool.models()
        known = {m for r in st.pool for m in r.models}
        missing = sorted(known - set(models))
        ok = bool(models) and not missing and st.sync.ready()
        body = {"ready": ok, "models": sorted(models), "models_without_replica": missing,
                "state_caught_up": st.sync.caught_up}
        return json_response(body, 200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        st = self._st()
        for r in st.pool:
            st.metrics.in_flight.labels(r.id).set(r.in_flight)
            st.metrics.healthy.labels(r.id).set(1 if r.healthy else 0)
        st.sync.refresh_gauges()
        return Response(st.metrics.render(), media_type=st.metrics.content_type)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found" if exc.status_code == 404 else "invalid_request"
    msg = f"{request.method} {request.url.path}: {exc.detail}"
    return Response(error_body(msg, "invalid_request_error", kind), exc.status_code, media_type="application/json")


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return Response(error_body("internal gateway error", "server_error", "internal_error"), 500,
                    media_type="application/json")


def build_app(cfg: GatewayConfig, **kwargs) -> GatewayApp:
    return GatewayApp(cfg.validate(), **kwargs)
