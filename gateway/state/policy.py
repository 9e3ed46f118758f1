"""SharedPolicy: a delegating wrapper that reports every routing decision to the shared state.

The request path is untouched: ``select`` and ``on_complete`` are the inner policy's own bound
methods, and ``on_dispatch`` calls the inner policy's (which updates the local view) and then
appends one entry to the sync outbox (:meth:`StateSync.record`: a deque append, no I/O).
``name`` and every other attribute pass through (the optional hooks ``on_first_token`` and
``hold_left`` too: the proxy looks them up once, in ``gateway.holds``).
"""

from __future__ import annotations

from policies.types import ClusterView, Decision, RequestFeatures


class SharedPolicy:
    def __init__(self, inner, sync) -> None:
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)
        self.select = inner.select
        self.on_complete = inner.on_complete
        self._inner_dispatch = inner.on_dispatch
        self._record = sync.record

    def on_dispatch(self, req: RequestFeatures, decision: Decision, view: ClusterView) -> None:
        self._inner_dispatch(req, decision, view)
        self._record(decision.replica, req.prefix_hashes, req.session_key)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
