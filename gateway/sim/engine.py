"""The simulated engine: admission (``max_running`` + FIFO queue), prefix cache, timing, counters.

All waiting goes through the injected :class:`~gateway.sim.clock.Clock`; the cache and timing
arithmetic live in :mod:`gateway.sim.model`.  A request's life, as the HTTP layer drives it::

    job = await engine.admit(prompt)       # waits for a slot (FIFO), looks the prefix up
    try:
        await engine.pull(job, peer)       # optional: blocks a peer holds (kvpull)
        await engine.prefill(job)          # sleeps for the uncached tokens -> first token
        for _ in range(n - 1):
            await engine.decode(job)       # one more token
    finally:
        engine.finish(job)                 # frees the slot (passes it to the next waiter)

:meth:`SimEngine.complete` does exactly that.  Nothing here does I/O.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from policies.hashing import model_seed

from .clock import Clock, LoopClock
from .config import SimConfig, SimFaults
from .kvpull import Inflight, PeerHoldings, make_planner
from .metrics import metrics_text
from .model import (
    PrefixCache,
    PromptBlocks,
    blocks_held,
    cached_tokens,
    max_cacheable_blocks,
    prefill_seconds,
)
from .tokenizer import Tokenizer


@dataclass(slots=True)
class SimStats:
    """Counters since start (or the last reset)."""

    requests_received: int = 0  # completion requests that reached the engine's fault check
    requests_served: int = 0  # finished normally
    requests_aborted: int = 0  # admitted, then cancelled (client gone) or cut by a fault
    requests_failed: int = 0  # answered with a simulated 503
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0  # tokens looked up
    prefix_hits: int = 0  # tokens found
    kv_pulls: int = 0  # pulls from a peer (see kvpull)
    kv_pulled_tokens: int = 0
    kv_pull_skipped: int = 0  # a peer held blocks, but recomputing was cheaper
    kv_pull_errors: int = 0  # the peer could not be asked
    kv_lookups: int = 0  # lookups served to peers


class Job:
    """One admitted request (plain data; the engine's methods move it along)."""

    __slots__ = (
        "prompt",
        "cached_tokens",
        "pulled_tokens",
        "produced",
        "held_blocks",
        "queued_at",
        "admitted_at",
        "first_token_at",
        "finished_at",
        "done",
    )

    def __init__(self, prompt: PromptBlocks, queued_at: float) -> None:
        self.prompt = prompt
        self.cached_tokens = 0  # includes pulled_tokens
        self.pulled_tokens = 0
        self.produced = 0
        self.held_blocks = 0
        self.queued_at = queued_at
        self.admitted_at = queued_at
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.done = False

    @property
    def prompt_tokens(self) -> int:
        return self.prompt.n_tokens

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.queued_at


class SimEngine:
    def __init__(self, config: SimConfig, clock: Clock | None = None) -> None:
        self.config = config
        self.clock: Clock = clock if clock is not None else LoopClock()
        self.cache = PrefixCache(config.cache_blocks)
        self.stats = SimStats()
        self.faults: SimFaults = config.faults
        self.seed = model_seed(config.model)
        self._rng = random.Random(config.seed)
        self._running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._held_blocks = 0
        self.planner = make_planner(config)  # None: this replica never pulls
        self.inflight = Inflight()  # blocks being computed or pulled here
        self.tokenizer = Tokenizer()

    # -- prompts ---------------------------------------------------------------------------

    def prompt_from_text(self, text: str) -> PromptBlocks:
        return self.prompt_from_segments([text])

    def prompt_from_segments(self, segments: Sequence[str]) -> PromptBlocks:
        """The prompt ``"".join(segments)`` (segments as the chat template cuts them)."""
        ids = self.tokenizer.encode_segments(segments)
        return PromptBlocks.from_tokens(ids, self.config.block_size, self.seed)

    def prompt_from_ids(self, token_ids: Sequence[int]) -> PromptBlocks:
        return PromptBlocks.from_tokens(token_ids, self.config.block_size, self.seed)

    # -- load ------------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    @property
    def kv_usage(self) -> float:
        """KV blocks held by running requests over the capacity, in [0, 1]."""
        cap = self.config.cache_blocks
        return min(1.0, self._held_blocks / cap) if cap else 0.0

    # -- a request's life ------------------------------------------------------------------

    async def admit(self, prompt: PromptBlocks) -> Job:
        """Wait for a running slot (FIFO), then look the prompt's prefix up in the cache."""
        job = Job(prompt, self.clock.now())
        if self._running < self.config.max_running and not self._waiters:
            self._running += 1
        else:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut  # the finishing request hands its slot over (running stays counted)
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._release_slot()  # granted just as we were cancelled: pass it on
                else:
                    try:
                        self._waiters.remove(fut)
                    except ValueError:
                        pass
                raise
            job.admitted_at = self.clock.now()
        bs = self.config.block_size
        job.cached_tokens = cached_tokens(self.cache, prompt, bs)
        self.stats.prefix_queries += prompt.n_tokens
        self.stats.prefix_hits += job.cached_tokens
        job.held_blocks = blocks_held(prompt.n_tokens, bs)
        self._held_blocks += job.held_blocks
        return job

    def holdings(self, hashes: Sequence[int]) -> tuple[int, int, float]:
        """(blocks held, blocks held once in-flight work lands, seconds until then): a lookup."""
        held = self.cache.match(hashes)
        pending, ready = self.inflight.run(hashes, held)
        return held, held + pending, max(0.0, ready - self.clock.now()) if pending else 0.0

    def expect_pull(self, hashes: Sequence[int]) -> object:
        """Announce a pull of ``hashes`` to be decided soon (see ``Inflight``); returns a token."""
        token = object()
        self.inflight.add(hashes, math.inf, token, pulled=True)
        return token

    def release(self, peer: PeerHoldings | None) -> None:
        """Give up what ``peer``'s token still announces (idempotent)."""
        if peer is not None and peer.token is not None:
            self.inflight.done(peer.asked, peer.token)

    async def pull(self, job: Job, peer: PeerHoldings) -> int:
        """Bring leading blocks a peer holds (now, or after its work in flight) if it saves time."""
        try:
            return await self._pull(job, peer)
        finally:
            self.release(peer)

    async def _pull(self, job: Job, peer: PeerHoldings) -> int:
        if self.planner is None:
            return 0
        bs = self.config.block_size
        limit = max_cacheable_blocks(job.prompt.n_tokens, bs)
        have = job.cached_tokens // bs
        now = self.clock.now()
        best = None
        for blocks, wait in ((peer.blocks, 0.0), (peer.pending, max(0.0, peer.ready_at - now))):
            want = min(blocks, limit) - have
            if want > 0:
                d = self.planner.decide(want, want * bs)
                saved = d.recompute_s - d.transfer_s - wait
                if best is None or saved > best[0]:
                    best = (saved, want, wait, d)
        if best is None:
            return 0
        saved, want, wait, d = best
        if saved <= 0:
            self.stats.kv_pull_skipped += 1
            return 0
        hashes = job.prompt.hashes[have : have + want]
        owner = peer.token if peer.token is not None else job
        self.inflight.add(hashes, now + wait + d.transfer_s, owner, pulled=True)
        try:
            await self.clock.sleep(wait + d.transfer_s)
        finally:
            self.inflight.done(hashes, owner)
        self.planner.observe_transfer(d.bytes, d.transfer_s)
        self.cache.insert(job.prompt.hashes[: have + want])
        tokens = want * bs
        job.cached_tokens += tokens
        job.pulled_tokens = tokens
        self.stats.kv_pulls += 1
        self.stats.kv_pulled_tokens += tokens
        return tokens

    async def _await_pulls(self, job: Job) -> None:
        """Blocks this job lacks that another request pulls (or is about to) here: wait."""
        bs = self.config.block_size
        limit = max_cacheable_blocks(job.prompt.n_tokens, bs)
        hashes = job.prompt.hashes[:limit]
        while True:
            n, ready = self.inflight.run(hashes, job.cached_tokens // bs, pulled_only=True)
            if not n:
                return
            if ready == math.inf:  # a pull is being decided: wait for the decision
                await self.inflight.changed()
            else:
                await self.clock.sleep(max(0.0, ready - self.clock.now()))
            more = self.cache.match(hashes) * bs - job.cached_tokens
            if more > 0:
                job.cached_tokens += more
                self.stats.prefix_hits += more

    async def prefill(self, job: Job) -> None:
        """Compute the uncached prompt tokens; afterwards the first output token exists."""
        await self._await_pulls(job)
        uncached = job.prompt.n_tokens - job.cached_tokens
        seconds = prefill_seconds(uncached, self.config.prefill_s_per_token)
        if seconds > 0:
            computing = job.prompt.hashes[job.cached_tokens // self.config.block_size :]
            self.inflight.add(computing, self.clock.now() + seconds, job, pulled=False)
            try:
                await self.clock.sleep(seconds)
            finally:
                self.inflight.done(computing, job)
            if self.planner is not None:
                self.planner.observe_prefill(uncached, seconds)
        self.cache.insert(job.prompt.hashes)
        self.stats.prompt_tokens += job.prompt.n_tokens
        job.first_token_at = self.clock.now()
        self._produced(job)

    async def decode(self, job: Job) -> None:
        """Produce one more output token."""
        seconds = self.config.decode_s_per_token
        if seconds > 0:
            await self.clock.sleep(seconds)
        self._produced(job)

    def _produced(self, job: Job) -> None:
        job.produced += 1
        self.stats.generation_tokens += 1
        need = blocks_held(job.prompt.n_tokens + job.produced, self.config.block_size)
        if need > job.held_blocks:
            self._held_blocks += need - job.held_blocks
            job.held_blocks = need

    def finish(self, job: Job, *, completed: bool = True) -> None:
        """Free the job's slot and blocks (idempotent)."""
        if job.done:
            return
        job.done = True
        job.finished_at = self.clock.now()
        self._held_blocks -= job.held_blocks
        job.held_blocks = 0
        if completed:
            self.stats.requests_served += 1
        else:
            self.stats.requests_aborted += 1
        self._release_slot()

    def _release_slot(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self._running -= 1

    async def complete(
        self, prompt: PromptBlocks, n_tokens: int, peer: PeerHoldings | None = None
    ) -> Job:
        """Run a whole request (admission, pull, prefill, ``n_tokens`` tokens); returns its job."""
        try:
            job = await self.admit(prompt)
        except BaseException:
            self.release(peer)
            raise
        completed = False
        try:
            if peer is not None:
                await self.pull(job, peer)  # releases the peer's token
            await self.prefill(job)
            for _ in range(n_tokens - 1):
                await self.decode(job)
            completed = True
        finally:
            self.finish(job, completed=completed)
        return job

    # -- faults, reset, introspection --------------------------------------------------------

    def draw_error(self) -> bool:
        """Count a received request and decide (seeded RNG) whether it fails with a 503."""
        self.stats.requests_received += 1
        rate = self.faults.error_rate
        if rate > 0 and (rate >= 1 or self._rng.random() < rate):
            self.stats.requests_failed += 1
            return True
        return False

    def set_faults(self, changes: Mapping[str, object]) -> SimFaults:
        self.faults = self.faults.merged(changes)
        return self.faults

    def reset(self) -> None:
        """Empty the cache and the tokenizer's memo, zero the counters and reseed the fault RNG
        (faults stay)."""
        self.cache.clear()
        self.tokenizer.clear()
        self.cache.evictions = 0
        self.stats = SimStats()
        self._rng.seed(self.config.seed)
        self.planner = make_planner(self.config)

    def state(self) -> dict[str, object]:
        cfg = self.config
        return {
            "name": cfg.name,
            "model": cfg.model,
            "block_size": cfg.block_size,
            "cache_blocks_used": len(self.cache),
            "cache_capacity_blocks": cfg.cache_blocks,
            "cache_evictions": self.cache.evictions,
            "tokenizer_memoised_tokens": self.tokenizer.memoised_tokens,
            "kv_usage": self.kv_usage,
            "running": self.running,
            "waiting": self.waiting,
            "max_running": cfg.max_running,
            "prefill_s_per_token": cfg.prefill_s_per_token,
            "decode_s_per_token": cfg.decode_s_per_token,
            **asdict(self.stats),
            "faults": self.faults.to_dict(),
        }

    def metrics_text(self) -> bytes:
        """Prometheus text exposition with vLLM's metric names (``gateway.sim.metrics``)."""
        return metrics_text(self)
