"""Runtime replica management: list, add, drain, undrain, remove (drain first, then remove).

Mutations need ``Authorization: Bearer <admin_token>`` when an admin token is configured, and
otherwise are accepted only from loopback clients.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .config import ReplicaConfig
from .errors import BadRequest, ConfigError, Forbidden, KvgateError, NotFound, Unauthorized
from .health import check_replica

LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


def _json(data: object, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _error(exc: KvgateError) -> Response:
    return Response(exc.body(), status_code=exc.status, media_type="application/json")


class AdminApi:
    def __init__(
        self, get_state: Callable[[], object], on_removed: Callable[[str], None] = lambda rid: None
    ) -> None:
        self._state = get_state
        self._on_removed = on_removed  # forget what the local view knows of a removed replica

    def routes(self) -> list[Route]:
        return [
            Route("/admin/replicas", self.list, methods=["GET"]),
            Route("/admin/replicas", self.add, methods=["POST"]),
            Route("/admin/replicas/{replica_id}/drain", self.drain, methods=["POST"]),
            Route("/admin/replicas/{replica_id}/undrain", self.undrain, methods=["POST"]),
            Route("/admin/replicas/{replica_id}", self.remove, methods=["DELETE"]),
        ]

    def _authorize(self, request: Request) -> None:
        token = self._state().cfg.admin_token
        if token:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                raise Unauthorized("admin token missing or wrong")
            return
        host = request.client.host if request.client else ""
        if host not in LOOPBACK:
            raise Forbidden("admin changes are accepted from loopback only unless admin_token is set")

    def _replica(self, request: Request):
        rid = request.path_params["replica_id"]
        rep = self._state().pool.get(rid)
        if rep is None:
            raise NotFound(f"no replica {rid!r}", code="replica_not_found")
        return rep

    async def list(self, request: Request) -> Response:
        return _json({"replicas": [r.to_json() for r in self._state().pool]})

    async def add(self, request: Request) -> Response:
        try:
            self._authorize(request)
            try:
                data = orjson.loads(await request.body())
                if not isinstance(data, dict) or not isinstance(data.get("url"), str):
                    raise BadRequest("body must be an object with a 'url'", param="url")
                models = data.get("models") or ()
                cfg = ReplicaConfig(url=data["url"], models=tuple(models), id=str(data.get("id") or ""))
            except (orjson.JSONDecodeError, ConfigError, TypeError) as exc:
                raise BadRequest(f"bad replica: {exc}") from exc
            st = self._state()
            if st.pool.get(cfg.id) is not None:
                raise BadRequest(f"replica {cfg.id!r} already exists", code="replica_exists")
            rep = st.pool.add(cfg)
            await check_replica(st.proxy.client, rep, st.cfg.connect_timeout_s)
            return _json(rep.to_json(), 201)
        except KvgateError as exc:
            return _error(exc)

    async def _set_drain(self, request: Request, draining: bool) -> Response:
        try:
            self._authorize(request)
            rep = self._replica(request)
            rep.draining = draining
            return _json(rep.to_json())
        except KvgateError as exc:
            return _error(exc)

    async def drain(self, request: Request) -> Response:
        return await self._set_drain(request, True)

    async def undrain(self, request: Request) -> Response:
        return await self._set_drain(request, False)

    async def remove(self, request: Request) -> Response:
        try:
            self._authorize(request)
            rep = self._replica(request)
            removed = self._state().pool.retire(rep.id)
            self._on_removed(rep.id)
            body = {"id": rep.id, "removed": bool(removed), "in_flight": rep.in_flight}
            return _json(body, 200 if removed else 202)
        except KvgateError as exc:
            return _error(exc)
