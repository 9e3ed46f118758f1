"""The worker agent as a service: a tiered block store, its data port, its events, its control API.

``AgentService`` owns, built in this order and closed in reverse:

* ``store``: a :class:`~worker_agent.store.KVBlockStore` whose events feed the publisher;
* ``publisher``: vLLM-format KV events over ZMQ (:mod:`worker_agent.publisher`), with the
  shared-store sink (:mod:`worker_agent.shared`) as a listener when a Redis URL is configured;
* ``blocks``: the store's write path with per-block versions (:mod:`worker_agent.versioned`):
  local writes bump a block's version, copies from peers apply only when newer;
* ``server``: the data port, a :class:`~worker_agent.transport.tcp.TcpBlockServer` peers fetch
  from and push to (versions ride along); ``transport``: the client side used by pull/push;
* ``replicator``: hot-prefix replication (:mod:`worker_agent.replication`): lookups and loads
  that hit record the prefix; with peers and ``replication.interval_s`` > 0 a loop pushes hot
  prefixes to ``k`` nodes every interval.

The HTTP control API (:mod:`worker_agent.api`) calls the methods below; each returns plain data.
On start the publisher first announces everything the store already holds (a reopened disk
tier), so a subscriber that joins later can ask the replay socket for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import httpx
import torch

from .blockfmt import Block
from .migration import RateEstimator, Version
from .publisher import KvEventPublisher
from .replication import ReplicationConfig, Replicator
from .store import KVBlockStore
from .transport.tcp import TcpBlockServer, TcpTransport
from .versioned import VersionedBlocks


@dataclass(frozen=True)
class AgentConfig:
    name: str = "agent"
    host: str = "127.0.0.1"
    port: int = 8100  # HTTP control API
    data_host: str = "127.0.0.1"
    data_port: int = 8101  # TCP block transport (0: any free port)
    data_unix: str | None = None  # also serve blocks on this Unix socket (an engine-local connector)
    events_endpoint: str | None = "tcp://*:5557"  # ZMQ PUB (None: no socket)
    replay_endpoint: str | None = None  # ZMQ ROUTER for replays
    topic: str = "kv-events"
    redis_url: str = ""  # shared store; empty: none
    replica_id: str = ""  # the gateway's id of the engine this agent serves
    namespace: str = "kvgate"
    gpu_bytes: int = 1 << 30
    cpu_bytes: int = 4 << 30
    disk_bytes: int = 0
    disk_dir: str | None = None
    device: str | None = None  # "GPU" tier device; None: cuda when present, else cpu
    transfer_timeout_s: float = 30.0
    bandwidth_prior: float = 1e9  # bytes/s before the first measured transfer
    max_hashes: int = 65_536  # per API request
    peers: tuple[str, ...] = ()  # other agents' control-API URLs (replication)
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)

    def __post_init__(self) -> None:
        if self.redis_url and not self.replica_id:
            raise ValueError("a shared store (redis_url) needs replica_id: the engine's replica id")
        if min(self.gpu_bytes, self.cpu_bytes, self.disk_bytes) < 0:
            raise ValueError("tier sizes must be >= 0")
        if self.disk_bytes and not self.disk_dir:
            raise ValueError("disk_bytes needs disk_dir")
        if self.max_hashes < 1 or self.transfer_timeout_s <= 0:
            raise ValueError("max_hashes must be >= 1 and transfer_timeout_s > 0")


@dataclass
class TransferStats:
    pulls: int = 0
    pushes: int = 0
    blocks_in: int = 0
    blocks_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    failures: int = 0


class AgentService:
    def __init__(
        self,
        config: AgentConfig,
        *,
        clock: Callable[[], float] = time.perf_counter,
        wall: Callable[[], float] = time.time,
        shared_store=None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.shared = None
        listeners = []
        if config.redis_url or shared_store is not None:
            from .shared import SharedStoreSink

            if shared_store is None:
                from gateway.state import make_store

                shared_store = make_store(config.redis_url, namespace=config.namespace)
            self.shared = SharedStoreSink(
                shared_store, config.replica_id or config.name, name=config.name, wall=wall
            )
            listeners.append(self.shared)
        self.publisher = KvEventPublisher(
            config.events_endpoint, config.replay_endpoint, topic=config.topic, wall=wall,
            listeners=listeners,
        )  # fmt: skip
        self.store = KVBlockStore.create(
            gpu_bytes=config.gpu_bytes, cpu_bytes=config.cpu_bytes, disk_bytes=config.disk_bytes,
            disk_dir=config.disk_dir, gpu_device=config.device, on_events=self.publisher.sink,
        )  # fmt: skip
        self.blocks = VersionedBlocks(self.store, config.name)
        self.server = TcpBlockServer(
            self.store, config.data_host, config.data_port, timeout=config.transfer_timeout_s,
            export=self.blocks.export, accept=self.blocks.accept, unix_path=config.data_unix,
        )  # fmt: skip
        self.transport = TcpTransport(timeout=config.transfer_timeout_s, alloc=self.store.landing)
        self.bandwidth = RateEstimator(config.bandwidth_prior)
        self.transfers = TransferStats()
        self.mediums = tuple(t.medium for t in self.store.tiers)
        self.http = httpx.AsyncClient()
        self.replicator = Replicator(
            config.name, self.store, self.push, self.http, config.peers, config.replication,
            clock=clock, max_hashes=config.max_hashes,
        )  # fmt: skip
        self._loop: asyncio.Task | None = None
        self._started = False

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> AgentService:
        await self.publisher.start()
        try:
            self.publisher.sink(self.store.snapshot_events())
            if self.shared is not None:
                self.shared.start()
            await self.server.start()
        except BaseException:
            await self.publisher.close()
            raise
        if self.config.peers and self.config.replication.interval_s > 0:
            self._loop = asyncio.ensure_future(self.replicator.run())
        self._started = True
        return self

    async def close(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        await self.http.aclose()
        await self.server.close()
        await self.transport.close()
        await self.publisher.close()
        if self.shared is not None:
            await self.shared.close()
        self.store.close()

    @property
    def data_address(self) -> str:
        return self.server.address

    # -- operations (the API's handlers call these) ------------------------------------------------
    def tier_index(self, medium: str) -> int:
        try:
            return self.mediums.index(medium.upper())
        except ValueError:
            raise ValueError(f"unknown tier {medium!r}; tiers: {list(self.mediums)}") from None

    def lookup(self, hashes: Sequence[int], *, count_hit: bool = True) -> dict:
        """Where each hash is held; the held leading run counts as a hit unless ``count_hit``
        is false (replication probes)."""
        where = self.store.locate(hashes)
        tiers = [None if t is None else self.mediums[t] for t in where]
        prefix = next((i for i, t in enumerate(where) if t is None), len(where))
        if count_hit:
            self.replicator.hit(hashes[:prefix])
        return {
            "tiers": tiers,
            "prefix_blocks": prefix,
            "held": sum(t is not None for t in where),
        }

    def load(self, hashes: Sequence[int]) -> list[torch.Tensor]:
        """Tensors of the longest held run of ``hashes`` (promoted); a hit on that prefix."""
        found = self.store.get_prefix(hashes)
        self.replicator.hit(hashes[: len(found)])
        return found

    def write(self, blocks: Sequence[Block], *, tier: int = 0) -> list[Version]:
        """Local writes (e.g. an engine's new KV blocks): each gets a version above any seen."""
        return self.blocks.write(blocks, tier=tier)

    async def pull(self, peer: str, hashes: Sequence[int], *, prefix: bool, tier: int) -> dict:
        """Fetch ``hashes`` from ``peer``'s data port and store them locally."""
        started = self.clock()
        try:
            blocks = await self.transport.fetch(peer, hashes, prefix=prefix)
        except BaseException:
            self.transfers.failures += 1
            raise
        seconds = self.clock() - started
        nbytes = sum(b.tensor.nbytes for b in blocks)
        self.bandwidth.observe(nbytes, seconds)
        counts = await asyncio.to_thread(self.blocks.apply, blocks, tier=tier)
        got = {b.key for b in blocks}
        s = self.transfers
        s.pulls += 1
        s.blocks_in += len(blocks)
        s.bytes_in += nbytes
        return {
            "requested": len(hashes),
            "received": len(blocks),
            "stored": counts.stored,
            "rejected": counts.rejected,
            "stale": counts.stale,
            "missing": [h for h in hashes if h not in got],
            "bytes": nbytes,
            "seconds": seconds,
        }

    async def push(self, peer: str, hashes: Sequence[int]) -> dict:
        """Send the blocks among ``hashes`` this agent holds to ``peer``'s store."""
        blocks = await asyncio.to_thread(self.blocks.export_blocks, hashes)
        started = self.clock()
        try:
            accepted = await self.transport.push(peer, blocks) if blocks else 0
        except BaseException:
            self.transfers.failures += 1
            raise
        seconds = self.clock() - started
        nbytes = sum(b.tensor.nbytes for b in blocks)
        if blocks:
            self.bandwidth.observe(nbytes, seconds)
        sent = {b.key for b in blocks}
        s = self.transfers
        s.pushes += 1
        s.blocks_out += len(blocks)
        s.bytes_out += nbytes
        return {
            "requested": len(hashes),
            "sent": len(blocks),
            "stored_by_peer": accepted,
            "missing": [h for h in hashes if h not in sent],
            "bytes": nbytes,
            "seconds": seconds,
        }

    def stats(self) -> dict:
        st = self.store.stats()
        tiers = {
            medium: {**asdict(c), "capacity": t.capacity}
            for medium, c, t in zip(st.mediums, st.tiers, self.store.tiers, strict=True)
        }
        pub = self.publisher
        return {
            "name": self.config.name,
            "data_address": self.data_address if self._started else None,
            "blocks": st.blocks,
            "tiers": tiers,
            "misses": st.misses,
            "stored": st.stored,
            "removed": st.removed,
            "lost": st.lost,
            "rejected": st.rejected,
            "events": {
                "endpoint": pub.endpoint,
                "replay_endpoint": pub.replay_endpoint,
                "topic": pub.topic.decode(),
                "next_seq": pub.next_seq,
                "published": pub.events_published,
            },
            "transfers": {**asdict(self.transfers), "bandwidth_Bps": self.bandwidth.rate},
            "versions": {
                "tracked": len(self.blocks.versions.versions),
                **asdict(self.blocks.totals),
            },
            "replication": {
                "peers": list(self.replicator.peers),
                "k": self.config.replication.k,
                "tracked_prefixes": len(self.replicator.chains),
                **asdict(self.replicator.stats),
            },
            "shared": None
            if self.shared is None
            else {
                "replica_id": self.shared.replica_id,
                "published": self.shared.published,
                "pending": self.shared.pending,
                "failures": self.shared.failures,
            },
        }
