"""Each replica's capacity in the prefix index, from the KV-cache size its engine reports.

The index (``policies.prefix_index``) forgets the blocks a replica must have evicted once those
recorded for it exceed its capacity.  Left at its default (65,536 blocks, about 4M tokens), a
small cache is modelled as never evicting, and the gateway predicts hits on copies the engine
dropped long ago: learning (``PrefixIndex.observe``) only corrects that after ``settle_s``, from
misses.  An engine that says how big its cache is -- vLLM's ``vllm:cache_config_info``
(``block_size`` x ``num_gpu_blocks`` tokens; the simulator reports the same) -- sets it instead:
its tokens over the tokens one prefix hash stands for.  Learning still lowers the effective
capacity below that (an engine also caches output and other clients' prompts).

It is applied when it first shows and again only when it moves by more than ``tolerance`` (a
replica restarted with another cache, or the learnt bytes-per-token rate moved): applying it
resets the learning.  Pure apart from the index it updates; the app calls it after each round of
health checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from policies.prefix_index import PrefixIndex

from .replicas import Replica


def sync_capacities(
    replicas: Iterable[Replica],
    index: PrefixIndex,
    tokens_per_hash: Callable[[str], int],
    tolerance: float = 0.1,
) -> list[str]:
    """Set the index's capacity of every replica whose engine reported its cache size; returns
    the ids whose capacity changed."""
    changed = []
    for rep in replicas:
        if rep.kv_tokens <= 0:
            continue
        model = min(rep.models) if rep.models else ""
        blocks = max(1, rep.kv_tokens // max(1, tokens_per_hash(model)))
        now = index.configured_capacity(rep.id)
        if now is None or abs(blocks - now) > tolerance * now:
            index.set_capacity(rep.id, blocks)
            changed.append(rep.id)
    return changed
