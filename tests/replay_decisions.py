"""Replays a random request stream through ``cache_aware`` and prints every decision as JSON.

``python tests/replay_decisions.py SEED`` -- run once with the compiled policy modules and once
with ``KVGATE_PURE=1`` (the source), the two outputs must be the same (tests/test_policies_native.py).
Loads, sessions, shared prefixes, holds, failures and the engine's cached-token reports are
all drawn from the seed; the clock is a counter the stream advances.
"""

from __future__ import annotations

import json
import random
import sys

import policies
from policies import default_registry
from policies.deps import PolicyDeps
from policies.prefix_index import PrefixIndex
from policies.types import ClusterView, Outcome, ReplicaState, RequestFeatures

PARAMS = (
    {},
    {"max_running": 3, "migrate": True},
    {"max_running": 8, "engine_block_tokens": 16, "spill_when_full": True},
    {"max_running": 4, "replicate_util": 1.0, "tie_ms": 20},
    {"max_running": 3, "replicate_util": 0.05, "warm_copies": True, "load_slack": 8},
    {"max_running": 3, "migrate": "auto", "migrate_min_tokens": 32, "replicate_util": 0.05},
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _request(rng: random.Random, docs: list[tuple[int, ...]], k: int) -> RequestFeatures:
    doc = docs[rng.randrange(len(docs))]
    chain = doc[: rng.randint(1, len(doc))] + tuple(rng.getrandbits(64) for _ in range(rng.randint(0, 4)))
    tph = 16
    return RequestFeatures("m", chain, tph, len(chain) * tph - rng.randint(0, tph - 1),
                           rng.choice((0, 16, 128)), rng.choice((None, f"s{k % 13}")),
                           rng.random() < 0.7)  # fmt: skip


def replay(seed: int, params: dict, steps: int = 400) -> list[list]:
    rng = random.Random(seed)
    clock = Clock()
    pol = default_registry().build("cache_aware", params,
                                   PolicyDeps(clock=clock, index=PrefixIndex(default_capacity=300)))  # fmt: skip
    base = [tuple(rng.getrandbits(64) for _ in range(rng.randint(4, 40))) for _ in range(3)]
    docs = [b + tuple(rng.getrandbits(64) for _ in range(rng.randint(0, 30))) for b in base for _ in range(4)]
    ids = [f"r{i}" for i in range(6)]
    links = {rid: rng.choice((-1.0, 0.005, 0.01, 0.03)) for rid in ids}  # advertised pull costs
    open_: list = []
    out = []
    for k in range(steps):
        clock.t += rng.expovariate(20.0)
        view = ClusterView(tuple(
            ReplicaState(rid, in_flight=rng.randint(0, 9), running=rng.randint(0, 6),
                         waiting=rng.choice((0, 0, 0, 2)), held=rng.choice((0, 0, 1)),
                         healthy=rng.random() > 0.03, pull_ms_per_token=links[rid])
            for rid in ids))  # fmt: skip
        if not any(r.healthy for r in view.replicas):
            continue
        req = _request(rng, docs, k)
        d = pol.select(req, view)
        out.append([d.replica, list(d.alternates), d.reason, d.predicted_cached_tokens,
                    d.pull_from, d.pull_tokens, round(d.hold_s, 9),
                    {key: round(v, 6) for key, v in sorted(d.scores.items())},
                    d.warm and [d.warm.replica, d.warm.reason, d.warm.predicted_cached_tokens]])  # fmt: skip
        pol.on_dispatch(req, d, view)
        open_.append((req, d, clock.t))
        if d.warm is not None:  # as the gateway does: a request of its own, one output token
            warm = RequestFeatures(req.model, req.prefix_hashes, req.tokens_per_hash, req.prompt_tokens, 1)
            pol.on_dispatch(warm, d.warm, view)
            open_.append((warm, d.warm, clock.t))
        while open_ and rng.random() < 0.6:
            r, dec, t0 = open_.pop(rng.randrange(len(open_)))
            ok = rng.random() > 0.05
            ttft = None if not ok and rng.random() < 0.5 else rng.uniform(0.01, 0.3)
            if ttft is not None:
                pol.on_first_token(r, dec.replica)
            cached = min(r.prompt_tokens, max(0, dec.predicted_cached_tokens + rng.randint(-64, 32)))
            pol.on_complete(r, dec.replica, Outcome(ok, r.prompt_tokens, cached if ttft else None,
                                                    clock.t - t0 + 0.4, ttft,
                                                    dec.predicted_cached_tokens))  # fmt: skip
    return out


def main(seed: int) -> None:
    print(json.dumps({"compiled": policies.native.compiled(),
                      "decisions": [replay(seed * 10 + i, p) for i, p in enumerate(PARAMS)]}))  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]))
