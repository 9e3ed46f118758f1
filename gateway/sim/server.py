"""The simulated replica as a raw ASGI app (no framework: it is a benchmark backend).

Routes::

    POST /v1/chat/completions, POST /v1/completions   (JSON, or SSE with "stream": true)
    GET  /v1/models, GET /health, GET /metrics          (Prometheus text, vLLM names)
    GET  /sim/state, GET|POST /sim/faults, POST /sim/reset
    POST /sim/kv/lookup   {"hashes": [...]} -> {"blocks": leading blocks held, ...} (kvpull)

A request's ``kv_transfer_params`` may ask the replica to pull KV blocks from a peer first
(:mod:`.kvpull`); ``peer_lookup`` (default: HTTP) is how it asks the peer what it holds.

When the replica has timing costs or a fault that waits (hang, stall) the request runs in a child
task while the handler watches for the client's disconnect and cancels it (freeing the slot, as
vLLM aborts a request whose client went away).  Instant replicas (zero costs) skip that and send a
streamed response in one body write.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from . import kvpull
from .asgi import Receive, Scope, Send, forever, read_body, until_disconnect, wait_disconnect
from .config import SimConfig
from .engine import SimEngine
from .model import PromptBlocks, output_pieces
from .protocol import (
    DONE,
    ApiError,
    ChunkWriter,
    CompletionRequest,
    completion_body,
    model_not_found,
    parse_request,
    simulated_overload,
    usage,
)

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]

_JSON = (b"content-type", b"application/json")
_SSE = (b"content-type", b"text/event-stream; charset=utf-8")
_NO_CACHE = (b"cache-control", b"no-cache")
_PROM = (b"content-type", b"text/plain; version=0.0.4; charset=utf-8")


class SimulatedDisconnect(Exception):
    """Raised inside the app after a partial body so the server drops the connection."""


class _Cut(Exception):
    """Internal: the chunk budget of a close/stall fault is used up."""


class SimApp:
    """One simulated replica.  ``engine`` is public for tests and in-process inspection."""

    def __init__(
        self, config: SimConfig, clock: Any = None, peer_lookup: kvpull.PeerLookup | None = None
    ) -> None:
        self.config = config
        self.engine = SimEngine(config, clock)
        self._http_lookup = kvpull.HttpPeerLookup() if peer_lookup is None else None
        self._lookup: kvpull.PeerLookup = peer_lookup or self._http_lookup
        self._ids = itertools.count(1)
        self._id_tag = os.urandom(3).hex()
        extra = [(b"x-sim-replica", config.name.encode())] if config.name else []
        self._json_headers = [_JSON, *extra]
        self._sse_headers = [_SSE, _NO_CACHE, *extra]
        started = int(time.time())
        self._models_body = orjson.dumps(
            {
                "object": "list",
                "data": [
                    {
                        "id": config.model,
                        "object": "model",
                        "created": started,
                        "owned_by": "kvgate-sim",
                    }
                ],
            }
        )
        self._routes: dict[str, dict[str, Handler]] = {
            "/v1/chat/completions": {"POST": self._chat},
            "/v1/completions": {"POST": self._completions},
            "/v1/models": {"GET": self._models},
            "/health": {"GET": self._health},
            "/metrics": {"GET": self._metrics},
            "/sim/state": {"GET": self._state},
            "/sim/faults": {"GET": self._get_faults, "POST": self._set_faults},
            "/sim/reset": {"POST": self._reset},
            "/sim/kv/lookup": {"POST": self._kv_lookup},
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            methods = self._routes.get(scope["path"])
            if methods is None:
                await self._error(
                    send, ApiError(404, f"no route {scope['path']}", code="not_found")
                )
                return
            handler = methods.get(scope["method"])
            if handler is None:
                await self._error(
                    send, ApiError(405, "method not allowed", code="method_not_allowed")
                )
                return
            await handler(scope, receive, send)
        elif kind == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    if self._http_lookup is not None:
                        await self._http_lookup.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    # -- plain responses -------------------------------------------------------------------

    async def _send(
        self, send: Send, status: int, body: bytes, headers: list | None = None
    ) -> None:
        hdrs = [*(headers or self._json_headers), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": status, "headers": hdrs})
        await send({"type": "http.response.body", "body": body})

    async def _error(self, send: Send, err: ApiError) -> None:
        await self._send(send, err.status, err.body())

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._send(send, 200, self._models_body)

    async def _probe_delay(self) -> None:
        if self.engine.faults.probe_delay_s > 0:
            await asyncio.sleep(self.engine.faults.probe_delay_s)

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._probe_delay()
        if self.engine.faults.unhealthy:
            await self._error(send, ApiError(503, "simulated unhealthy replica", "server_error"))
        else:
            await self._send(send, 200, b"")

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._probe_delay()
        await self._send(send, 200, self.engine.metrics_text(), [_PROM])

    async def _state(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._send(send, 200, orjson.dumps(self.engine.state()))

    async def _get_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._send(send, 200, orjson.dumps({"faults": self.engine.faults.to_dict()}))

    async def _set_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        if body is None:
            return
        try:
            changes = orjson.loads(body or b"{}")
            if not isinstance(changes, dict):
                raise ValueError("the body must be a JSON object of fault settings")
            faults = self.engine.set_faults(changes)
        except (ValueError, TypeError) as exc:  # orjson.JSONDecodeError is a ValueError
            await self._error(send, ApiError(400, str(exc)))
            return
        await self._send(send, 200, orjson.dumps({"faults": faults.to_dict()}))

    async def _reset(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.engine.reset()
        await self._send(send, 200, orjson.dumps(self.engine.state()))

    async def _kv_lookup(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        if body is None:
            return
        try:
            reply = kvpull.lookup_reply(body, self.engine.holdings, self.config)
        except ApiError as err:
            await self._error(send, err)
            return
        self.engine.stats.kv_lookups += 1
        await self._send(send, 200, reply)

    # -- completions -------------------------------------------------------------------------

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._completion(receive, send, chat=True)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._completion(receive, send, chat=False)

    async def _completion(self, receive: Receive, send: Send, *, chat: bool) -> None:
        body = await read_body(receive)
        if body is None:
            return
        engine = self.engine
        cfg = self.config
        try:
            req = parse_request(body, chat=chat, default_max_tokens=cfg.default_max_tokens)
            if req.model is not None and req.model != cfg.model:
                raise model_not_found(req.model)
            hint = kvpull.parse_pull_hint(req.kv_params)
            if engine.draw_error():
                raise simulated_overload()
        except ApiError as err:
            await self._error(send, err)
            return
        faults = engine.faults
        if faults.hang:
            await wait_disconnect(receive)
            return
        if req.token_ids is not None:
            prompt = engine.prompt_from_ids(req.token_ids)
        else:
            prompt = engine.prompt_from_segments(req.segments)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self._id_tag}{next(self._ids):x}"
        created = int(time.time())
        if req.stream:
            work = self._stream(req, prompt, rid, created, send, hint)
        else:
            work = self._respond(req, prompt, rid, created, send, hint)
        if cfg.instant and faults.stall_after_chunks is None:
            await work
        else:
            await until_disconnect(work, receive)

    def _cut_budget(self) -> int | None:
        f = self.engine.faults
        budgets = [b for b in (f.close_after_chunks, f.stall_after_chunks) if b is not None]
        return min(budgets) if budgets else None

    async def _break(self) -> None:
        """Act out the close/stall fault after the partial body has been sent."""
        f = self.engine.faults
        if f.close_after_chunks is not None and (
            f.stall_after_chunks is None or f.close_after_chunks <= f.stall_after_chunks
        ):
            raise SimulatedDisconnect("close_after_chunks fault")
        await forever()

    async def _peer(self, hint: kvpull.PullHint | None, prompt: PromptBlocks):
        if hint is None:
            return None
        return await kvpull.peer_holdings(self._lookup, hint, prompt, self.engine)

    def _headers(self, base: list, hint: kvpull.PullHint | None, pulled: int) -> list:
        return base if hint is None else [*base, (b"x-sim-pulled-tokens", b"%d" % pulled)]

    async def _respond(
        self, req: CompletionRequest, prompt: PromptBlocks, rid: str, created: int, send: Send,
        hint: kvpull.PullHint | None = None,
    ) -> None:
        n = req.max_tokens
        job = await self.engine.complete(prompt, n, await self._peer(hint, prompt))
        headers = self._headers(self._json_headers, hint, job.pulled_tokens)
        text = "".join(output_pieces(req.prompt_text, n))
        use = usage(job.prompt_tokens, job.cached_tokens, n)
        body = completion_body(
            req, rid, created, self.config.model, text, "length" if req.limited else "stop", use
        )
        if self._cut_budget() is None:
            await self._send(send, 200, body, headers)
            return
        hdrs = [*headers, (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": hdrs})
        await send(
            {"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True}
        )
        await self._break()

    async def _stream(
        self, req: CompletionRequest, prompt: PromptBlocks, rid: str, created: int, send: Send,
        hint: kvpull.PullHint | None = None,
    ) -> None:
        budget = self._cut_budget()
        pull = hint is not None and budget != 0  # the headers wait for it (x-sim-pulled-tokens)
        if not pull:
            await send({"type": "http.response.start", "status": 200, "headers": self._sse_headers})
        peer = await self._peer(hint, prompt) if pull else None
        engine = self.engine
        writer = ChunkWriter(req, rid, created, self.config.model)
        pieces = output_pieces(req.prompt_text, req.max_tokens)
        flush_each = self.config.decode_s_per_token > 0
        buf: list[bytes] = []

        def emit(chunk: bytes) -> None:
            nonlocal budget
            buf.append(chunk)
            if budget is not None:
                budget -= 1
                if budget <= 0:
                    raise _Cut

        async def flush() -> None:
            if buf:
                body = b"".join(buf)
                buf.clear()
                await send({"type": "http.response.body", "body": body, "more_body": True})

        try:
            if budget == 0:  # cut before anything is computed
                raise _Cut
            job = await engine.admit(prompt)
            completed = False
            try:
                if pull:
                    await engine.pull(job, peer)
                    hdrs = self._headers(self._sse_headers, hint, job.pulled_tokens)
                    await send({"type": "http.response.start", "status": 200, "headers": hdrs})
                await engine.prefill(job)
                if req.chat:
                    emit(writer.role())
                emit(writer.token(pieces[0]))
                for piece in itertools.islice(pieces, 1, None):
                    if flush_each:
                        await flush()
                    await engine.decode(job)
                    emit(writer.token(piece))
                completed = True
            finally:
                engine.finish(job, completed=completed)
            emit(writer.final("length" if req.limited else "stop"))
            if req.include_usage:
                emit(writer.usage(usage(job.prompt_tokens, job.cached_tokens, len(pieces))))
            emit(DONE)
        except _Cut:
            cut = True
        else:
            cut = False
        finally:
            engine.release(peer)  # a pull announced and not made (cancelled while queued)
        if cut:  # outside the except block: no chained traceback in the server's log
            await flush()
            await self._break()
            return
        await send({"type": "http.response.body", "body": b"".join(buf), "more_body": False})


def build_sim_app(
    config: SimConfig | None = None, clock: Any = None, peer_lookup: kvpull.PeerLookup | None = None
) -> SimApp:
    """An ASGI app simulating one replica (``clock``: see :mod:`gateway.sim.clock`)."""
    return SimApp(config if config is not None else SimConfig(), clock, peer_lookup)
