"""Small pure helpers shared by the cache-aware family of policies.

* Bounded load (Mirrokni et al., "consistent hashing with bounded loads"): a replica is over the
  bound when ``load > factor * mean_load + slack``, the mean taken over the eligible replicas.
  ``factor`` (c) is about 1.25; ``slack`` (in requests) keeps a near-idle cluster from treating one
  extra request as an overload, which would throw cache affinity away for nothing.  The least
  loaded replica is never over the bound, so a bounded choice always exists.
* Rendezvous (highest-random-weight) keys: the session key when there is one, else the first prefix
  hash (it names the first chunk of the prompt), else the model.  Every gateway computes the same
  weights for the same key and replica ids, so they agree without talking.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from .types import RequestFeatures

_xxh3 = xxhash.xxh3_64_intdigest


@dataclass(frozen=True)
class LoadBound:
    factor: float = 1.25
    slack: float = 1.0

    def validate(self) -> None:
        if self.factor < 1.0:
            raise ValueError("load_factor must be >= 1")
        if self.slack < 0.0:
            raise ValueError("load_slack must be >= 0")

    def limit(self, loads: Sequence[int]) -> float:
        """Loads above this are over the bound (``loads`` of the eligible replicas)."""
        return self.factor * sum(loads) / len(loads) + self.slack


def rendezvous_key(req: RequestFeatures) -> int | str:
    if req.session_key is not None:
        return req.session_key
    if req.prefix_hashes:
        return req.prefix_hashes[0]
    return req.model


def rendezvous_seed(key: int | str | bytes) -> int:
    if isinstance(key, int):
        return key & 0xFFFFFFFFFFFFFFFF
    return _xxh3(key.encode() if isinstance(key, str) else key)


def hrw_weight(seed: int, replica_id: str) -> int:
    """Rendezvous weight of a replica for a key's seed (higher ranks first)."""
    return _xxh3(replica_id.encode(), seed)


def prompt_tokens(req: RequestFeatures) -> int:
    """The request's prompt length in tokens (estimated from the hashes if the gateway gave 0)."""
    return req.prompt_tokens or len(req.prefix_hashes) * req.tokens_per_hash
