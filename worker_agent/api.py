"""The agent's HTTP control API (Starlette): JSON in, JSON out, every error as JSON.

Routes::

    GET  /health      {"status": "ok", "name", "data_address", "events_endpoint"}
    GET  /v1/stats    store per tier, events (endpoint, next seq), transfers, shared-store sink
    POST /v1/lookup   {"hashes": [h, ...], "count_hit": true}
                      -> {"tiers": ["GPU" | "CPU" | "DISK" | null, ...], "prefix_blocks": n,
                          "held": m}   (prefix_blocks: leading hashes held, in any tier; they
                          count as a hit on that prefix for replication unless count_hit=false)
    POST /v1/pull     {"peer": "host:port", "hashes": [...], "prefix": true, "tier": "GPU"}
                      -> {"requested", "received", "stored", "rejected", "stale", "missing",
                          "bytes", "seconds"}   fetch from the peer agent's data port into this
                          store (a copy older than the held block is refused: "stale")
                          (prefix=true stops at the first block the peer lacks)
    POST /v1/push     {"peer": "host:port", "hashes": [...]}
                      -> {"requested", "sent", "stored_by_peer", "missing", "bytes", "seconds"}
    POST /v1/replicate {}  -> run one hot-prefix replication round now:
                          {"alive", "hot", "pushed": [{"prefix", "dst", "blocks"}], "deferred",
                           "failed", "lost"}   (prefixes as hex strings)

A hash is a uint64, as a JSON integer or a hex string (``"0x..."``, for clients whose numbers are
doubles).  ``peer`` is the other agent's data address (its ``/health`` ``data_address``).
Errors: ``{"error": {"message", "type", "code"}}`` with 400 (bad JSON or fields), 404, 405,
413 (more than ``max_hashes`` hashes), 502 (the peer failed or refused), 504 (the peer timed out).
"""

from __future__ import annotations

import contextlib

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .errors import AgentError, TransferTimeout, TransportError
from .replication import RoundReport
from .service import AgentService

_U64 = (1 << 64) - 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def _json(data: object, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status, media_type="application/json")


def _error(status: int, message: str, code: str) -> Response:
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    return _json({"error": {"message": message, "type": kind, "code": code}}, status)


async def _body(request: Request) -> dict:
    try:
        data = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"invalid JSON body: {exc}", "invalid_json") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    return data


def _hash(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, str):
        value = int(value, 16)
    if not isinstance(value, int) or not 0 <= value <= _U64:
        raise ValueError
    return value


def parse_hashes(data: dict, limit: int) -> list[int]:
    raw = data.get("hashes")
    if not isinstance(raw, list):
        raise ApiError(400, "'hashes' must be a list of uint64 (integers or hex strings)")
    if len(raw) > limit:
        raise ApiError(413, f"at most {limit} hashes per request, got {len(raw)}", "too_many")
    try:
        return [_hash(v) for v in raw]
    except (ValueError, TypeError):
        raise ApiError(400, "'hashes' must be a list of uint64 (integers or hex strings)") from None


def parse_peer(data: dict) -> str:
    peer = data.get("peer")
    if not isinstance(peer, str):
        raise ApiError(400, "'peer' must be the other agent's data address 'host:port'")
    peer = peer.removeprefix("tcp://")
    host, sep, port = peer.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ApiError(400, f"'peer' must be 'host:port', got {data.get('peer')!r}")
    return f"{host or '127.0.0.1'}:{port}"


def _flag(data: dict, key: str, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"'{key}' must be a boolean")
    return value


def round_json(report: RoundReport) -> dict:
    def copies(items) -> list[dict]:
        return [{"prefix": hex(c.prefix), "dst": c.dst, "blocks": c.blocks} for c in items]

    return {
        "alive": list(report.alive),
        "hot": len(report.rates),
        "pushed": copies(report.pushed),
        "deferred": copies(report.deferred),
        "failed": copies(report.failed),
        "lost": [hex(p) for p in report.plan.lost],
    }


def build_app(agent: AgentService) -> Starlette:
    """The control API of ``agent``; the app's lifespan starts and closes the agent."""
    limit = agent.config.max_hashes

    async def health(request: Request) -> Response:
        pub = agent.publisher
        return _json(
            {"status": "ok", "name": agent.config.name, "data_address": agent.data_address,
             "events_endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}
        )  # fmt: skip

    async def stats(request: Request) -> Response:
        return _json(agent.stats())

    async def lookup(request: Request) -> Response:
        data = await _body(request)
        hashes = parse_hashes(data, limit)
        return _json(agent.lookup(hashes, count_hit=_flag(data, "count_hit", True)))

    async def pull(request: Request) -> Response:
        data = await _body(request)
        peer, hashes = parse_peer(data), parse_hashes(data, limit)
        prefix = _flag(data, "prefix", True)
        tier = data.get("tier", agent.mediums[0])
        if not isinstance(tier, str):
            raise ApiError(400, "'tier' must be a tier name")
        try:
            index = agent.tier_index(tier)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        return _json(await agent.pull(peer, hashes, prefix=prefix, tier=index))

    async def push(request: Request) -> Response:
        data = await _body(request)
        return _json(await agent.push(parse_peer(data), parse_hashes(data, limit)))

    async def replicate(request: Request) -> Response:
        return _json(round_json(await agent.replicator.replicate_once(agent.clock())))

    async def api_error(request: Request, exc: ApiError) -> Response:
        return _error(exc.status, str(exc), exc.code)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error(exc.status_code, str(exc.detail), code)

    async def agent_error(request: Request, exc: AgentError) -> Response:
        if isinstance(exc, TransferTimeout):
            return _error(504, str(exc), "peer_timeout")
        if isinstance(exc, TransportError):
            return _error(502, str(exc), "peer_error")
        return _error(502, str(exc), "block_error")  # e.g. a checksum mismatch from the peer

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await agent.start()
        try:
            yield
        finally:
            await agent.close()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/stats", stats, methods=["GET"]),
        Route("/v1/lookup", lookup, methods=["POST"]),
        Route("/v1/pull", pull, methods=["POST"]),
        Route("/v1/push", push, methods=["POST"]),
        Route("/v1/replicate", replicate, methods=["POST"]),
    ]
    handlers = {ApiError: api_error, HTTPException: http_error, AgentError: agent_error}
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
