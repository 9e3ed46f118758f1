"""``cache_aware`` (the default): pick the replica with the least predicted time to first token.

Algorithm (filter -> score -> pick):

* Filter: healthy, non-draining replicas serving the model (``BasePolicy.eligible``).
* Score, per replica r, in milliseconds::

      ahead(r)      = max(0, load(r) + 1 - max_running, waiting(r))
      queue_ms(r)   = slot_wait(r, ahead(r)) + load(r) * busy_ms_per_request
      prefill_ms(r) = (P - hit(r)) * prefill_ms_per_token
      ttft(r)       = queue_ms(r) + prefill_ms(r)

  ``load`` is max(gateway in-flight, engine running + waiting).  A replica runs about
  ``max_running`` requests at once; past that a new request waits for slots (an engine that
  reports requests ``waiting`` is saturated whatever ``max_running`` says).  ``slot_wait`` is
  when the ``ahead``-th of the requests sent there is predicted to end (``policies.slots``:
  each dispatch records its end at now + its predicted TTFT + ``max_tokens`` (else
  ``avg_output_tokens``) * ``decode_ms_per_token`` * a learned ratio); requests beyond those
  recorded (another gateway's) each cost a slot's share of ``service_ms``, which starts at
  ``avg_output_tokens * decode_ms_per_token`` and follows an EWMA (``service_alpha``) of what
  streamed requests really took after their first token (latency - ttft), as does the ratio of
  that time to its prediction.  A burst that filled a replica ends late and together: the
  average share would promise a slot long before one frees.
  Below that there is no queue, only interference (``busy_ms_per_request`` per request in flight,
  which also breaks ties toward the less loaded).  ``P`` is the prompt length in tokens and
  ``hit(r) = min(P, ready(r) * tokens_per_hash)`` with ``ready(r)`` the leading prefix hashes the
  ``PrefixIndex`` says r holds, less those a request dispatched there is still computing
  (``policies.warming``: engines do not share a prefill in progress, so a follower recomputes
  them; a dispatch counts as computing for its predicted TTFT + 10 ms, and only if that prefill
  takes ``warm_min_ms`` or more).  With ``engine_block_tokens`` b > 1 a hit is counted as the
  engine counts it: ``floor(min(hit - tokens_per_hash / 4, P - 1) / b) * b`` (vLLM caches whole
  blocks, and computes the prompt's last token again; the quarter chunk of slack because a
  chunk's tokens are estimated, and a block ending right at the match may not be shared).  A session's earlier turns are in the index under the replica
  they went to, so session affinity is scored as the cache it is, not as a rule.
  Ranking adds what a choice costs the requests after it (``penalty``, reported apart: the
  decision's ``ttft_ms`` is the prediction alone): the tokens it recomputes, priced by how busy
  the replicas are, and the prefixes its copy would evict (``cache_aware_scores.Pressure``).
  Waiting for a prefill in flight (``wait_for_prefill``): where r is still computing part of the
  match, r also gets ``ttft_wait(r) = queue_ms(r) + wait_ms(r) + (P - full(r)) *
  prefill_ms_per_token``, ``full(r)`` the whole match and ``wait_ms(r)`` the time until the
  prefill(s) computing it are predicted done; the lower of the two is r's score.  A follower of a
  long prefill then holds at the gateway (``Decision.hold_s``) and arrives when the prefix exists,
  instead of recomputing it beside the leader (or cold elsewhere): its TTFT is the leader's
  remaining prefill plus its own suffix, and the engine does the prefix's work once.
* Migration (``migrate``: ``auto`` by default, between replicas whose engines advertise pulls):
  a replica short of the longest hit may pull the difference from its holder instead of
  recomputing it, scored a second time with the pull's price; ``policies.pulls`` has the rule.
* Bounded load (Mirrokni et al.): replicas with ``load > load_factor * mean_load + load_slack`` are
  set aside unless all are (the least loaded never is).  This stops a hot prefix from herding.
  With ``spill_when_full`` (off by default) the bound is tighter: a replica where requests
  already wait for a slot (``load > max_running``) is set aside once above ``load_factor *
  mean_load``, so a hot prefix gets its next copy before its holder builds a queue -- but when
  every replica queues, that sends a request cold wherever its holder is above the mean (at 3
  slots and 90% busy it cost 5 points of hit rate and no latency).  While a copy
  is being computed somewhere (a replica is computing part of this prompt's prefix), the
  replicas holding the longest ready hit stay eligible: sending more followers to the copy would
  make each of them recompute it, so they wait in the holder's queue if that is faster.
* A prefix that needs another copy (``replicate_util``, ``warm_copies``; ``policies.demand``
  says when, and how the copy is made): the holders are set aside for this request and the
  bound is the tight one, recomputing and evicting unpriced; with ``warm_copies`` (the default)
  the request is ranked again without that, and its decision carries the copy as ``warm``.
* Requests held at the gateway (``ReplicaState.held``) count in ``load`` (the bound) but not
  in the queue of a request sent now, which reaches the engine before them.  A follower's wait
  for a slot runs while the prefill it waits for does: it is held only for the part of the
  prefill its predicted slot wait (counted at half: a follower whose slot comes before the
  prefix exists recomputes all of it) does not cover, and when held, it queues with the
  requests held there before it.
* Pick: the minimum ttft; replicas within ``tie_ms`` of it are ties.  The session's current
  binding wins if it is among them (stickiness costs nothing there); otherwise the ties already
  computing this prefix, if any (equally cold there, and no second copy); then among those whose
  load is within one request of the least loaded: the longest hit, then the smallest cache
  footprint (``PrefixIndex.blocks``, as sglang sends a miss to the smallest tree: fewer
  evictions), then rendezvous hashing of the session key (or the first prefix hash), so that
  independent gateways with the same view make the same choice without talking.
* Decision: ``predicted_cached_tokens = hit(chosen)`` (pulled tokens included); alternates are
  the other replicas by plain ttft (those over the bound last); reason ``migrate`` (it pulls
  from a holder), else ``load-fallback`` (a longer match elsewhere lost on load or the bound),
  else ``prefill-wait`` (it holds for a prefill in flight), ``session`` (the session's bound
  replica), ``prefix-hit`` or ``cold-rendezvous``
  (nothing worth a tie's difference is cached anywhere).
* on_dispatch: insert the chain into the index for the chosen replica; bind the session.
* on_complete: with ``learn_capacity``, feed predicted vs reported cached tokens to
  ``PrefixIndex.observe`` (AIMD on the replica's effective capacity: the engine evicted what we
  had recorded long enough before the dispatch -> remember less).  A request that failed before
  its first token never filled the cache: its blocks beyond the predicted hit are forgotten.

Parameters: ``CacheAwareParams`` (``policies.cache_aware_scores``), with why each default.
"""

from __future__ import annotations

from functools import partial
from math import inf
from operator import itemgetter

from .base import BasePolicy
from .cache_aware_scores import (
    CacheAwareParams,
    Pressure,
    Score,
    pick,
    prefill_waits,
    ready_hits,
    reason_for,
    warm_s,
)
from .demand import PrefixDemand, turn_decision, warm_decision
from .deps import resolve_deps
from .pulls import PullCost
from .slots import SlotTimeline
from .types import ClusterView, Decision, Outcome, RequestFeatures
from .warming import Warming

_NONE: dict = {}  # read only: no match, no prefill in flight, no wait
_score = partial(tuple.__new__, Score)  # Score(...) without its Python-level __new__ (3x faster)
_BY_BOUND_THEN_TTFT = itemgetter(0, 1)  # Score.over, Score.ttft


class CacheAware(BasePolicy):
    name = "cache_aware"

    def __init__(self, params: CacheAwareParams, deps: object = None) -> None:
        d = resolve_deps(deps)
        self._index = d.index
        assert d.sessions is not None  # resolve_deps makes one
        self._sessions = d.sessions
        self._clock = d.clock
        self._p = params
        self._pressure = Pressure(params)
        self._service_ms = params.avg_output_tokens * params.decode_ms_per_token
        self._slot_ms = self._service_ms / params.max_running
        self._decode_ratio = 1.0  # EWMA: real decode time / max_tokens * decode_ms_per_token
        self._warming = Warming()
        self._demand = PrefixDemand()
        self._slots = SlotTimeline()
        self._pulls = PullCost(params)

    def queue_ms(self, load: int, waiting: int = 0, replica: str | None = None,
                 now: float = 0.0) -> float:  # fmt: skip
        """Predicted wait before a new request's prefill starts on a replica with ``load`` (with
        ``replica``: from when the requests sent there are predicted to end)."""
        ahead = max(load + 1 - self._p.max_running, waiting)
        busy = load * self._p.busy_ms_per_request
        if ahead <= 0:
            return busy
        if replica is None:
            return ahead * self._slot_ms + busy
        return self._slots.wait_s(replica, ahead, now, self._slot_ms / 1000) * 1000 + busy

    def select(self, req: RequestFeatures, view: ClusterView) -> Decision:
        replicas = self.eligible(req, view)
        hashes = req.prefix_hashes
        matched = self._index.match(hashes) if hashes else _NONE
        now = self._clock()
        ids = [r.id for r in replicas]
        loads = [max(r.in_flight, r.running + r.waiting) for r in replicas]  # ReplicaState.load
        top_blocks = max(matched.values()) if matched else 0
        copy = bool(top_blocks) and self._needs_copy(req, ids, matched, top_blocks, now)
        links = self._pulls.links(replicas)  # pull cost per replica ([]: migration off)
        decision = self._rank(req, replicas, ids, loads, matched, top_blocks, copy, links, now)
        if copy and self._p.warm_copies and matched.get(decision.replica, 0) < top_blocks:
            # The copy is made by a request of its own (the gateway sends ``warm``: a prefill,
            # or a pull from the holder the copy's decision names), so the request itself is
            # ranked as if no copy were needed: it stays with a holder unless leaving pays
            # anyway, in which case it makes the copy (no warm needed).
            stay = self._rank(req, replicas, ids, loads, matched, top_blocks, False, links, now)
            if matched.get(stay.replica, 0) >= top_blocks and not stay.pull_tokens:
                stay.warm = warm_decision(decision)
                return stay
        return decision

    def _rank(self, req: RequestFeatures, replicas: list, ids: list[str], loads: list[int],
              matched: dict[str, int], top_blocks: int, copy: bool, links: list[float],
              now: float) -> Decision:
        """Score every replica (``copy``: the prefix needs another copy, see the header) and
        decide."""
        p = self._p
        hashes = req.prefix_hashes
        n = len(hashes)
        tph = req.tokens_per_hash
        total = req.prompt_tokens or n * tph
        limit = self._pressure.limit(loads, copy)
        if copy and all(load > limit or matched.get(rid, 0) >= top_blocks
                        for rid, load in zip(ids, loads, strict=True)):  # fmt: skip
            copy = False  # no replica without it is within the bound: the holders stay eligible
            limit = self._pressure.limit(loads)
        # replicas still computing part of their match (a prefill in flight): blocks ready there
        cuts = self._warming.cuts(hashes, matched, now) if matched else _NONE
        hits = ready_hits(ids, matched, cuts, total, tph, p.engine_block_tokens)
        warm = cuts and any(rid in cuts for rid in ids)
        top = max(hits)
        exempt = top if top and warm else -1  # a copy in flight: its source may exceed the bound
        h = self._pulls.holder(loads, hits, top, links)
        holder = ids[h] if h >= 0 else None
        hlink = links[h] if h >= 0 else 0.0
        waits = (prefill_waits(self._warming, ids, hashes, matched, cuts, total, tph,
                               p.engine_block_tokens, now)
                 if warm and p.wait_for_prefill else _NONE)  # fmt: skip
        pf = p.prefill_ms_per_token
        busy = p.busy_ms_per_request
        free = p.max_running - 1  # up to this many in flight, a newcomer does not queue
        queue_ms = self.queue_ms
        wf = 0.0 if copy else self._pressure.work(loads)  # a copy it needs is no loss
        work = pf * wf  # what a recomputed token costs the others, ms
        evict = 0.0 if copy else pf * p.evict_weight * (1 + wf) * tph
        rooms = self._index.rooms(ids) if evict else [0] * len(ids)
        scored: list[Score] = []
        pulls: list[Score] = []  # the same replicas, pulling from the holder first
        for i, (r, rid, load, hit, left) in enumerate(zip(replicas, ids, loads, hits, rooms, strict=True)):
            waiting = r.waiting
            ahead = load - r.held  # held at the gateway: a request sent now queues before them
            q = ahead * busy if ahead <= free and waiting <= 0 else queue_ms(ahead, waiting, rid, now)
            m = matched.get(rid, 0)
            # over the bound; or, when the prefix needs another copy, already holding it
            over = (load > limit and hit != exempt) or (copy and m >= top_blocks)
            new = n - m  # blocks the replica would store: what they push out
            spill = evict * min(new, new - left) if evict and new > left else 0.0
            ttft = q + (total - hit) * pf
            pen = (total - hit) * work + spill
            if waits and rid in waits:
                full, ready_ms = waits[rid]
                # Its wait there for a slot runs while the prefill does: hold only for the
                # rest, counting half the predicted wait (a follower whose slot comes before
                # the prefix exists computes all of it again).  Held, it is sent with those
                # held there before it, and queues with them.
                slot_ms = (q - ahead * busy) * 0.5
                hold_ms = ready_ms - slot_ms if ready_ms > slot_ms else 0.0
                q_w = queue_ms(load, waiting, rid, now) if hold_ms and r.held else q
                ttft_w = q_w + hold_ms + (total - full) * pf
                pen_w = (total - full) * work + spill
                if ttft_w + pen_w < ttft + pen:  # wait for the prefill in flight: no recompute
                    scored.append(_score((over, ttft_w + pen_w, rid, full, load, 0, 0.0, True,
                                          hold_ms, pen_w)))  # fmt: skip
                    continue
            scored.append(_score((over, ttft + pen, rid, hit, load, 0, 0.0, rid in cuts, 0.0, pen)))
            if holder is not None and load <= limit and links[i] >= 0:
                pull, pull_ms = self._pulls.price(top - hit, max(links[i], hlink))
                if pull:
                    have = hit + pull
                    pen = (total - have) * work + spill
                    pulls.append(_score((False, q + (total - have) * pf + pull_ms + pen, rid, have,
                                         load, pull, pull_ms, False, 0.0, pen)))  # fmt: skip
        return self._decide(req, scored, pulls, holder, matched, total, top_blocks)

    def _decide(self, req: RequestFeatures, scored: list[Score], pulls: list[Score],
                holder: str | None, matched: dict[str, int], total: int,
                top_blocks: int) -> Decision:  # fmt: skip
        """Pick among the ties (see the header) and build the decision."""
        p = self._p
        top = pulls[0].hit if pulls else 0  # what a pull brings a replica to: the longest hit
        best = min([s.ttft for s in scored if not s.over])
        tie = p.tie_ms
        best_pull = min([s.ttft for s in pulls]) if pulls else best
        stay = min([s.ttft for s in scored if not s.over and s.hit >= top] or [inf]) if pulls else 0
        if best_pull < best and (best_pull + tie + p.pull_margin_ms < stay or best + tie < stay):
            # a pull beats staying with the holders by a margin; a move there anyway, by anything
            ties = [s for s in pulls if s.ttft <= best_pull + tie]
        else:
            ties = [s for s in scored if not s.over and s.ttft <= best + tie]
        bound_id = self._sessions.peek(req.session_key) if req.session_key is not None else None
        chosen = ties[0] if len(ties) == 1 else pick(ties, bound_id, req, self._index.blocks)
        hit = chosen.hit
        cid = chosen.id
        scored.sort(key=_BY_BOUND_THEN_TTFT)
        prefill_ms = (total - hit) * p.prefill_ms_per_token + chosen.pull_ms
        hold_ms = chosen.hold_ms
        ttft_ms = chosen.ttft - chosen.penalty
        return Decision(
            replica=chosen.id,
            alternates=tuple([s.id for s in scored if s.id != cid]),
            reason=reason_for(chosen, max([s.hit for s in scored]), ties, bound_id),
            predicted_cached_tokens=hit,
            scores={
                "ttft_ms": ttft_ms,
                "queue_ms": ttft_ms - prefill_ms - hold_ms,
                "penalty_ms": chosen.penalty,
                "prefill_ms": prefill_ms,
                "matched_blocks": float(matched.get(chosen.id, 0)),
                "pull_ms": chosen.pull_ms,
                "hold_ms": hold_ms,
                "top_blocks": float(top_blocks),
            },
            hold_s=hold_ms / 1000,
            pull_from=holder if chosen.pull else None,
            pull_tokens=chosen.pull,
        )

    def _needs_copy(self, req: RequestFeatures, ids: list[str], matched: dict[str, int],
                    top_blocks: int, now: float) -> bool:  # fmt: skip
        """Whether the longest prefix held of the request is asked for faster than the replicas
        holding it all can serve (``policies.demand``)."""
        util = self._p.replicate_util
        if not util:
            return False
        holders = sum([matched.get(rid, 0) >= top_blocks for rid in ids])
        if holders >= len(ids):
            return False
        service_s = self._decode_prior_ms(req) * self._decode_ratio / 1000
        key = req.prefix_hashes[top_blocks - 1]
        return self._demand.needs_copy(key, now, holders, service_s, self._p.max_running, util)

    def _decode_prior_ms(self, req: RequestFeatures) -> float:
        """Its time from first token to end at ``decode_ms_per_token`` (``max_tokens`` tokens)."""
        return (req.max_tokens or self._p.avg_output_tokens) * self._p.decode_ms_per_token

    def _learn_service(self, req: RequestFeatures, outcome: Outcome) -> None:
        """EWMAs of the time a streamed request holds its slot after its first token, and of
        that time over its prediction."""
        alpha = self._p.service_alpha
        if alpha and req.stream and outcome.ok and outcome.ttft_s is not None:
            ms = max(0.0, outcome.latency_s - outcome.ttft_s) * 1000
            self._service_ms += alpha * (ms - self._service_ms)
            self._slot_ms = self._service_ms / self._p.max_running
            predicted = self._decode_prior_ms(req)
            if predicted > 0:
                self._decode_ratio += alpha * (ms / predicted - self._decode_ratio)

    def on_dispatch(self, req: RequestFeatures, decision: Decision, view: ClusterView) -> None:
        now = self._clock()
        scores = decision.scores  # on_dispatch runs once any hold is over: TTFT from now
        ttft_ms = scores.get("ttft_ms", 0.0) - scores.get("hold_ms", 0.0)
        replica = decision.replica
        hashes = req.prefix_hashes
        p = self._p
        if hashes:
            top = int(scores.get("top_blocks", 0))
            if top and p.replicate_util:
                self._demand.record(hashes[top - 1], now)
            self._index.insert(replica, hashes, now)
            # Record the prefill it starts, if long enough for a follower to care.  Blocks
            # matched but not ready are an earlier request's, ready before these.
            tph = req.tokens_per_hash
            first = max(decision.predicted_cached_tokens // tph,
                        int(scores.get("matched_blocks", 0)))  # fmt: skip
            computing = (req.prompt_tokens or len(hashes) * tph) - first * tph
            if computing * p.prefill_ms_per_token >= p.warm_min_ms:
                self._warming.start(replica, hashes, first, now + warm_s(ttft_ms))
        decode_ms = self._decode_prior_ms(req) * self._decode_ratio
        self._slots.start(replica, id(req), now + (ttft_ms + decode_ms) / 1000)
        if decision.pull_tokens:
            self._pulls.started(id(req), ttft_ms)
        if req.session_key is not None:
            self._sessions.bind(req.session_key, replica)

    @property
    def warms_turns(self) -> bool:
        return self._p.warm_turns

    def warm_turn(self, req: RequestFeatures, replica_id: str, view: ClusterView) -> Decision | None:
        """A warm of a conversation's next turn (``req``: the prompt and its answer) on the
        replica that served the turn, if it leaves half that replica's slots free; else None."""
        r = view.by_id(replica_id)
        if (not self._p.warm_turns or not req.prefix_hashes or r is None or not r.healthy or r.draining
                or 2 * (max(r.in_flight, r.running + r.waiting) + 1) > self._p.max_running):
            return None
        matched = self._index.match(req.prefix_hashes).get(replica_id, 0)
        return turn_decision(replica_id, matched, req, self._p.prefill_ms_per_token)

    def on_first_token(self, req: RequestFeatures, replica_id: str) -> None:
        if req.prefix_hashes:
            self._warming.finish(replica_id, req.prefix_hashes)

    def hold_left(self, req: RequestFeatures, replica_id: str) -> float:
        """Until the prefix ``req`` matches on ``replica_id`` is all computed (0 if it is)."""
        hashes = req.prefix_hashes
        m = self._index.match(hashes).get(replica_id, 0) if hashes else 0
        if not m:
            return 0.0
        now = self._clock()
        return self._warming.until(replica_id, hashes, m, now) - now

    def on_complete(self, req: RequestFeatures, replica_id: str, outcome: Outcome) -> None:
        self._slots.end(id(req))
        self._pulls.ended(id(req), outcome)
        if req.prefix_hashes:  # done or failed: no follower should wait for it any more
            self._warming.finish(replica_id, req.prefix_hashes)
        self._learn_service(req, outcome)
        predicted = outcome.predicted_cached_tokens
        if predicted is None or not req.prefix_hashes:
            return
        if not outcome.ok and outcome.ttft_s is None and outcome.cached_tokens is None:
            self._index.truncate(replica_id, req.prefix_hashes, predicted // req.tokens_per_hash)
        elif self._p.learn_capacity and outcome.cached_tokens is not None:
            self._index.observe(
                replica_id,
                predicted,
                outcome.cached_tokens,
                req.prefix_hashes,
                req.tokens_per_hash,
                dispatched_at=self._clock() - outcome.latency_s,
            )
