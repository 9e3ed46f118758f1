"""The request path for the OpenAI inference routes, as a pure ASGI handler.

read body -> one parse (features) -> one policy call -> forward to the chosen replica with
retries on the decision's alternates until the first byte reaches the client -> stream the bytes
through untouched -> report the outcome (actual cached tokens from ``usage``) to the policy.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import time
from collections.abc import Callable

import httpx
import orjson

from policies.errors import NoReplicaError
from policies.types import ClusterView, Decision, Outcome, RequestFeatures

from . import fastclient as fc
from .config import GatewayConfig
from .disconnect import DisconnectWatch, client_gone
from .errors import KvgateError, ModelNotFound, NoReplicaAvailable, RateLimited, Unauthorized
from .exchange import Exchange, target
from .fastmetrics import Children, status_label
from .features import CHAT, parse_body, parse_request
from .holds import PrefillHolds
from .kvhints import pull_hint_body
from .logs import access_fields
from .metrics import GatewayMetrics
from .relay import SSE_DONE, StreamRelay
from .replicas import ReplicaPool
from .tokenrate import TokenRates
from .turns import answer_from_json, answer_from_sse, continues
from .upstream import (
    HOP_BY_HOP,
    RESPONSE_DROP,
    RETRYABLE_STATUS,
    HttpxUpstream,
    UpstreamClient,
    UpstreamResponse,
    error_kind,
    translate,
)
from .warms import Warmer
from .wire import cached_tokens, read_body, send_error, usage_from_json, usage_from_sse_tail

log = logging.getLogger("kvgate.access")

RESPONSE_SKIP = RESPONSE_DROP | {b"x-request-id"}  # the gateway sets its own x-request-id


class Proxy:
    """Forwards the inference routes; one instance per app, built in the lifespan."""

    # A client disconnect is watched for (a task reading ASGI ``receive``) only once a request
    # has run this long: most short requests finish first, and skip the task (gateway/disconnect.py;
    # read when the Proxy is built).
    watch_disconnect_after_s = 0.05

    def __init__(
        self,
        cfg: GatewayConfig,
        pool: ReplicaPool,
        policy,
        client: UpstreamClient,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.policy = policy
        self.policy_name = getattr(policy, "name", type(policy).__name__)
        if isinstance(client, httpx.AsyncClient):  # the pre-fastclient signature
            client = HttpxUpstream(client)
        self.client = client
        self.metrics = metrics
        self.clock = clock
        self.api_keys = {f"Bearer {k}".encode() for k in cfg.api_keys}
        self.session_header = cfg.session_header.lower()
        self._session_header_b = self.session_header.encode("latin-1")
        self._policy_b = self.policy_name.encode()
        self._rid_prefix = os.urandom(6).hex()
        self._rid_seq = itertools.count(1)
        self.open_streams = 0
        self.in_flight = 0  # requests being forwarded (the max_in_flight limit)
        self.holds = PrefillHolds(pool, policy)  # requests waiting for a prefill in flight
        self.token_rates = TokenRates()  # bytes per engine token, per model, learnt from usage
        self.warms = Warmer(pool, policy, self.client, self.holds, metrics.warm_requests, clock,
                            functools.partial(parse_body, CHAT, chunk_bytes=cfg.chunk_bytes,
                                              bytes_per_token=self.token_rates.get),
                            self._upstream_failed)
        self._turns = bool(getattr(policy, "warms_turns", False))  # gateway/turns.py
        self.max_in_flight = cfg.max_in_flight
        self.disconnects = DisconnectWatch(self.watch_disconnect_after_s)
        m = metrics
        self._m_requests = Children(m.requests)
        self._m_latency = Children(m.latency)
        self._m_ttft = Children(m.ttft)
        self._m_itl = Children(m.itl)
        self._m_decisions = Children(m.decisions)
        self._m_retries = Children(m.retries)
        self._m_upstream_errors = Children(m.upstream_errors)
        self._m_ejections = Children(m.ejections)
        name = self.policy_name
        self._m_predicted = m.predicted_cached.labels(name)
        self._m_actual = m.actual_cached.labels(name)
        self._m_prompt = m.prompt_tokens.labels(name)
        self._m_pred_error = m.prediction_error.labels(name)

    def _new_request_id(self) -> str:
        """24 hex digits: a random per-process prefix and a counter (no syscall per request)."""
        return f"{self._rid_prefix}{next(self._rid_seq):012x}"

    # ------------------------------------------------------------------ entry point
    async def handle(self, scope, receive, send, kind: str) -> None:
        started = self.clock()
        # One pass over the headers: request id, API key, session key, headers to forward.
        request_id = b""
        session = b""
        authorized = not self.api_keys
        forward: list[tuple[bytes, bytes]] = []
        session_header = self._session_header_b
        for k, v in scope["headers"]:
            if k in HOP_BY_HOP:
                continue
            if k == b"x-request-id":
                request_id = v
                continue
            if k == session_header:
                session = v
            if k == b"authorization" and not authorized and v in self.api_keys:
                authorized = True
            forward.append((k, v))
        if request_id:
            rid = request_id.decode("latin-1")
        else:
            rid = self._new_request_id()
            request_id = rid.encode()
        route = scope["path"]
        if self.max_in_flight and self.in_flight >= self.max_in_flight:
            self._m_requests.get(route, "429").inc()
            err = RateLimited(f"the gateway has {self.in_flight} requests in flight (max_in_flight)")
            return await send_error(send, err, [(b"x-request-id", request_id)])
        try:
            if not authorized:
                raise Unauthorized("missing or invalid API key")
            body = await read_body(receive, self.cfg.max_body_bytes)
            headers = {self.session_header: session.decode("latin-1")} if session else {}
            parsed = parse_request(
                kind, body, headers, session_header=self.session_header,
                chunk_bytes=self.cfg.chunk_bytes, bytes_per_token=self.token_rates.get,
            )
            decision, view = self._decide(parsed.features)
            if decision.pull_from is not None:  # migration hint -> kv_transfer_params
                body = pull_hint_body(parsed.body, decision, self.pool) or body
            if decision.warm is not None:  # a copy of the prefix made by a request of its own
                wh = [*forward, (b"x-request-id", request_id + b"-warm")]
                self.warms.start(parsed, target(scope), wh, decision.warm, view)
        except KvgateError as exc:
            self._m_requests.get(route, str(exc.status)).inc()
            await send_error(send, exc, [(b"x-request-id", request_id)])
            return
        forward.append((b"x-request-id", request_id))
        ex = Exchange(route, rid, request_id, parsed.features, decision, started, view=view)
        if self._turns and continues(kind, parsed.body, bool(session)):
            ex.turn = (parsed, target(scope), forward)
        self.in_flight += 1
        try:
            await self._forward(scope, receive, send, body, forward, ex)
        finally:
            self.in_flight -= 1

    def _decide(self, features: RequestFeatures) -> tuple[Decision, ClusterView]:
        if not self.pool.knows_model(features.model):
            raise ModelNotFound(f"The model '{features.model}' does not exist", param="model")
        view = self.pool.snapshot(self.clock())
        try:
            return self.policy.select(features, view), view
        except NoReplicaError as exc:
            raise NoReplicaAvailable(str(exc)) from exc

    def _dispatched(self, ex: Exchange) -> None:
        """The policy's ``on_dispatch`` (index, sessions, shared state), once per request: called
        by the upstream client as soon as the request is written (or before it first waits), so
        it is off the time to first token and still ahead of any other request's ``select``."""
        view, ex.view = ex.view, None
        if view is not None:
            decision = ex.decision
            self.policy.on_dispatch(ex.features, decision, view)
            self._m_decisions.get(self.policy_name, decision.reason, decision.replica).inc()

    # ------------------------------------------------------------------ forwarding
    async def _forward(self, scope, receive, send, body: bytes, headers, ex: Exchange) -> None:
        task = asyncio.current_task()
        watch = self.disconnects  # registered inline: no method call per request
        loop = watch.loop or watch.bind_loop()
        watch.pending[ex] = (receive, task, loop.time())
        if watch.sweeper is None:
            watch.sweeper = loop.call_later(watch.after_s, watch.sweep)
        try:
            resp = await self._connect(scope, body, headers, ex)
            if resp is None:
                ex.replica = ""  # every attempt already released its replica
                return await self._fail(send, ex)
            try:
                await self._relay(send, resp, ex, scope)
            finally:
                await resp.aclose()
        except asyncio.CancelledError:
            if not client_gone(ex):
                raise
            task.uncancel()
            ex.status = 499  # client closed the connection
        finally:
            ex.finished = True  # a watcher, if one started, wakes on the response's end and returns
            watch.pending.pop(ex, None)
            self._finish(ex)

    async def _connect(self, scope, body: bytes, headers, ex: Exchange) -> UpstreamResponse | None:
        """Open the upstream response, retrying alternates on retryable failures."""
        candidates = ex.decision.candidates()[: self.cfg.max_retries + 1]
        path = target(scope)
        sent = functools.partial(self._dispatched, ex)
        if ex.decision.hold_s > 0:
            await self.holds.wait(ex.decision.replica, ex.decision.hold_s, ex.features)
        for attempt, replica_id in enumerate(candidates):
            rep = self.pool.get(replica_id)
            if rep is None:
                continue
            if attempt:
                self._m_retries.get(replica_id).inc()
                if attempt > 1:
                    await asyncio.sleep(self.cfg.retry_backoff_s * 2 ** (attempt - 2))
            ex.attempts = attempt + 1
            ex.replica = replica_id
            self.pool.begin(replica_id)
            try:
                resp = await self.client.request(
                    "POST", rep.url, path, headers, body, on_sent=sent
                )
            except fc.HTTPError as exc:
                self.pool.end(replica_id)
                self._upstream_failed(replica_id, error_kind(exc))
                ex.status = 0
                ex.error = translate(exc, replica_id)
                continue
            if resp.status in RETRYABLE_STATUS and attempt + 1 < len(candidates):
                await resp.aclose()
                self.pool.end(replica_id)
                self._upstream_failed(replica_id, f"status_{resp.status}")
                continue
            return resp
        return None

    def _first_token(self, ex: Exchange) -> None:
        self.holds.first_token(ex.features, ex.replica)

    async def _fail(self, send, ex: Exchange) -> None:
        err = ex.error or NoReplicaAvailable("no replica could take the request")
        ex.status = err.status
        ex.finished = True
        await send_error(send, err, [(b"x-request-id", ex.request_id_b)])

    def _route_headers(self, ex: Exchange) -> list[tuple[bytes, bytes]]:
        return [
            (b"x-request-id", ex.request_id_b),
            (b"x-kvgate-replica", ex.replica.encode()),
            (b"x-kvgate-policy", self._policy_b),
            (b"x-kvgate-reason", ex.decision.reason.encode()),
            (b"x-kvgate-predicted-cached-tokens", b"%d" % ex.decision.predicted_cached_tokens),
            (b"x-kvgate-attempts", b"%d" % ex.attempts),
        ]

    async def _relay(self, send, resp: UpstreamResponse, ex: Exchange, scope) -> None:
        ex.status = status = resp.status
        # One pass: drop hop-by-hop headers and the replica's x-request-id, note the two we need.
        headers = []
        ctype = b""
        encoded = False
        for k, v in resp.headers:  # names are lower-case
            if k in RESPONSE_SKIP:
                continue
            if k == b"content-type":
                ctype = v
            elif k == b"content-encoding":
                encoded = True
            headers.append((k, v))
        headers += self._route_headers(ex)
        if not ctype.startswith(b"text/event-stream"):
            try:
                data = await resp.aread()
            except fc.HTTPError as exc:
                self._upstream_failed(ex.replica, error_kind(exc))
                ex.error = translate(exc, ex.replica)
                return await self._fail(send, ex)
            ex.ttft = self.clock() - ex.started
            self._first_token(ex)
            await send({"type": "http.response.start", "status": status, "headers": headers})
            ex.finished = True
            await send({"type": "http.response.body", "body": data})
            ex.ok = status < 400
            if ex.ok and not encoded:
                ex.usage = usage_from_json(data)
                if ex.turn is not None:
                    ex.answer = answer_from_json(data)
            return
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await self._relay_stream(send, resp, ex, scope)

    async def _relay_stream(self, send, resp: UpstreamResponse, ex: Exchange, scope) -> None:
        relay = StreamRelay(resp, send, scope, ex, self.clock, self._m_itl.get(ex.route),
                            self._first_token, keep=ex.turn is not None)
        self.open_streams += 1
        try:
            ended = await relay.run()
        except fc.HTTPError as exc:
            self._upstream_failed(ex.replica, error_kind(exc))
            err = translate(exc, ex.replica)
            event = b"data: " + orjson.dumps({"error": orjson.loads(err.body())["error"]}) + b"\n\n"
            ex.finished = True
            await send({"type": "http.response.body", "body": event + SSE_DONE, "more_body": False})
            ex.status = err.status
            return
        finally:
            self.open_streams -= 1
        if not ended:
            ex.finished = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        ex.ok = resp.status < 400
        ex.usage = usage_from_sse_tail(relay.tail)
        if relay.kept and ex.ok:
            ex.answer = answer_from_sse(b"".join(relay.kept))

    def _upstream_failed(self, replica_id: str, kind: str) -> None:
        self._m_upstream_errors.get(replica_id, kind).inc()
        if self.pool.record_failure(replica_id):
            self._m_ejections.get(replica_id).inc()

    def _finish(self, ex: Exchange) -> None:
        elapsed = self.clock() - ex.started
        if ex.replica:
            self.pool.end(ex.replica)
            if ex.ok:
                self.pool.record_success(ex.replica)
        route = ex.route
        self._m_requests.get(route, status_label(ex.status)).inc()
        self._m_latency.get(route).observe(elapsed)
        if ex.ttft is not None:
            self._m_ttft.get(route).observe(ex.ttft)
        actual = cached_tokens(ex.usage)
        if actual is not None:
            predicted = ex.decision.predicted_cached_tokens if ex.replica == ex.decision.replica else 0
            self._m_predicted.inc(predicted)
            self._m_actual.inc(actual)
            self._m_prompt.inc(ex.usage.get("prompt_tokens") or 0)
            self._m_pred_error.observe(abs(predicted - actual))
        if ex.replica:
            prompt = (ex.usage or {}).get("prompt_tokens") or 0
            if prompt and isinstance(prompt, int):
                self.token_rates.observe(ex.features.model, ex.features.prompt_bytes, prompt)
            # The prediction was for the decision's first choice; a retried request has none.
            predicted_here = ex.decision.predicted_cached_tokens if ex.replica == ex.decision.replica else None
            outcome = Outcome(
                ok=ex.ok, prompt_tokens=prompt, cached_tokens=actual, latency_s=elapsed, ttft_s=ex.ttft,
                predicted_cached_tokens=predicted_here,
            )
            self.policy.on_complete(ex.features, ex.replica, outcome)
        if ex.answer and ex.replica:
            self.warms.start_turn(ex.turn, ex.answer, ex.replica, ex.request_id_b)
        if log.isEnabledFor(logging.INFO):
            log.info("request", extra=access_fields(ex, self.policy_name, actual, elapsed))
