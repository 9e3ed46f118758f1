"""Routing policies: pure code, no I/O.  See :mod:`policies.base` for the contract."""

from . import native  # noqa: F401  first: it picks compiled or source modules (see policies.native)

# isort: split
from .base import BasePolicy, Policy, rendezvous_order
from .cache_aware import CacheAware, CacheAwareParams
from .deps import PolicyDeps
from .errors import NoReplicaError, PolicyConfigError, PolicyError
from .prefix import PrefixParams, PrefixPolicy
from .prefix_index import PrefixIndex
from .registry import PolicyRegistry
from .sessions import SessionTable
from .simple import LeastLoad, LeastLoadParams, NoParams, RandomParams, RandomPolicy, RoundRobin
from .sticky import SessionParams, SessionPolicy
from .types import ClusterView, Decision, Outcome, ReplicaState, RequestFeatures

DEFAULT_POLICY = "cache_aware"

__all__ = [
    "DEFAULT_POLICY",
    "BasePolicy",
    "CacheAware",
    "CacheAwareParams",
    "ClusterView",
    "Decision",
    "NoReplicaError",
    "Outcome",
    "Policy",
    "PolicyConfigError",
    "PolicyDeps",
    "PolicyError",
    "PolicyRegistry",
    "PrefixIndex",
    "PrefixParams",
    "PrefixPolicy",
    "ReplicaState",
    "RequestFeatures",
    "SessionParams",
    "SessionPolicy",
    "SessionTable",
    "default_registry",
    "rendezvous_order",
]


def default_registry() -> PolicyRegistry:
    """A registry holding every built-in policy (a new one each call: no global state).

    Factories take ``(params, deps)``; ``deps`` is a :class:`PolicyDeps` shared by the gateway's
    policies, or None for fresh private state.
    """
    reg = PolicyRegistry()
    reg.register("round_robin", NoParams, lambda p, d: RoundRobin(), "cycle over replicas")
    reg.register("random", RandomParams, lambda p, d: RandomPolicy(p), "uniform random")
    reg.register(
        "least_load", LeastLoadParams, lambda p, d: LeastLoad(p), "power-of-two choices on load"
    )
    reg.register(
        "session",
        SessionParams,
        SessionPolicy,
        "sticky sessions, bounded-load rendezvous placement",
    )
    reg.register(
        "prefix", PrefixParams, PrefixPolicy, "longest prefix match unless imbalanced (SGLang-like)"
    )
    reg.register(
        "cache_aware",
        CacheAwareParams,
        CacheAware,
        "least predicted TTFT: queue delay + uncached prefill, bounded load, rendezvous ties",
    )
    return reg
