"""``prefix``: longest prefix match with load balancing (SGLang's cache_aware, over our index).

Algorithm (filter -> score -> pick):

* Filter: healthy, non-draining replicas serving the model.
* Imbalance check (SGLang): with ``lo``/``hi`` the min/max load, if ``hi - lo >
  balance_abs_threshold`` and ``hi > balance_rel_threshold * lo`` the cluster is imbalanced: go to
  the least loaded replica (reason ``load-fallback``).
* Score: ``PrefixIndex.match`` gives each replica's matched leading hashes; the best is the longest
  match (ties: lower load, then rendezvous weight).  ``match_rate = matched / len(prefix_hashes)``.
* Pick: if ``match_rate >= cache_threshold`` and the best is not over the load bound
  (``load > load_factor * mean + load_slack``) go there (``prefix-hit``); otherwise the least loaded
  replica, ties broken by rendezvous hashing of the session key or first prefix hash, so cold
  prefixes spread over idle replicas instead of piling onto one (``cold-rendezvous``, or
  ``load-fallback`` when a usable match was passed over because of load).
* Alternates: the others by (matched desc, load) for a hit, by (load, rendezvous) otherwise.
* ``on_dispatch`` inserts the request's prefix chain into the index for the chosen replica.

Defaults follow sgl-router: cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold
1.5; the load bound uses load_factor 1.25 and load_slack 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import BasePolicy
from .deps import resolve_deps
from .scoring import LoadBound, hrw_weight, prompt_tokens, rendezvous_key, rendezvous_seed
from .types import ClusterView, Decision, RequestFeatures


@dataclass(frozen=True)
class PrefixParams:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    load_factor: float = 1.25
    load_slack: float = 1.0

    def validate(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        if self.balance_abs_threshold < 0:
            raise ValueError("balance_abs_threshold must be >= 0")
        if self.balance_rel_threshold < 1.0:
            raise ValueError("balance_rel_threshold must be >= 1")
        LoadBound(self.load_factor, self.load_slack).validate()


class PrefixPolicy(BasePolicy):
    name = "prefix"

    def __init__(self, params: PrefixParams, deps: object = None) -> None:
        d = resolve_deps(deps)
        self._index = d.index
        self._clock = d.clock
        self._p = params
        self._bound = LoadBound(params.load_factor, params.load_slack)

    def select(self, req: RequestFeatures, view: ClusterView) -> Decision:
        replicas = self.eligible(req, view)
        p = self._p
        seed = rendezvous_seed(rendezvous_key(req))
        weight = {r.id: hrw_weight(seed, r.id) for r in replicas}
        loads = [r.load for r in replicas]
        lo, hi = min(loads), max(loads)
        imbalanced = hi - lo > p.balance_abs_threshold and hi > p.balance_rel_threshold * lo
        n = len(req.prefix_hashes)
        matched = self._index.match(req.prefix_hashes) if n and not imbalanced else {}
        best = max(replicas, key=lambda r: (matched.get(r.id, 0), -r.load, weight[r.id]))
        best_len = matched.get(best.id, 0)
        rate = best_len / n if n else 0.0
        if best_len and rate >= p.cache_threshold and best.load <= self._bound.limit(loads):
            rest = sorted(
                (r for r in replicas if r is not best),
                key=lambda r: (-matched.get(r.id, 0), r.load, -weight[r.id]),
            )
            return Decision(
                replica=best.id,
                alternates=tuple(r.id for r in rest),
                reason="prefix-hit",
                predicted_cached_tokens=min(prompt_tokens(req), best_len * req.tokens_per_hash),
                scores={"match_rate": rate, "load": float(best.load)},
            )
        order = sorted(replicas, key=lambda r: (r.load, -weight[r.id]))
        chosen = order[0]
        got = matched.get(chosen.id, 0)
        reason = (
            "load-fallback"
            if imbalanced or (best_len and rate >= p.cache_threshold)
            else "cold-rendezvous"
        )
        return Decision(
            replica=chosen.id,
            alternates=tuple(r.id for r in order[1:]),
            reason=reason,
            predicted_cached_tokens=min(prompt_tokens(req), got * req.tokens_per_hash),
            scores={"match_rate": got / n if n else 0.0, "load": float(chosen.load)},
        )

    def on_dispatch(self, req: RequestFeatures, decision: Decision, view: ClusterView) -> None:
        if req.prefix_hashes:
            self._index.insert(decision.replica, req.prefix_hashes, self._clock())
