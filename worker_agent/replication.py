"""Hot-prefix replication, run by the agent: copies of hot prefixes pushed to k alive nodes.

Prefix.  A chain of block hashes from the root.  Each hash chains every one before it, so the
last hash names the whole prefix: it is the prefix's id (the ``HotPrefixes`` key, the rendezvous
seed), and the replicator remembers the chain of each id it has seen hit.

Hits.  The agent records a hit wherever it serves a prefix: a lookup that finds leading blocks
(``AgentService.lookup``, ``POST /v1/lookup``) counts the held part ``hashes[:prefix_blocks]``, a
local load (``AgentService.load``) the part it returned.  Replication's own probes
(``count_hit: false``) and peers' fetches from the data port are not hits.

Peers.  Control-API URLs (``kvgate agent --peer``).  Each round GETs every peer's ``/health``
(``peer_timeout_s``): a peer that answers is alive, and the answer gives its name (its node id
for rendezvous: names must be unique) and data address.  A URL that turns out to be this agent is
skipped, so every agent can be given the same list.

A round, ``replicate_once(now)``:

1. hot prefixes: the ``max_prefixes`` highest decayed hit rates (half-life ``half_life_s``) at or
   above ``min_rate``; prefixes whose rate fell under ``min_rate / 16`` are forgotten;
2. holders: this agent holds a prefix when it holds every block of its chain; each alive peer is
   asked for all hot chains in one ``/v1/lookup`` (``count_hit: false``);
3. ``migration.plan_replication(holders, rates, alive, k, min_rate, sizes=chain lengths)``;
4. this agent pushes every planned copy of a prefix it holds, over the data port with versions,
   itself as the source whichever holder the plan named (hit rates are local: another holder may
   not see the prefix hot).  Rendezvous order makes independent planners pick the same
   destinations, and a copy that arrives twice is refused as a duplicate by its version.  Copies of
   prefixes it does not hold are left to their holders;
5. budget: at most ``max_blocks`` blocks and ``max_bytes`` bytes pushed per round; a copy that does
   not fit in what is left is deferred to a later round (counted), smaller ones still go.

``run(trigger)`` awaits ``trigger()`` (default: sleep ``interval_s``), then runs a round at
``clock()``; a round that fails is logged and counted and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import httpx

from .errors import AgentError
from .migration import Copy, HotPrefixes, ReplicationPlan, plan_replication
from .store import KVBlockStore

log = logging.getLogger(__name__)

Push = Callable[[str, Sequence[int]], Awaitable[dict]]


@dataclass(frozen=True)
class ReplicationConfig:
    k: int = 2  # copies of a hot prefix (this one included)
    min_rate: float = 4.0  # decayed hits that make a prefix hot
    half_life_s: float = 60.0
    interval_s: float = 5.0  # between rounds; 0: no loop (drive replicate_once yourself)
    max_blocks: int = 4096  # pushed per round
    max_bytes: int = 1 << 30  # pushed per round
    max_prefixes: int = 256  # hot prefixes considered per round
    max_tracked: int = 65_536  # prefixes whose hits are kept
    peer_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.k < 1 or self.max_prefixes < 1 or self.max_tracked < 1:
            raise ValueError("replication k, max_prefixes and max_tracked must be >= 1")
        if not (self.min_rate > 0 and self.half_life_s > 0 and self.peer_timeout_s > 0):
            raise ValueError("replication min_rate, half_life_s and peer_timeout_s must be > 0")
        if self.interval_s < 0 or self.max_blocks < 0 or self.max_bytes < 0:
            raise ValueError("replication interval and budgets must be >= 0")


@dataclass
class ReplicationStats:
    rounds: int = 0
    failed_rounds: int = 0
    hot: int = 0  # last round
    alive_peers: int = 0  # last round
    lost: int = 0  # last round: hot prefixes no alive node holds
    lost_total: int = 0
    copies_planned: int = 0  # copies of prefixes this agent holds
    prefixes_pushed: int = 0
    blocks_pushed: int = 0
    bytes_pushed: int = 0
    blocks_stored_by_peers: int = 0
    deferred: int = 0  # copies over the round's budget
    push_failures: int = 0


@dataclass(frozen=True)
class PeerInfo:
    url: str
    name: str
    data_address: str


@dataclass
class RoundReport:
    rates: dict = field(default_factory=dict)  # the hot prefixes
    plan: ReplicationPlan = field(default_factory=ReplicationPlan)
    alive: tuple[str, ...] = ()
    pushed: list[Copy] = field(default_factory=list)
    deferred: list[Copy] = field(default_factory=list)
    failed: list[Copy] = field(default_factory=list)


class Replicator:
    def __init__(
        self,
        name: str,
        store: KVBlockStore,
        push: Push,
        http: httpx.AsyncClient,
        peers: Sequence[str],
        config: ReplicationConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_hashes: int = 65_536,
    ) -> None:
        self.name = name
        self.store = store
        self.push = push
        self.http = http
        self.peers = [p.rstrip("/") for p in peers]
        self.config = config
        self.clock = clock
        self.max_hashes = max_hashes
        self.hits = HotPrefixes(config.half_life_s)
        self.chains: dict[int, tuple[int, ...]] = {}
        self.stats = ReplicationStats()
        self.round_done = asyncio.Condition()  # notified after each round of ``run``

    # -- hits ------------------------------------------------------------------------------------
    def hit(self, chain: Sequence[int], now: float | None = None) -> None:
        """A served prefix (see the module header); ``now`` defaults to the clock."""
        if not chain:
            return
        now = self.clock() if now is None else now
        self.chains[chain[-1]] = tuple(chain)
        self.hits.hit(chain[-1], now)
        if len(self.chains) > self.config.max_tracked:
            keep = self.hits.hottest(self.config.max_tracked // 2, now)
            self._forget(now, keep[-1][1] if keep else 0.0)

    def _forget(self, now: float, below: float) -> None:
        self.hits.prune(now, below)
        for key in [k for k in self.chains if k not in self.hits]:
            del self.chains[key]

    def hot(self, now: float) -> dict[int, float]:
        """The prefixes hot at ``now`` with their rates (at most ``max_prefixes``)."""
        self._forget(now, self.config.min_rate / 16)
        top = self.hits.hottest(self.config.max_prefixes, now)
        return {p: r for p, r in top if r >= self.config.min_rate}

    # -- peers -----------------------------------------------------------------------------------
    async def _health(self, url: str) -> PeerInfo | None:
        try:
            resp = await self.http.get(url + "/health", timeout=self.config.peer_timeout_s)
            body = resp.json() if resp.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return None
        if body.get("status") != "ok" or not body.get("name") or not body.get("data_address"):
            return None
        return PeerInfo(url, body["name"], body["data_address"])

    async def alive_peers(self) -> list[PeerInfo]:
        found = await asyncio.gather(*(self._health(u) for u in self.peers))
        return [p for p in found if p is not None and p.name != self.name]

    async def _held_by(self, peer: PeerInfo, hashes: list[int]) -> set[int] | None:
        held: set[int] = set()
        for i in range(0, len(hashes), self.max_hashes):
            part = hashes[i : i + self.max_hashes]
            try:
                resp = await self.http.post(
                    peer.url + "/v1/lookup", json={"hashes": part, "count_hit": False},
                    timeout=self.config.peer_timeout_s,
                )  # fmt: skip
                resp.raise_for_status()
                tiers = resp.json()["tiers"]
            except (httpx.HTTPError, ValueError, KeyError):
                return None
            held.update(h for h, t in zip(part, tiers, strict=False) if t is not None)
        return held

    async def holders(self, hot: Sequence[int], peers: Sequence[PeerInfo]) -> dict:
        """Prefix -> names of the nodes (this one and ``peers``) holding its whole chain."""
        chains = {p: self.chains[p] for p in hot}
        hashes = list(dict.fromkeys(h for c in chains.values() for h in c))
        mine = {h for h, t in zip(hashes, self.store.locate(hashes), strict=True) if t is not None}
        held = {self.name: mine}
        answers = await asyncio.gather(*(self._held_by(p, hashes) for p in peers))
        held.update({p.name: a for p, a in zip(peers, answers, strict=True) if a is not None})
        return {p: {n for n, h in held.items() if h.issuperset(c)} for p, c in chains.items()}

    # -- rounds ----------------------------------------------------------------------------------
    async def replicate_once(self, now: float) -> RoundReport:
        """One round at ``now`` (see the module header)."""
        rates = self.hot(now)
        report = RoundReport(rates)
        if rates:
            peers = await self.alive_peers()
            holders = await self.holders(list(rates), peers)
            report.alive = (self.name, *(p.name for p in peers))
            report.plan = plan_replication(
                holders, rates, report.alive, k=self.config.k, min_rate=self.config.min_rate,
                sizes={p: len(self.chains[p]) for p in rates},
            )  # fmt: skip
            mine = [c for c in report.plan.copies if self.name in holders[c.prefix]]
            await self._execute(mine, {p.name: p for p in peers}, report)
        self._count(report)
        return report

    async def _execute(self, copies: list[Copy], peers: dict, report: RoundReport) -> None:
        blocks_left, bytes_left = self.config.max_blocks, self.config.max_bytes
        for copy in copies:
            chain = self.chains[copy.prefix]
            nbytes = sum(n or 0 for n in self.store.sizes(chain))
            if len(chain) > blocks_left or nbytes > bytes_left:
                report.deferred.append(copy)
                continue
            try:
                result = await self.push(peers[copy.dst].data_address, chain)
            except AgentError as exc:
                log.warning("replicating %016x to %s failed: %s", copy.prefix, copy.dst, exc)
                report.failed.append(copy)
                continue
            blocks_left -= result["sent"]
            bytes_left -= result["bytes"]
            self.stats.blocks_pushed += result["sent"]
            self.stats.bytes_pushed += result["bytes"]
            self.stats.blocks_stored_by_peers += result["stored_by_peer"]
            report.pushed.append(copy)

    def _count(self, report: RoundReport) -> None:
        s = self.stats
        s.rounds += 1
        s.hot = len(report.rates)
        s.alive_peers = max(0, len(report.alive) - 1)
        s.lost = len(report.plan.lost)
        s.lost_total += s.lost
        s.copies_planned += len(report.pushed) + len(report.deferred) + len(report.failed)
        s.prefixes_pushed += len(report.pushed)
        s.deferred += len(report.deferred)
        s.push_failures += len(report.failed)

    async def run(self, trigger: Callable[[], Awaitable[object]] | None = None) -> None:
        """Rounds forever, each after ``trigger()`` (default: sleep ``interval_s``)."""
        trigger = trigger or (lambda: asyncio.sleep(self.config.interval_s))
        while True:
            await trigger()
            try:
                await self.replicate_once(self.clock())
            except Exception:
                self.stats.failed_rounds += 1
                log.exception("replication round failed")
            async with self.round_done:
                self.round_done.notify_all()
