"""Block keys for the agent: the project's one prefix hash (``policies.hashing``), nothing new.

A block's key is the chained xxh3_64 of its token ids, seeded by the model (and LoRA/salt), so a
key names the whole prefix up to and including its block, and the parent of block ``i`` is the key
of block ``i - 1``.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.hashing import hash_token_blocks, model_seed


def block_keys(token_ids: Sequence[int], block_size: int, model: str, salt: str = "") -> list[int]:
    """Keys of the full ``block_size``-token blocks of ``token_ids`` for ``model`` (+ salt)."""
    return hash_token_blocks(token_ids, block_size, model_seed(model, salt))


def parents(keys: Sequence[int]) -> list[int | None]:
    """Parent key of each key of one chain (None for the first)."""
    return [None, *keys[:-1]] if keys else []
