"""Routing policies: pure code, no I/O.  See :mod:`policies.base` for the contract."""

from .base import BasePolicy, Policy, rendezvous_order
from .errors import NoReplicaError, PolicyConfigError, PolicyError
from .registry import PolicyRegistry
from .simple import LeastLoad, LeastLoadParams, NoParams, RandomParams, RandomPolicy, RoundRobin
from .types import ClusterView, Decision, Outcome, ReplicaState, RequestFeatures

__all__ = [
    "BasePolicy",
    "ClusterView",
    "Decision",
    "NoReplicaError",
    "Outcome",
    "Policy",
    "PolicyConfigError",
    "PolicyError",
    "PolicyRegistry",
    "ReplicaState",
    "RequestFeatures",
    "default_registry",
    "rendezvous_order",
]


def default_registry() -> PolicyRegistry:
    """A registry holding every built-in policy (a new one each call: no global state)."""
    reg = PolicyRegistry()
    reg.register("round_robin", NoParams, lambda p, d: RoundRobin(), "cycle over replicas")
    reg.register("random", RandomParams, lambda p, d: RandomPolicy(p), "uniform random")
    reg.register(
        "least_load", LeastLoadParams, lambda p, d: LeastLoad(p), "power-of-two choices on load"
    )
    return reg
