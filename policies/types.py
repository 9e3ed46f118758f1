"""Plain data exchanged between the gateway and the policies (no I/O, no framework types)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class ReplicaState(NamedTuple):
    """One replica as a policy sees it in a snapshot.

    ``in_flight`` is what the gateway(s) have sent and not yet seen finish; ``running`` and
    ``waiting`` are the engine's own numbers scraped from its /metrics (0 when unknown);
    ``kv_usage`` is the engine's KV-cache utilisation in [0, 1].  ``held`` of the ``in_flight``
    wait at the gateway for a prefill they follow: the replica will have them, but a request sent
    now queues ahead of them.  ``pull_ms_per_token``: what pulling a token's KV from a peer costs
    this replica, as its engine advertises it (``kvgate:kv_pull_info``); below 0 when it
    advertises nothing (it cannot pull, or nobody knows).  A named tuple rather than a
    frozen dataclass: the gateway builds one per replica per request, and a tuple is built in a
    third of the time.
    """

    id: str
    url: str = ""
    healthy: bool = True
    in_flight: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    models: frozenset[str] = frozenset()
    draining: bool = False
    held: int = 0  # of ``in_flight``: held at a gateway (``Decision.hold_s``), not sent yet
    pull_ms_per_token: float = -1.0  # advertised KV pull cost, ms per token (< 0: none)

    @property
    def load(self) -> int:
        """Best estimate of requests the replica is working on or queueing."""
        return max(self.in_flight, self.running + self.waiting)

    def serves(self, model: str) -> bool:
        return not self.models or model in self.models


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """What the gateway learnt from one parse of the request body."""

    model: str
    prefix_hashes: tuple[int, ...] = ()
    tokens_per_hash: int = 64  # estimated prompt tokens covered by one prefix hash
    prompt_tokens: int = 0  # estimated prompt length in tokens
    max_tokens: int = 0  # requested output tokens, 0 if unset
    session_key: str | None = None
    stream: bool = False
    prompt_bytes: int = 0  # the rendered prompt's length in bytes (what ``prompt_tokens`` estimates)


@dataclass(frozen=True, slots=True)
class ClusterView:
    """A consistent snapshot of the replicas that may serve a request, taken at ``now``."""

    replicas: tuple[ReplicaState, ...]
    now: float = 0.0

    def by_id(self, replica_id: str) -> ReplicaState | None:
        for r in self.replicas:
            if r.id == replica_id:
                return r
        return None


@dataclass(slots=True)
class Decision:
    """Where to send a request, where to retry, and why (not frozen: a frozen dataclass takes three
    times as long to build, and a policy builds one per request; nobody changes one).

    ``pull_from``: a migration hint -- the id of a replica holding more of the prompt's prefix
    than ``replica`` does, from which ``replica`` should pull ``pull_tokens`` tokens of KV cache
    instead of recomputing them (the gateway passes it on in ``kv_transfer_params``).
    ``predicted_cached_tokens`` then counts the pulled tokens.
    ``hold_s``: send the request only after this many seconds (a prefill of its prefix is in
    flight on ``replica`` and will be done by then; ``predicted_cached_tokens`` counts it).
    ``warm``: a prefill-only request to send alongside (the same prompt, one output token) to
    ``warm.replica``: a copy of the prompt's prefix made there without a client waiting for it.
    The gateway reports it to the policy as a request of its own (``on_dispatch`` with ``warm``
    and features whose ``max_tokens`` is 1, then ``on_first_token`` / ``on_complete``).
    """

    replica: str
    alternates: tuple[str, ...] = ()
    reason: str = ""
    predicted_cached_tokens: int = 0
    scores: dict[str, float] = field(default_factory=dict, compare=False)
    pull_from: str | None = None
    pull_tokens: int = 0
    hold_s: float = 0.0
    warm: Decision | None = None

    def candidates(self) -> tuple[str, ...]:
        return (self.replica, *self.alternates)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to a routed request, reported back to the policy.

    ``predicted_cached_tokens`` is the routing decision's prediction (``Decision``'s field), passed
    back so a policy can compare it with ``cached_tokens`` without keeping per-request state.
    """

    ok: bool
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    latency_s: float = 0.0
    ttft_s: float | None = None
    predicted_cached_tokens: int | None = None
