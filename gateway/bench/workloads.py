"""Benchmark workloads (pure, seeded): what to send and when, plus the ideal cache hit rate.

* ``shared_prefix``: SGLang's generated-shared-prefix shape.  ``groups`` long system prompts,
  ``prompts_per_group`` short questions each; requests arrive as a Poisson process and pick their
  group by Zipf popularity (exponent ``zipf``).
* ``hot_prefix``: one very popular long document (a shared system prompt, a manual) takes
  ``hot_share`` of the traffic, the rest is a Zipf tail of shorter system prompts.  Its popularity
  ramps up over the first ``ramp`` requests, so it first lands on one replica and then grows past
  what that replica can serve: its holder must spill.  With ``hot_docs`` > 1 the hot document
  changes ``hot_docs - 1`` times (a new release, a trending page), each new one taking over from
  the previous over ``ramp`` requests.
* ``multi_turn``: chat sessions that resend the whole growing conversation.  Sessions are picked by
  Zipf popularity; a session's next turn is sent only after its previous answer arrived (the
  answer is the simulator's deterministic text, so the whole script is known in advance).

``ideal_hit_rate`` replays a workload through one infinite prefix cache with the simulator's
tokenizer and block size: the best hit rate any routing could reach.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from policies.hashing import hash_token_blocks, model_seed

from ..sim.model import expected_text, max_cacheable_blocks
from ..sim.tokenizer import Tokenizer, render_chat_prompt, render_chat_segments

_WORDS = (
    "cache prefix replica token block route session gateway latency throughput model prompt "
    "tensor batch queue decode prefill memory tier shard vector kernel stream answer context"
).split()


@dataclass(frozen=True)
class BenchRequest:
    seq: int  # position in the script
    arrival_s: float  # earliest send time after the run starts
    messages: tuple[dict, ...]
    max_tokens: int
    key: str  # group or session id: what an oracle would hash on
    session: str | None = None  # sent as x-session-id when set
    after: int | None = None  # seq of the request whose answer must arrive first


@dataclass
class Workload:
    name: str
    requests: list[BenchRequest]
    model: str = "tiny"
    params: dict = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


def shared_prefix(
    *, groups: int = 24, prompts_per_group: int = 32, system_words: int = 1200, question_words: int = 24,
    rate: float = 32.0, requests: int = 640, zipf: float = 0.8, max_tokens: int = 32, seed: int = 1,
) -> Workload:
    rng = random.Random(seed)
    systems = [f"[group {g}] " + _text(rng, system_words) for g in range(groups)]
    questions = [[_text(rng, question_words) + "?" for _ in range(prompts_per_group)] for _ in range(groups)]
    weights = _zipf_weights(groups, zipf)
    t = 0.0
    out = []
    for i in range(requests):
        t += rng.expovariate(rate)
        g = rng.choices(range(groups), weights)[0]
        q = rng.randrange(prompts_per_group)
        msgs = ({"role": "system", "content": systems[g]}, {"role": "user", "content": questions[g][q]})
        out.append(BenchRequest(i, t, msgs, max_tokens, key=f"group-{g}"))
    params = dict(groups=groups, prompts_per_group=prompts_per_group, system_words=system_words,
                  rate=rate, requests=requests, zipf=zipf, max_tokens=max_tokens)
    return Workload("shared_prefix", out, params=params)


def multi_turn(
    *, sessions: int = 48, turns: int = 8, system_words: int = 300, user_words: int = 60,
    rate: float = 24.0, requests: int = 480, zipf: float = 0.6, max_tokens: int = 32, seed: int = 2,
) -> Workload:
    rng = random.Random(seed)
    weights = _zipf_weights(sessions, zipf)
    history: list[list[dict]] = [
        [{"role": "system", "content": f"[session {s}] " + _text(rng, system_words)}] for s in range(sessions)
    ]
    done = [0] * sessions
    last_seq: list[int | None] = [None] * sessions
    t = 0.0
    out: list[BenchRequest] = []
    while len(out) < requests:
        t += rng.expovariate(rate)
        live = [s for s in range(sessions) if done[s] < turns]
        if not live:
            break
        s = rng.choices(live, [weights[x] for x in live])[0]
        history[s].append({"role": "user", "content": _text(rng, user_words)})
        msgs = tuple(dict(m) for m in history[s])
        seq = len(out)
        out.append(BenchRequest(seq, t, msgs, max_tokens, key=f"session-{s}", session=f"session-{s}",
                                after=last_seq[s]))
        answer = expected_text(render_chat_prompt(list(msgs)), max_tokens)
        history[s].append({"role": "assistant", "content": answer})
        done[s] += 1
        last_seq[s] = seq
    params = dict(sessions=sessions, turns=turns, system_words=system_words, user_words=user_words,
                  rate=rate, requests=len(out), zipf=zipf, max_tokens=max_tokens)
    return Workload("multi_turn", out, params=params)


def hot_prefix(
    *, hot_docs: int = 1, doc_words: int = 4000, hot_share: float = 0.75, tail_groups: int = 16,
    tail_words: int = 400, question_words: int = 16, rate: float = 40.0, requests: int = 800,
    zipf: float = 1.0, max_tokens: int = 32, ramp: int = 120, seed: int = 3,
) -> Workload:
    rng = random.Random(seed)
    docs = [f"[document {d}] " + _text(rng, doc_words) for d in range(hot_docs)]
    tails = [f"[group {g}] " + _text(rng, tail_words) for g in range(tail_groups)]
    weights = _zipf_weights(tail_groups, zipf)
    period = max(1, -(-requests // hot_docs))
    t = 0.0
    out = []
    for i in range(requests):
        t += rng.expovariate(rate)
        question = {"role": "user", "content": _text(rng, question_words) + "?"}
        d = min(i // period, hot_docs - 1)
        if rng.random() * ramp > i - d * period:  # still ramping up: the previous one, if any
            d -= 1
        if d >= 0 and rng.random() < hot_share:
            msgs, key = ({"role": "system", "content": docs[d]}, question), f"doc-{d}"
        else:
            g = rng.choices(range(tail_groups), weights)[0]
            msgs, key = ({"role": "system", "content": tails[g]}, question), f"group-{g}"
        out.append(BenchRequest(i, t, msgs, max_tokens, key=key))
    params = dict(hot_docs=hot_docs, doc_words=doc_words, hot_share=hot_share,
                  tail_groups=tail_groups, tail_words=tail_words, rate=rate, requests=requests,
                  zipf=zipf, max_tokens=max_tokens, ramp=ramp)
    return Workload("hot_prefix", out, params=params)


@dataclass(frozen=True)
class CacheFootprint:
    ideal_hit_rate: float
    distinct_blocks: int
    prompt_tokens: int


def footprint(workload: Workload, block_size: int = 16) -> CacheFootprint:
    """Replay ``workload`` through one infinite cache (the simulator's tokenizer and blocks)."""
    seed = model_seed(workload.model)
    seen: set[int] = set()
    cached = total = 0
    tokenizer = Tokenizer()
    for req in workload.requests:
        tokens = tokenizer.encode_segments(render_chat_segments(list(req.messages)))
        hashes = hash_token_blocks(tokens, block_size, seed)
        limit = max_cacheable_blocks(len(tokens), block_size)
        hit = 0
        for h in hashes[:limit]:
            if h not in seen:
                break
            hit += 1
        cached += hit * block_size
        total += len(tokens)
        seen.update(hashes)
    return CacheFootprint(cached / total if total else 0.0, len(seen), total)


WORKLOADS = {"shared_prefix": shared_prefix, "multi_turn": multi_turn, "hot_prefix": hot_prefix}
