"""The pure pieces of ``cache_aware`` (see ``policies.cache_aware`` for the algorithm): its
parameters, what each replica holds ready (or will once a prefill in flight ends), a replica's
score, the pick among ties and the reason it gives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from .scoring import LoadBound, hrw_weight, rendezvous_key, rendezvous_seed
from .types import RequestFeatures
from .warming import Warming

_MIGRATE_MODES = {"auto": 1, "true": 2, "on": 2, "yes": 2, "1": 2, "false": 0, "off": 0, "no": 0, "0": 0}
MIGRATE_OFF, MIGRATE_AUTO, MIGRATE_ALL = 0, 1, 2


def migrate_mode(value: str) -> int:
    """``migrate``'s spelling -> MIGRATE_OFF / MIGRATE_AUTO / MIGRATE_ALL (ValueError if none)."""
    mode = _MIGRATE_MODES.get(value.strip().lower(), -1)
    if mode < 0:
        raise ValueError(f"migrate must be auto, true or false, not {value!r}")
    return mode


@dataclass(frozen=True)
class CacheAwareParams:
    """``cache_aware``'s parameters (see ``policies.cache_aware`` for what each does).

    Parameters (defaults sized for an 8B model on one H100; set ``max_running`` to the engine's real
    concurrency -- e.g. vLLM's max_num_seqs, or the simulator's max_running -- since below it the model
    sees no queue and only the load bound guards against herding):
    prefill_ms_per_token 0.1, decode_ms_per_token 20, max_running 64, avg_output_tokens 256,
    busy_ms_per_request 2, load_factor 1.25, load_slack 4, spill_when_full false, tie_ms 5 (about two
    requests of interference: a wider window threw away real hits -- in the hot_prefix benchmark a
    100 ms window scattered every 44 ms tail prefix over all replicas), service_alpha 0.05,
    warm_min_ms 20, wait_for_prefill true, learn_capacity true, work_weight 0.3, evict_weight 1
    (weight 1 kept one more point of hits at 90% busy, at 1.4x the TTFT p99), replicate_util
    0.25 (0 turns copying by demand off; a copy once the prefix keeps a quarter of its holders'
    slots busy), warm_copies true (the copy is made by a prefill-only request the gateway sends,
    not by a client's request), warm_turns true (once a conversation's turn is answered, the
    gateway prefills the answer where it was served, so the next turn computes only its new
    message: ``gateway.turns``; only while half that replica's slots stay free).
    Without warms a copy cost a client a cold prefill, and 0.5 was
    the best trade (hot-prefix at 3 slots and 0.8x its rate, five interleaved rounds: TTFT p50 37
    ms and p99 409 against 48 and 555 with 1).  With them copies cost no client anything and may
    come early: hot-prefix there p50 27 / p99 296 (0.25 with warms) against 43 / 370 (0.5 with
    warms) and round robin's 46 / 328; at 8 slots p99 49 against 108 without warms; shared-prefix
    at 3 slots p50 105 / p99 454 against 128 / 590 without, the same hit rate.  migrate auto
    (pull a prefix where the engines advertise they can; ``policies.pulls``), pull_margin_ms 0 (a
    copy's eviction is priced; see the migration rule in ``policies.pulls``),
    transfer_ms_per_token 0.01 (used with migrate true where an engine advertises no cost)
    -- an 8B model's 128 KiB of KV per token at 12.5 GB/s --, transfer_overhead_ms 2, migrate_min_tokens
    256, engine_block_tokens 1 (no rounding; set it to the engine's block size -- vLLM's --block-size:
    16 on GPUs by default, 128 on CPUs -- when its blocks are much longer than ``tokens_per_hash``:
    otherwise a shared prefix shorter than one engine block is predicted as cached, reported as 0,
    and every such request after ``settle_s`` is taken for an eviction and shrinks the learned
    capacity by 10%).
    ``load_slack`` 4 rather than the textbook bound (``load + 1 <= c * (mean + 1)``, i.e. slack
    ``c - 1``): in a simulation of multi-turn sessions on 8 replicas the tight bound moved sessions
    away from their cache at low load (hit rate 0.84 against 0.91, mean TTFT 226 ms against 124 ms)
    while slack 4 still stops a hot prefix from herding.
    """

    prefill_ms_per_token: float = 0.1
    decode_ms_per_token: float = 20.0
    max_running: int = 64
    avg_output_tokens: int = 256
    busy_ms_per_request: float = 2.0
    load_factor: float = 1.25
    load_slack: float = 4.0
    tie_ms: float = 5.0
    pull_margin_ms: float = 0.0
    learn_capacity: bool = True
    migrate: str = "auto"  # auto | true | false (policies.pulls)
    transfer_ms_per_token: float = 0.01
    transfer_overhead_ms: float = 2.0
    migrate_min_tokens: int = 256
    service_alpha: float = 0.05
    warm_min_ms: float = 20.0
    spill_when_full: bool = False
    engine_block_tokens: int = 1
    wait_for_prefill: bool = True
    work_weight: float = 0.3
    evict_weight: float = 1.0
    replicate_util: float = 0.25
    warm_copies: bool = True
    warm_turns: bool = True

    def validate(self) -> None:
        if self.prefill_ms_per_token < 0 or self.decode_ms_per_token < 0:
            raise ValueError("per-token costs must be >= 0")
        if self.max_running < 1:
            raise ValueError("max_running must be >= 1")
        if self.avg_output_tokens < 0:
            raise ValueError("avg_output_tokens must be >= 0")
        if min(self.tie_ms, self.pull_margin_ms, self.busy_ms_per_request, self.warm_min_ms) < 0:
            raise ValueError("tie_ms, pull_margin_ms, busy_ms_per_request, warm_min_ms: >= 0")
        if self.transfer_ms_per_token < 0 or self.transfer_overhead_ms < 0:
            raise ValueError("transfer costs must be >= 0")
        if not 0.0 <= self.service_alpha <= 1.0:
            raise ValueError("service_alpha must be in [0, 1]")
        migrate_mode(self.migrate)
        if self.migrate_min_tokens < 1:
            raise ValueError("migrate_min_tokens must be >= 1")
        if self.engine_block_tokens < 1:
            raise ValueError("engine_block_tokens must be >= 1")
        if self.work_weight < 0 or self.evict_weight < 0:
            raise ValueError("work_weight and evict_weight must be >= 0")
        if self.replicate_util < 0:
            raise ValueError("replicate_util must be >= 0 (0: off)")
        LoadBound(self.load_factor, self.load_slack).validate()


class Score(NamedTuple):
    over: bool  # over the load bound
    ttft: float  # predicted time to first token, ms
    id: str
    hit: int  # predicted cached tokens (own, plus ``pull``)
    load: int
    pull: int = 0  # tokens to pull from the holder first
    pull_ms: float = 0.0
    warm: bool = False  # still computing part of this prompt's prefix (a copy in flight)
    hold_ms: float = 0.0  # wait at the gateway for a prefill in flight there first
    penalty: float = 0.0  # ms added to ``ttft`` for the ranking: what the choice costs others


def pick(ties: list[Score], bound_id: str | None, req: RequestFeatures,
         footprint: Callable[[str], int]) -> Score:  # fmt: skip
    """The session's replica if it ties; else the ties already computing this prefix, if any;
    then among the least loaded of those: the longest hit, the smallest cache footprint (blocks
    the index records for it), and rendezvous (each criterion asked only of those still tied)."""
    if len(ties) == 1:
        return ties[0]
    for s in ties:
        if s.id == bound_id:
            return s
    ties = [s for s in ties if s.warm] or ties  # equally cold there: no second copy
    low = min([s.load for s in ties]) + 1
    ties = [s for s in ties if s.load <= low]
    if len(ties) > 1:
        top = max([s.hit for s in ties])
        ties = [s for s in ties if s.hit == top]
    if len(ties) > 1:
        sizes = [footprint(s.id) for s in ties]
        least = min(sizes)
        ties = [s for s, size in zip(ties, sizes, strict=True) if size == least]
    if len(ties) > 1:
        seed = rendezvous_seed(rendezvous_key(req))
        return max(ties, key=lambda s: hrw_weight(seed, s.id))
    return ties[0]


def ready_hits(ids: list[str], matched: dict[str, int], cuts: dict[str, int], total: int,
               tph: int, block: int) -> list[int]:  # fmt: skip
    """Per replica: the cached tokens it holds now (``matched`` blocks, less those ``cuts`` says
    are still being computed), counted as the engine counts them (``engine_hit``)."""
    if not matched:
        return [0] * len(ids)
    if block <= 1 and not cuts:
        get = matched.get
        return [min(get(rid, 0) * tph, total) for rid in ids]
    ks = [cuts.get(rid, matched.get(rid, 0)) for rid in ids]
    if block <= 1:
        return [min(k * tph, total) for k in ks]
    return [engine_hit(k * tph, total, block, tph // 4) if k else 0 for k in ks]


def prefill_waits(warming: Warming, ids: list[str], hashes: tuple[int, ...],
                  matched: dict[str, int], cuts: dict[str, int], total: int, tph: int, block: int,
                  now: float) -> dict[str, tuple[int, float]]:  # fmt: skip
    """Per replica still computing part of its match: the tokens cached once it is done, and the
    ms until then."""
    out = {}
    for rid in ids:
        if rid in cuts:
            m = matched[rid]
            full = engine_hit(m * tph, total, block, tph // 4)
            out[rid] = (full, (warming.until(rid, hashes, m, now) - now) * 1000)
    return out


def reason_for(chosen: Score, top: int, ties: list[Score], bound_id: str | None) -> str:
    """Why ``chosen`` won (``top``: the longest hit any replica scored)."""
    if chosen.pull:
        return "migrate"
    if chosen.hold_ms:
        return "prefill-wait"
    if top > chosen.hit and not any(s.hit == top for s in ties):
        return "load-fallback"  # a longer match lost on load or the bound
    if chosen.id == bound_id:
        return "session"
    return "prefix-hit" if chosen.hit else "cold-rendezvous"


def engine_hit(tokens: int, total: int, block: int, slack: int = 0) -> int:
    """Cached tokens as the engine counts them: at most the prompt; with ``block`` > 1 whole
    engine blocks, never the prompt's last token, and only blocks that end ``slack`` tokens
    before the match does (a matched chunk's token count is an estimate: a block that would
    end right at it may end past the prefix the engine really shares)."""
    hit = min(total, tokens)
    return max(0, min(hit - slack, total - 1)) // block * block if block > 1 else hit


def warm_s(ttft_ms: float) -> float:
    """How long a dispatched prefill counts as in flight: its predicted TTFT plus a margin for
    what the model leaves out (transport, the engine's own overhead)."""
    return (ttft_ms + 10.0) / 1000


def erlang_c(servers: int, rho: float) -> float:
    """The probability that an arrival waits for a server in an M/M/c queue with ``servers``
    servers at utilisation ``rho`` (Erlang C, from Erlang B's recursion)."""
    if rho <= 0.0:
        return 0.0
    if rho >= 1.0:
        return 1.0
    a = servers * rho
    b = 1.0
    for k in range(1, servers + 1):
        b = a * b / (k + a * b)
    return b / (1.0 - rho * (1.0 - b))


def work_factor(servers: int, rho: float) -> float:
    """Milliseconds of other requests' waiting that one more millisecond of work on a replica
    costs, at utilisation ``rho`` (capped at 0.95) with ``servers`` slots: the chance that those
    arriving behind it wait at all (Erlang C) times the number of them it delays (about 1 / (1 -
    rho): a busy period's length).  Near 0 while slots are free (8 slots at 40%: 0.03), large
    when the replicas saturate (3 slots at 90%: 8)."""
    rho = min(rho, 0.95)
    return erlang_c(servers, rho) / (1.0 - rho)


class Pressure:
    """How loaded the replicas are, as ``cache_aware`` needs it: the load bound, and the price of
    recomputing (``work_weight`` x ``work_factor`` at the mean utilisation, memoised by the
    percent).  ``cache_aware`` ranks a replica r by what choosing it costs the requests after it::

        cost(r) = ttft(r) + (P - hit(r)) * prefill_ms_per_token * work
                  + evicted(r) * tokens_per_hash * prefill_ms_per_token * evict_weight * (1 + work)

    ``work = work_weight * work_factor(max_running, rho)``, ``rho`` the mean load over
    ``max_running``: Erlang C (the chance that the requests arriving after it wait at all) over
    ``1 - rho`` (how many of them a busy period holds), capped at rho 0.95.  Recomputed tokens are
    capacity lost: while slots are free this is near 0 (8 slots at 40%: 0.03) and the greedy TTFT
    decides; when every slot is busy it is large (3 slots at 90%: 8), and a request stays with
    the replica holding its prefix through a queue that a greedy pick would leave for a cold
    prefill elsewhere -- whose work then delays everyone there, and whose copy pushes another
    prefix out.  ``evicted(r)``: the blocks r would store (the prompt's hashes beyond its
    match) past the room its capacity model has left (``PrefixIndex.rooms``), each computed again
    later by whoever needs it.  In the shared-prefix benchmark at a load that queues (3 slots,
    about 90% busy) the greedy pick recomputed a group's prompt on every replica and reached 81%
    of the ideal hit rate; priced, 97%, with lower TTFT p50 and p99.
    """

    __slots__ = ("_p", "_bound", "_memo")

    def __init__(self, params: CacheAwareParams) -> None:
        self._p = params
        self._bound = LoadBound(params.load_factor, params.load_slack)
        self._memo: dict[int, float] = {}

    def limit(self, loads: list[int], tight: bool = False) -> float:
        """Loads above this are over the bound: the textbook bound with slack, or, tighter (with
        ``spill_when_full``, or ``tight``), a fair share (``load_factor`` x mean) once requests
        already wait there for a slot."""
        limit = self._bound.limit(loads)
        if not (tight or self._p.spill_when_full):
            return limit
        fair = self._p.load_factor * sum(loads) / len(loads)
        full = self._p.max_running  # past max_running requests already wait for a slot
        return min(limit, max(fair, full)) if fair < limit else limit

    def work(self, loads: list[int]) -> float:
        """Ms of others' waiting per ms of work added now (0 with ``work_weight`` 0)."""
        p = self._p
        if not p.work_weight:
            return 0.0
        pct = min(95, 100 * sum(loads) // (len(loads) * p.max_running))
        out = self._memo.get(pct)
        if out is None:
            out = self._memo[pct] = p.work_weight * work_factor(p.max_running, pct / 100)
        return out
