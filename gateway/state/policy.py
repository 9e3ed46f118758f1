"""SharedPolicy: a delegating wrapper that reports every routing decision to the shared state.

The request path is untouched: ``select``, ``on_first_token``, ``hold_left`` and ``on_complete``
are the inner policy's own bound methods, and ``on_dispatch`` calls the inner policy's (which updates the local view) and then
appends one entry to the sync outbox (:meth:`StateSync.record`: a deque append, no I/O).
``name`` and every other attribute pass through.
"""

from __future__ import annotations

from policies.types import ClusterView, Decision, RequestFeatures


def _no_first_token(req: RequestFeatures, replica_id: str) -> None:
    return None


def _no_hold(req: RequestFeatures, replica_id: str) -> float:
    return 0.0


class SharedPolicy:
    def __init__(self, inner, sync) -> None:
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)
        self.select = inner.select
        self.on_complete = inner.on_complete
        # optional hooks (``policies.base.BasePolicy`` has them; a bare Policy may not)
        self.on_first_token = getattr(inner, "on_first_token", _no_first_token)
        self.hold_left = getattr(inner, "hold_left", _no_hold)
        self._inner_dispatch = inner.on_dispatch
        self._record = sync.record

    def on_dispatch(self, req: RequestFeatures, decision: Decision, view: ClusterView) -> None:
        self._inner_dispatch(req, decision, view)
        self._record(decision.replica, req.prefix_hashes, req.session_key)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
