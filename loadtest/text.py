"""Deterministic filler text for the load tests (same seed, same text, in every process).

Shared prefixes must be byte-identical across locust users and workers for a prefix cache to hit:
everything shared (system prompts, tool definitions, documents) is made from fixed seeds here.
"""

from __future__ import annotations

import random

WORDS = (
    "cache prefix token block replica gateway route latency queue prefill decode batch model "
    "session agent tool document answer question context memory eviction hit miss stream chunk "
    "request response header policy load balance shard tier transfer copy page vector index "
    "the a of to and in is that for it with as on by this be are from or at an which can "
    "system user assistant function search read write file result value error retry time "
    "first last next each every many few more less fast slow long short warm cold hot shared"
).split()


def sentence(rng: random.Random, n: int | None = None) -> str:
    n = n or rng.randint(6, 16)
    words = [rng.choice(WORDS) for _ in range(n)]
    return " ".join(words).capitalize() + "."


def paragraph(rng: random.Random, sentences: int = 5) -> str:
    return " ".join(sentence(rng) for _ in range(sentences))


def text_of(seed: int | str, words: int) -> str:
    """About ``words`` words of deterministic text for ``seed``."""
    rng = random.Random(f"kvgate-loadtest-{seed}")
    out: list[str] = []
    count = 0
    while count < words:
        para = paragraph(rng, rng.randint(3, 7))
        out.append(para)
        count += para.count(" ") + 1
    return "\n\n".join(out)


def question(rng: random.Random) -> str:
    lead = rng.choice(["What", "Why", "How", "When", "Which", "Where"])
    return f"{lead} {' '.join(rng.choice(WORDS) for _ in range(rng.randint(4, 10)))}?"
