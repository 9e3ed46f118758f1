"""What the proxy keeps of one request while it forwards it (``gateway.proxy``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from policies.types import ClusterView, Decision, RequestFeatures

from .errors import KvgateError


def target(scope) -> str:
    """The request's path and query string, as sent upstream."""
    qs = scope.get("query_string", b"")
    return scope["path"] + ("?" + qs.decode("latin-1") if qs else "")


@dataclass(slots=True, eq=False)  # identity hash: a key of DisconnectWatch.pending
class Exchange:
    """Per-request bookkeeping shared by the proxy's helpers."""

    route: str
    request_id: str
    request_id_b: bytes
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
    watcher: asyncio.Task | None = None  # started only for requests that run a while
    view: ClusterView | None = None  # the snapshot decided on, until on_dispatch has seen it
    turn: tuple | None = None  # (parsed, path, headers): its answer warms the next turn
    answer: str | None = None
