"""``session``: sticky sessions with bounded-load rendezvous placement.

Algorithm (filter -> score -> pick):

* Filter: healthy, non-draining replicas serving the model (``BasePolicy.eligible``).
* Key: ``features.session_key``; without one, the first prefix hash (stateless: no binding is
  recorded, rendezvous alone keeps equal prefixes together); without either, least load.
* Bound: a replica is overloaded when ``load > load_factor * mean_load + load_slack``
  (:class:`policies.scoring.LoadBound`; defaults c = 1.25, slack = 1 request).
* Bound session: if the ``SessionTable`` maps the key to an eligible replica that is not overloaded,
  stay there (reason ``session``).
* Otherwise: rendezvous (HRW) order of the key over the eligible replicas; the first one under the
  bound wins (reason ``rendezvous``, or ``session-moved`` when a live binding was left behind);
  if every replica is over the bound, the least loaded (``load-fallback``).
* Alternates: the remaining replicas in HRW order, those under the bound first.
* ``on_dispatch`` binds the session key to the chosen replica (refreshing its TTL).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import BasePolicy, decision_from_order, rendezvous_order
from .deps import resolve_deps
from .scoring import LoadBound
from .types import ClusterView, Decision, RequestFeatures


@dataclass(frozen=True)
class SessionParams:
    load_factor: float = 1.25
    load_slack: float = 1.0

    def validate(self) -> None:
        LoadBound(self.load_factor, self.load_slack).validate()


class SessionPolicy(BasePolicy):
    name = "session"

    def __init__(self, params: SessionParams, deps: object = None) -> None:
        d = resolve_deps(deps)
        self._sessions = d.sessions
        self._bound = LoadBound(params.load_factor, params.load_slack)

    def select(self, req: RequestFeatures, view: ClusterView) -> Decision:
        replicas = self.eligible(req, view)
        limit = self._bound.limit([r.load for r in replicas])
        key = req.session_key
        bound_id = self._sessions.peek(key) if key is not None else None
        if key is None:
            if not req.prefix_hashes:
                order = sorted(replicas, key=lambda r: (r.load, r.id))
                return decision_from_order(order, "load-fallback", load=float(order[0].load))
            key = req.prefix_hashes[0]
        order = rendezvous_order(key, replicas)
        if bound_id is not None:
            for i, r in enumerate(order):
                if r.id == bound_id:
                    if r.load <= limit:
                        return decision_from_order(
                            [r, *order[:i], *order[i + 1 :]], "session", load=float(r.load)
                        )
                    break
        under = [r for r in order if r.load <= limit]
        over = [r for r in order if r.load > limit]
        if under:
            reason = "session-moved" if bound_id is not None else "rendezvous"
            return decision_from_order(under + over, reason, load=float(under[0].load))
        over.sort(key=lambda r: r.load)
        return decision_from_order(over, "load-fallback", load=float(over[0].load))

    def on_dispatch(self, req: RequestFeatures, decision: Decision, view: ClusterView) -> None:
        if req.session_key is not None:
            self._sessions.bind(req.session_key, decision.replica)
