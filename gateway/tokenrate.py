"""How many bytes of the gateway's rendered prompt make one token of the engine's, per model.

The gateway hashes and measures prompts without a tokenizer: it renders the canonical prompt and
counts bytes.  The policies' cost model needs tokens (prefill time per token, cached tokens
predicted against the engine's report), so the gateway turns bytes into tokens at a rate: 4 bytes
per token to start with (English text under a BPE tokenizer), then what the engines report.

Algorithm: every response's ``usage.prompt_tokens`` with the request's rendered byte length is one
sample of bytes per token (clamped to [``lo``, ``hi``]); the rate is their running mean over the
first ``1 / alpha`` samples, then an EWMA with weight ``alpha``.  Code, other languages and the
engine's own chat template all move the rate away from 4 (the simulator's words come to about 7),
and with the rate the TTFT predictions and the predicted cached tokens are in the engine's tokens.
"""

from __future__ import annotations

from policies.hashing import BYTES_PER_TOKEN


class TokenRates:
    __slots__ = ("default", "alpha", "lo", "hi", "_rate", "_n")

    def __init__(self, default: float = BYTES_PER_TOKEN, alpha: float = 0.05,
                 lo: float = 1.0, hi: float = 32.0) -> None:  # fmt: skip
        if not 0 < alpha <= 1 or not 0 < lo <= default <= hi:
            raise ValueError("need 0 < alpha <= 1 and 0 < lo <= default <= hi")
        self.default, self.alpha, self.lo, self.hi = default, alpha, lo, hi
        self._rate: dict[str, float] = {}
        self._n: dict[str, int] = {}

    def get(self, model: str) -> float:
        """Bytes per token for ``model`` (the default until a response has been seen)."""
        return self._rate.get(model, self.default)

    def observe(self, model: str, prompt_bytes: int, prompt_tokens: int) -> None:
        if prompt_bytes <= 0 or prompt_tokens <= 0:
            return
        x = min(self.hi, max(self.lo, prompt_bytes / prompt_tokens))
        n = self._n.get(model, 0) + 1
        if n * self.alpha <= 1:
            self._n[model] = n
        weight = max(self.alpha, 1.0 / n)
        rate = self._rate.get(model, x)
        self._rate[model] = rate + weight * (x - rate)

    def snapshot(self) -> dict[str, float]:
        return {m: round(r, 3) for m, r in self._rate.items()}
