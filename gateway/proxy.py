"""The request path for the OpenAI inference routes, as a pure ASGI handler.

read body -> one parse (features) -> one policy call -> forward to the chosen replica with
retries on the decision's alternates until the first byte reaches the client -> stream the bytes
through untouched -> report the outcome (actual cached tokens from ``usage``) to the policy.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import orjson

from policies.errors import NoReplicaError
from policies.types import Decision, Outcome, RequestFeatures

from .config import GatewayConfig
from .errors import KvgateError, ModelNotFound, NoReplicaAvailable, PayloadTooLarge, Unauthorized
from .features import parse_request
from .metrics import GatewayMetrics
from .replicas import ReplicaPool
from .upstream import RETRYABLE_STATUS, error_kind, request_headers, response_headers, translate

log = logging.getLogger("kvgate.access")

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class _Exchange:
    """Per-request bookkeeping shared by the helpers below."""

    route: str
    request_id: str
    features: RequestFeatures
    decision: Decision
    started: float
    replica: str = ""
    status: int = 0
    attempts: int = 0
    ttft: float | None = None
    usage: dict | None = None
    ok: bool = False
    finished: bool = False  # the response is complete: a disconnect no longer cancels
    error: KvgateError | None = None


async def read_body(receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError("client went away before sending the body")
        body = message.get("body", b"")
        if body:
            size += len(body)
            if size > limit:
                raise PayloadTooLarge(f"request body larger than {limit} bytes")
            chunks.append(body)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def send_error(send, exc: KvgateError, extra: list[tuple[bytes, bytes]] = ()) -> None:
    body = exc.body()
    headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def usage_from_json(body: bytes) -> dict | None:
    try:
        usage = orjson.loads(body).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def usage_from_sse_tail(tail: bytes) -> dict | None:
    """The ``usage`` object of the last SSE event that carries one (include_usage chunks)."""
    idx = tail.rfind(b'"usage":{')
    if idx < 0:
        return None
    start = tail.rfind(b"data: ", 0, idx)
    end = tail.find(b"\n", idx)
    if start < 0:
        return None
    return usage_from_json(tail[start + 6 : end if end >= 0 else len(tail)])


def cached_tokens(usage: dict | None) -> int | None:
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) else None


class Proxy:
    """Forwards the inference routes; one instance per app, built in the lifespan."""

    def __init__(
        self,
        cfg: GatewayConfig,
        pool: ReplicaPool,
        policy,
        client: httpx.AsyncClient,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.policy = policy
        self.policy_name = getattr(policy, "name", type(policy).__name__)
        self.client = client
        self.metrics = metrics
        self.clock = clock
        self.api_keys = {f"Bearer {k}".encode() for k in cfg.api_keys}
        self.session_header = cfg.session_header.lower()
        self.open_streams = 0

    # ------------------------------------------------------------------ entry point
    async def handle(self, scope, receive, send, kind: str) -> None:
        started = self.clock()
        raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        request_id = ""
        for k, v in raw_headers:
            if k == b"x-request-id":
                request_id = v.decode("latin-1")
        request_id = request_id or os.urandom(12).hex()
        rid_header = [(b"x-request-id", request_id.encode())]
        route = scope["path"]
        try:
            self._authorize(raw_headers)
            body = await read_body(receive, self.cfg.max_body_bytes)
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw_headers}
            parsed = parse_request(
                kind, body, headers, session_header=self.session_header, chunk_bytes=self.cfg.chunk_bytes
            )
            decision = self._decide(parsed.features)
        except KvgateError as exc:
            self.metrics.requests.labels(route, str(exc.status)).inc()
            await send_error(send, exc, rid_header)
            return
        ex = _Exchange(route, request_id, parsed.features, decision, started)
        await self._forward(scope, receive, send, body, ex)

    def _authorize(self, raw_headers) -> None:
        if not self.api_keys:
            return
        for k, v in raw_headers:
            if k == b"authorization" and v in self.api_keys:
                return
        raise Unauthorized("missing or invalid API key")

    def _decide(self, features: RequestFeatures) -> Decision:
        if not self.pool.knows_model(features.model):
            raise ModelNotFound(f"The model '{features.model}' does not exist", param="model")
        view = self.pool.snapshot(self.clock())
        try:
            decision = self.policy.select(features, view)
        except NoReplicaError as exc:
            raise NoReplicaAvailable(str(exc)) from exc
        self.policy.on_dispatch(features, decision, view)
        self.metrics.decisions.labels(self.policy_name, decision.reason, decision.replica).inc()
        return decision

    # ------------------------------------------------------------------ forwarding
    async def _forward(self, scope, receive, send, body: bytes, ex: _Exchange) -> None:
        task = asyncio.current_task()
        watcher = asyncio.create_task(_watch_disconnect(receive, task, ex))
        try:
            resp = await self._connect(scope, body, ex)
            if resp is None:
                ex.replica = ""  # every attempt already released its replica
                return await self._fail(send, ex)
            try:
                await self._relay(send, resp, ex)
            finally:
                await resp.aclose()
        except asyncio.CancelledError:
            if not (watcher.done() and watcher.result() is True):
                raise
            task.uncancel()
            ex.status = 499  # client closed the connection
        finally:
            ex.finished = True
            watcher.cancel()
            self._finish(ex)

    async def _connect(self, scope, body: bytes, ex: _Exchange) -> httpx.Response | None:
        """Open the upstream response, retrying alternates on retryable failures."""
        candidates = ex.decision.candidates()[: self.cfg.max_retries + 1]
        qs = scope.get("query_string", b"")
        path = scope["path"] + ("?" + qs.decode("latin-1") if qs else "")
        headers = request_headers(scope["headers"], ex.request_id)
        for attempt, replica_id in enumerate(candidates):
            rep = self.pool.get(replica_id)
            if rep is None:
                continue
            if attempt:
                self.metrics.retries.labels(replica_id).inc()
                if attempt > 1:
                    await asyncio.sleep(self.cfg.retry_backoff_s * 2 ** (attempt - 2))
            ex.attempts = attempt + 1
            ex.replica = replica_id
            self.pool.begin(replica_id)
            try:
                req = self.client.build_request("POST", rep.url + path, headers=headers, content=body)
                resp = await self.client.send(req, stream=True)
            except httpx.HTTPError as exc:
                self.pool.end(replica_id)
                self._upstream_failed(replica_id, error_kind(exc))
                ex.status = 0
                ex.error = translate(exc, replica_id)
                continue
            if resp.status_code in RETRYABLE_STATUS and attempt + 1 < len(candidates):
                await resp.aclose()
                self.pool.end(replica_id)
                self._upstream_failed(replica_id, f"status_{resp.status_code}")
                continue
            return resp
        return None

    async def _fail(self, send, ex: _Exchange) -> None:
        err = ex.error or NoReplicaAvailable("no replica could take the request")
        ex.status = err.status
        ex.finished = True
        await send_error(send, err, [(b"x-request-id", ex.request_id.encode())])

    def _route_headers(self, ex: _Exchange) -> list[tuple[bytes, bytes]]:
        return [
            (b"x-request-id", ex.request_id.encode()),
            (b"x-kvgate-replica", ex.replica.encode()),
            (b"x-kvgate-policy", self.policy_name.encode()),
            (b"x-kvgate-reason", ex.decision.reason.encode()),
            (b"x-kvgate-predicted-cached-tokens", str(ex.decision.predicted_cached_tokens).encode()),
            (b"x-kvgate-attempts", str(ex.attempts).encode()),
        ]

    async def _relay(self, send, resp: httpx.Response, ex: _Exchange) -> None:
        ex.status = resp.status_code
        headers = response_headers(resp.headers.raw)
        headers = [(k, v) for k, v in headers if k.lower() != b"x-request-id"] + self._route_headers(ex)
        is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        if not is_sse:
            try:
                data = await resp.aread()
            except httpx.HTTPError as exc:
                self._upstream_failed(ex.replica, error_kind(exc))
                ex.error = translate(exc, ex.replica)
                return await self._fail(send, ex)
            ex.ttft = self.clock() - ex.started
            await send({"type": "http.response.start", "status": resp.status_code, "headers": headers})
            ex.finished = True
            await send({"type": "http.response.body", "body": data})
            ex.ok = resp.status_code < 400
            if ex.ok and resp.headers.get("content-encoding") is None:
                ex.usage = usage_from_json(data)
            return
        await send({"type": "http.response.start", "status": resp.status_code, "headers": headers})
        await self._relay_stream(send, resp, ex)

    async def _relay_stream(self, send, resp: httpx.Response, ex: _Exchange) -> None:
        tail = b""
        last = None
        itl = self.metrics.itl.labels(ex.route)
        self.open_streams += 1
        try:
            async for chunk in resp.aiter_raw():
                now = self.clock()
                if last is None:
                    ex.ttft = now - ex.started
                else:
                    itl.observe(now - last)
                last = now
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                tail = (tail + chunk)[-4096:]
        except httpx.HTTPError as exc:
            self._upstream_failed(ex.replica, error_kind(exc))
            err = translate(exc, ex.replica)
            event = b"data: " + orjson.dumps({"error": orjson.loads(err.body())["error"]}) + b"\n\n"
            ex.finished = True
            await send({"type": "http.response.body", "body": event + SSE_DONE, "more_body": False})
            ex.status = err.status
            return
        finally:
            self.open_streams -= 1
        ex.finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        ex.ok = resp.status_code < 400
        ex.usage = usage_from_sse_tail(tail)

    def _upstream_failed(self, replica_id: str, kind: str) -> None:
        self.metrics.upstream_errors.labels(replica_id, kind).inc()
        if self.pool.record_failure(replica_id):
            self.metrics.ejections.labels(replica_id).inc()

    def _finish(self, ex: _Exchange) -> None:
        elapsed = self.clock() - ex.started
        if ex.replica:
            self.pool.end(ex.replica)
            if ex.ok:
                self.pool.record_success(ex.replica)
        m = self.metrics
        m.requests.labels(ex.route, str(ex.status)).inc()
        m.latency.labels(ex.route).observe(elapsed)
        if ex.ttft is not None:
            m.ttft.labels(ex.route).observe(ex.ttft)
        actual = cached_tokens(ex.usage)
        if actual is not None:
            predicted = ex.decision.predicted_cached_tokens if ex.replica == ex.decision.replica else 0
            m.predicted_cached.labels(self.policy_name).inc(predicted)
            m.actual_cached.labels(self.policy_name).inc(actual)
            m.prompt_tokens.labels(self.policy_name).inc(ex.usage.get("prompt_tokens") or 0)
            m.prediction_error.labels(self.policy_name).observe(abs(predicted - actual))
        if ex.replica:
            prompt = (ex.usage or {}).get("prompt_tokens") or 0
            outcome = Outcome(ok=ex.ok, prompt_tokens=prompt, cached_tokens=actual, latency_s=elapsed, ttft_s=ex.ttft)
            self.policy.on_complete(ex.features, ex.replica, outcome)
        if log.isEnabledFor(logging.INFO):
            log.info(
                "request",
                extra={
                    "request_id": ex.request_id, "route": ex.route, "status": ex.status,
                    "replica": ex.replica, "policy": self.policy_name, "reason": ex.decision.reason,
                    "predicted_cached_tokens": ex.decision.predicted_cached_tokens,
                    "cached_tokens": actual, "attempts": ex.attempts, "model": ex.features.model,
                    "duration_ms": round(elapsed * 1000, 2),
                    "ttft_ms": None if ex.ttft is None else round(ex.ttft * 1000, 2),
                },
            )


async def _watch_disconnect(receive, task: asyncio.Task, ex: _Exchange) -> bool:
    """Cancel ``task`` when the client disconnects mid-request; returns True if it did."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if ex.finished:
                return False
            task.cancel()
            return True
