"""Load-oblivious and load-only policies: round_robin, random, least_load."""

from __future__ import annotations

import random as _random
from dataclasses import dataclass

from .base import BasePolicy, decision_from_order
from .types import ClusterView, Decision, RequestFeatures


@dataclass(frozen=True)
class NoParams:
    pass


class RoundRobin(BasePolicy):
    """Cycle over the eligible replicas in id order; alternates follow the cycle."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, req: RequestFeatures, view: ClusterView) -> Decision:
        replicas = sorted(self.eligible(req, view), key=lambda r: r.id)
        start = self._next % len(replicas)
        return decision_from_order(replicas[start:] + replicas[:start], "round_robin")

    def on_dispatch(self, req: RequestFeatures, decision: Decision, view: ClusterView) -> None:
        self._next += 1


@dataclass(frozen=True)
class RandomParams:
    seed: int = -1  # -1: seeded from the OS

    def validate(self) -> None:
        if self.seed < -1:
            raise ValueError("seed must be >= -1")


class RandomPolicy(BasePolicy):
    """Uniformly random replica; alternates in random order."""

    name = "random"

    def __init__(self, params: RandomParams) -> None:
        self._rng = _random.Random(None if params.seed == -1 else params.seed)

    def select(self, req: RequestFeatures, view: ClusterView) -> Decision:
        replicas = self.eligible(req, view)
        order = self._rng.sample(replicas, len(replicas))
        return decision_from_order(order, "random")


@dataclass(frozen=True)
class LeastLoadParams:
    choices: int = 2  # power of d choices; 0 means look at every replica
    seed: int = -1

    def validate(self) -> None:
        if self.choices < 0:
            raise ValueError("choices must be >= 0")


class LeastLoad(BasePolicy):
    """Power-of-d-choices on load (in-flight, or running + waiting when scraped higher)."""

    name = "least_load"

    def __init__(self, params: LeastLoadParams) -> None:
        self._d = params.choices
        self._rng = _random.Random(None if params.seed == -1 else params.seed)

    def select(self, req: RequestFeatures, view: ClusterView) -> Decision:
        replicas = self.eligible(req, view)
        if self._d and self._d < len(replicas):
            sampled = self._rng.sample(replicas, self._d)
        else:
            sampled = replicas
        best = min(sampled, key=lambda r: (r.load, r.kv_usage))
        rest = sorted((r for r in replicas if r is not best), key=lambda r: (r.load, r.kv_usage))
        return decision_from_order([best, *rest], "least_load", load=float(best.load))
