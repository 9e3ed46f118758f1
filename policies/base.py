"""The one policy contract: filter -> score -> pick.

A policy gets a :class:`ClusterView` snapshot and the request's :class:`RequestFeatures` and returns
a :class:`Decision`.  ``select`` has no side effects; what a policy learns from routing arrives
through the optional hooks ``on_dispatch`` (the gateway sent the request), ``on_first_token`` (its
first token came back: the prompt is cached there) and ``on_complete`` (it finished), which default
to no-ops.  ``hold_left`` answers a request the decision held (``Decision.hold_s``) whether it
should still wait, each time a first token comes back from its replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from .errors import NoReplicaError
from .scoring import hrw_weight, rendezvous_seed
from .types import ClusterView, Decision, Outcome, ReplicaState, RequestFeatures


@runtime_checkable
class Policy(Protocol):
    name: str

    def select(self, req: RequestFeatures, view: ClusterView) -> Decision: ...

    def on_dispatch(self, req: RequestFeatures, decision: Decision, view: ClusterView) -> None: ...

    def on_complete(self, req: RequestFeatures, replica_id: str, outcome: Outcome) -> None: ...

    def on_first_token(self, req: RequestFeatures, replica_id: str) -> None: ...

    def hold_left(self, req: RequestFeatures, replica_id: str) -> float: ...


class BasePolicy:
    """Shared plumbing: the eligibility filter and no-op hooks."""

    name = "base"

    def eligible(self, req: RequestFeatures, view: ClusterView) -> list[ReplicaState]:
        """Healthy, non-draining replicas that serve the request's model."""
        model = req.model  # r.serves(model), inlined: this runs for every request
        out = [
            r
            for r in view.replicas
            if r.healthy and not r.draining and (not r.models or model in r.models)
        ]
        if not out:
            raise NoReplicaError(req.model)
        return out

    def on_dispatch(self, req: RequestFeatures, decision: Decision, view: ClusterView) -> None:
        return None

    def on_complete(self, req: RequestFeatures, replica_id: str, outcome: Outcome) -> None:
        return None

    def on_first_token(self, req: RequestFeatures, replica_id: str) -> None:
        """The replica produced the request's first token: its prompt is in the replica's cache."""
        return None

    def hold_left(self, req: RequestFeatures, replica_id: str) -> float:
        """Seconds a request held by ``Decision.hold_s`` should still wait (0: send it now)."""
        return 0.0


def rendezvous_order(key: int | str | bytes, replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    """Replicas ordered by highest-random-weight (rendezvous) hashing of ``key``.

    Independent gateways compute the same order for the same key and replica set, and removing one
    replica only moves the keys that ranked it first.
    """
    seed = rendezvous_seed(key)
    return sorted(replicas, key=lambda r: hrw_weight(seed, r.id), reverse=True)


def decision_from_order(
    order: Sequence[ReplicaState], reason: str, predicted_cached_tokens: int = 0, **scores: float
) -> Decision:
    """A decision that picks ``order[0]`` and keeps the rest as ordered retry alternates."""
    return Decision(
        replica=order[0].id,
        alternates=tuple(r.id for r in order[1:]),
        reason=reason,
        predicted_cached_tokens=predicted_cached_tokens,
        scores=dict(scores),
    )
