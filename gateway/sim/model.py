"""Pure model of a simulated replica: prompt blocks, prefix cache, timing and output text.

Prefix cache (vLLM's automatic prefix caching, at block granularity):

* A prompt of ``n`` tokens has ``n // block_size`` full blocks; block ``i`` is named by the chained
  hash ``policies.hashing.hash_token_blocks(ids, block_size, model_seed(model))[i]``, so a hash
  names the whole prefix up to the end of its block.
* Lookup: ``cached_tokens = block_size * k`` where ``k`` is the number of leading block hashes found
  in the cache, looking at no more than ``(n - 1) // block_size`` blocks, so that at least one
  prompt token is always computed (vLLM recomputes the last token of a fully cached prompt).
* After prefill every full prompt block is inserted or refreshed.  The cache is an LRU with a
  capacity in blocks; a prompt's blocks are touched tail first, so the leading (most shared) blocks
  are the most recently used and are evicted last, like vLLM frees a request's blocks in reverse.
* Queries and hits are counted in tokens (``prompt_tokens`` and ``cached_tokens``), as vLLM's
  ``prefix_cache_queries`` / ``prefix_cache_hits`` counters do.

Timing: time to first token = queueing for an admission slot + ``prefill_s_per_token`` x uncached
tokens; each further output token takes ``decode_s_per_token``.  A running request holds
``ceil((prompt_tokens + generated) / block_size)`` KV blocks; ``kv_cache_usage_perc`` is the blocks
held by running requests over the capacity (cached blocks of finished requests count as free, as
in vLLM).

Output text: a pure function of the rendered prompt (``expected_text``): ``n`` words from a small
vocabulary, one word per token, separated by single spaces, drawn with an LCG seeded by
``xxh3_64(prompt_text)``.  Every replica therefore answers a request with the same text.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import orjson
import xxhash

from policies.hashing import hash_token_blocks

VOCAB: tuple[str, ...] = (
    "the", "a", "cache", "prefix", "token", "block", "model", "replica",
    "gateway", "route", "fast", "slow", "warm", "cold", "hit", "miss",
    "queue", "batch", "prompt", "answer", "light", "river", "stone", "cloud",
    "green", "blue", "red", "small", "large", "quiet", "bright", "deep",
    "is", "was", "and", "or", "of", "to", "in", "on",
    "runs", "waits", "moves", "holds", "keeps", "sends", "reads", "writes",
    "one", "two", "three", "many", "some", "every", "each", "other",
    "here", "there", "now", "then", "again", "still", "soon", "later",
)  # fmt: skip
assert len(VOCAB) == 64  # the LCG's top 6 bits pick a word

_MASK64 = (1 << 64) - 1
_LCG_A = 6364136223846793005
_LCG_C = 1442695040888963407
_FIRST = VOCAB
_NEXT = tuple(" " + w for w in VOCAB)
#: JSON encoding (bytes) of every output piece, for building SSE chunks without a serialiser.
PIECE_JSON: dict[str, bytes] = {p: orjson.dumps(p) for p in _FIRST + _NEXT}


def output_pieces(prompt_text: str, n_tokens: int) -> list[str]:
    """The text of each output token for ``prompt_text`` (the first has no leading space)."""
    x = xxhash.xxh3_64_intdigest(prompt_text.encode("utf-8", "surrogatepass"))
    out: list[str] = []
    table = _FIRST
    for _ in range(n_tokens):
        x = (x * _LCG_A + _LCG_C) & _MASK64
        out.append(table[x >> 58])
        table = _NEXT
    return out


def expected_text(prompt_text: str, n_tokens: int) -> str:
    """The full output text a replica returns for ``prompt_text`` and ``n_tokens`` tokens."""
    return "".join(output_pieces(prompt_text, n_tokens))


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A tokenized prompt: its length and the chained hashes of its full blocks."""

    n_tokens: int
    hashes: tuple[int, ...] | list[int]

    @classmethod
    def from_tokens(cls, token_ids: Sequence[int], block_size: int, seed: int) -> PromptBlocks:
        return cls(len(token_ids), hash_token_blocks(token_ids, block_size, seed))


class PrefixCache:
    """LRU set of block hashes with a capacity in blocks (see module header)."""

    __slots__ = ("capacity", "evictions", "_lru")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.capacity = capacity_blocks
        self.evictions = 0
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._lru

    def match(self, hashes: Iterable[int]) -> int:
        """Number of leading ``hashes`` present (no LRU update)."""
        lru = self._lru
        k = 0
        for h in hashes:
            if h not in lru:
                break
            k += 1
        return k

    def insert(self, hashes: Sequence[int]) -> None:
        """Insert or refresh ``hashes``; the first hash ends up most recently used."""
        if self.capacity == 0:
            return
        lru = self._lru
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        extra = len(lru) - self.capacity
        if extra > 0:
            self.evictions += extra
            for _ in range(extra):
                lru.popitem(last=False)

    def lru_order(self) -> list[int]:
        """Hashes from least to most recently used (for tests)."""
        return list(self._lru)

    def clear(self) -> None:
        self._lru.clear()


def max_cacheable_blocks(n_tokens: int, block_size: int) -> int:
    """Blocks a lookup may hit while leaving at least one prompt token to compute."""
    return max(0, (n_tokens - 1) // block_size)


def cached_tokens(cache: PrefixCache, prompt: PromptBlocks, block_size: int) -> int:
    """Prompt tokens served from ``cache`` (see module header)."""
    limit = max_cacheable_blocks(prompt.n_tokens, block_size)
    if limit == 0 or not prompt.hashes:
        return 0
    return block_size * cache.match(prompt.hashes[:limit])


def prefill_seconds(uncached_tokens: int, s_per_token: float) -> float:
    return max(0, uncached_tokens) * s_per_token


def blocks_held(n_tokens: int, block_size: int) -> int:
    """KV blocks a running request with ``n_tokens`` tokens (prompt + generated) holds."""
    return -(-n_tokens // block_size)
