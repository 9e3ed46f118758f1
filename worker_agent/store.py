"""Tiered KV block store: LRU placement over GPU -> CPU -> disk tiers, with KV events.

``KVBlockStore`` executes the plans of ``placement.Placement`` (pure bookkeeping; carried out by
``plans.PlanRunner``) against physical tiers (``tiers.MemoryTier`` / ``disktier.DiskTier``):
demotion under pressure (GPU -> CPU -> disk -> dropped), promotion to the top tier on a hit,
explicit moves.  Blocks are keyed by their chained block hash (``policies.hashing``), which
already includes the model/LoRA salt.

Contracts.
* ``put`` copies the caller's tensor unless ``copy=False``, which hands the tensor over (the
  store may keep it as is; the caller must not modify it afterwards).
* Tensors returned by ``get`` / ``get_prefix`` / ``export`` belong to the store: read, never write.
  They stay valid after the block moves or leaves (the store drops its reference, nothing more).
* Chains: ``put_blocks`` and ``get_prefix`` touch blocks from the last to the first, so a prefix's
  root is the most recently used and its tail is demoted first (a tail is useless without its root).
* Every public operation reports its state changes once to ``on_events`` as a list of
  ``events.BlockStored`` / ``events.BlockRemoved``: the operation's net effect
  (``events.net_effect``: removals first, then stores with a parent before its children, so a
  chain put tail-first still reads root-first), coalesced.  The callback runs under the store
  lock: it must be quick (enqueue) and must not call the store.
* Batches: ``get_prefix`` and ``move_many`` read the disk blocks of each run of ``READ_AHEAD`` keys
  on two threads before moving them (``DiskTier.read_ahead``); the outcome equals the per-block
  ``get`` / ``move`` of each key in the same order.
* A block whose disk copy is unreadable or corrupt is dropped (``stats.lost``) and reads as a miss.
* Thread-safe: one lock around every public method.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .blockfmt import DTYPE_CODES, MAX_DIMS, Block, BlockHeader, checksum, header_for, payload_view
from .disktier import DiskTier
from .errors import AgentError
from .events import BlockRemoved, Event, coalesce, net_effect
from .placement import Placement, PlacementStats, TierCounters
from .plans import PlanRunner, Tier
from .tiers import BlockMeta, Copier, MemoryTier, cuda_available

EventSink = Callable[[list[Event]], None]


@dataclass(frozen=True, slots=True)
class StoreStats:
    mediums: tuple[str, ...]
    tiers: tuple[TierCounters, ...]
    misses: int
    stored: int
    removed: int
    lost: int
    rejected: int

    @property
    def blocks(self) -> int:
        return sum(t.blocks for t in self.tiers)


class KVBlockStore:
    READ_AHEAD = 64  # blocks a batched read (get_prefix, move_many) reads before moving them

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        on_events: EventSink | None = None,
        scan: int = 1,
    ) -> None:
        self.tiers: list[Tier] = list(tiers)
        self.placement = Placement(
            [t.capacity for t in self.tiers], [t.overhead for t in self.tiers], scan=scan
        )
        self._meta: dict[int, BlockMeta] = {}
        self._plans = PlanRunner(self.tiers, self.placement, self._meta)
        self._on_events = on_events
        self._lock = threading.RLock()
        self._pin_landing = any(getattr(t, "pinned", False) for t in self.tiers)
        for index, tier in enumerate(self.tiers):
            for key, nbytes, parent in tier.scan():
                if key in self.placement or not self._fits_now(index, nbytes):
                    tier.delete(key)
                    continue
                self.placement.adopt(key, nbytes, index)
                self._meta[key] = BlockMeta(parent=parent)

    @classmethod
    def create(
        cls,
        *,
        gpu_bytes: int,
        cpu_bytes: int,
        disk_bytes: int = 0,
        disk_dir: str | None = None,
        gpu_device: str | torch.device | None = None,
        on_events: EventSink | None = None,
        scan: int = 1,
    ) -> KVBlockStore:
        """The usual stack: "GPU" (``cuda`` when present; ``gpu_device`` overrides, e.g. "cpu"
        in tests), "CPU" (pinned when CUDA is present) and, with ``disk_dir``, "DISK"."""
        device = gpu_device or ("cuda" if cuda_available() else "cpu")
        copier = Copier()
        tiers: list[Tier] = [
            MemoryTier("GPU", device, gpu_bytes, copier=copier),
            MemoryTier("CPU", "cpu", cpu_bytes, copier=copier),
        ]
        if disk_dir is not None:
            tiers.append(DiskTier(disk_dir, disk_bytes, pin=cuda_available()))
        return cls(tiers, on_events=on_events, scan=scan)

    # -- writes --------------------------------------------------------------------------------
    def put(
        self,
        key: int,
        tensor: torch.Tensor,
        *,
        parent: int | None = None,
        token_ids: Sequence[int] = (),
        tier: int = 0,
        copy: bool = True,
        checksum: int | None = None,
    ) -> bool:
        """Store a block (in ``tier`` or the first lower tier that can hold it); False if present.

        ``checksum``: the payload's known xxh3_64 (e.g. verified on receipt), trusted as is.
        """
        with self._lock:
            events: list[Event] = []
            meta = BlockMeta(parent, tuple(token_ids), 0, checksum)
            new = self._put(key, tensor, meta, tier, copy, events)
            self._emit(events)
            return new

    def put_blocks(
        self,
        blocks: Sequence[Block],
        *,
        token_ids: Sequence[Sequence[int]] | None = None,
        tier: int = 0,
        copy: bool = True,
    ) -> int:
        """Store a chain (block i's parent defaults to block i-1); returns how many were new."""
        with self._lock:
            events: list[Event] = []
            new = 0
            for i in reversed(range(len(blocks))):
                b = blocks[i]
                parent = blocks[i - 1].key if b.parent is None and i > 0 else b.parent
                toks = tuple(token_ids[i]) if token_ids is not None else ()
                meta = BlockMeta(parent, toks, 0, b.checksum)
                new += self._put(b.key, b.tensor, meta, tier, copy, events)
            self._emit(events)
            return new

    def move(self, key: int, tier: int) -> bool:
        """Move a block to ``tier`` explicitly (e.g. offload); False if absent or lost."""
        with self._lock:
            if key not in self.placement:
                return False
            events: list[Event] = []
            self._plans.execute(self.placement.plan_move(key, tier), {}, True, events)
            self._emit(events)
            return key in self.placement

    def move_many(self, keys: Sequence[int], tier: int) -> int:
        """``move`` of each key in order, the disk reads batched (``_read_ahead``); returns how
        many of ``keys`` are in ``tier`` afterwards."""
        with self._lock:
            p, events = self.placement, []
            try:
                for key in self._read_ahead(keys, tier):
                    if key in p:
                        self._plans.execute(p.plan_move(key, tier), {}, True, events)
            finally:
                self._emit(events)
            return sum(p.tier_of(k) == tier for k in keys)

    def remove(self, key: int) -> bool:
        with self._lock:
            tier = self.placement.remove(key)
            if tier is None:
                return False
            self.tiers[tier].delete(key)
            self._meta.pop(key, None)
            self._emit([BlockRemoved((key,), self.tiers[tier].medium)])
            return True

    def clear(self) -> None:
        with self._lock:
            events: list[Event] = []
            for index, tier in enumerate(self.tiers):
                for key in self.placement.keys(index):
                    self.placement.remove(key)
                    tier.delete(key)
                    self._meta.pop(key, None)
                    events.append(BlockRemoved((key,), tier.medium))
            self._emit(events)

    # -- reads ---------------------------------------------------------------------------------
    def get(self, key: int) -> torch.Tensor | None:
        """The block (promoted to the top tier on a hit), or None on a miss."""
        with self._lock:
            events: list[Event] = []
            out = self._get(key, events)
            self._emit(events)
            return out

    def get_prefix(self, keys: Sequence[int]) -> list[torch.Tensor]:
        """Tensors of the longest run of ``keys`` present from the start, each promoted."""
        with self._lock:
            events: list[Event] = []
            n = self._prefix_len(keys)
            found = [self._get(k, events) for k in self._read_ahead(keys[:n][::-1])][::-1]
            self._emit(events)
            run = next((i for i, t in enumerate(found) if t is None), n)
            return found[:run]  # type: ignore[return-value]

    def contains_prefix(self, keys: Sequence[int]) -> int:
        """How many of ``keys``, from the start, the store holds (any tier; no side effects)."""
        with self._lock:
            return self._prefix_len(keys)

    def locate(self, keys: Iterable[int]) -> list[int | None]:
        """Tier index of each key (None when absent); no side effects."""
        with self._lock:
            return [self.placement.tier_of(k) for k in keys]

    def sizes(self, keys: Iterable[int]) -> list[int | None]:
        """Payload bytes of each key (None when absent); no side effects."""
        with self._lock:
            p = self.placement
            return [p.size_of(k) if k in p else None for k in keys]

    def __contains__(self, key: int) -> bool:
        return key in self.placement

    def __len__(self) -> int:
        return len(self.placement)

    def export(self, key: int) -> tuple[BlockHeader, torch.Tensor] | None:
        """A host copy-or-view of a block with its checksummed header, for sending to a peer.

        Does not promote (serving a peer is not a local hit) but refreshes the block's recency.
        """
        with self._lock:
            tier = self.placement.tier_of(key)
            if tier is None:
                return None
            meta = self._meta[key]
            try:
                tensor = self.tiers[tier].load(key, host=True)
            except (OSError, AgentError) as exc:
                events: list[Event] = []
                self._plans.lose(key, exc, events)
                self._emit(events)
                return None
            host = tensor if tensor.device.type == "cpu" else tensor.to("cpu")
            if meta.checksum is None:
                meta.checksum = checksum(payload_view(host))
            self.placement.touch(key)
            return header_for(key, host, parent=meta.parent, csum=meta.checksum), host

    def landing(self, nbytes: int) -> torch.Tensor:
        """A host buffer for receiving a block that ``put(copy=False)`` can then keep as is."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin_landing)

    def close(self) -> None:
        """Release the memory tiers; blocks on disk stay for a reopen.  Do not use it afterwards."""
        with self._lock:
            for tier in self.tiers:
                tier.close()

    def __enter__(self) -> KVBlockStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- introspection -------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        with self._lock:
            s: PlacementStats = self.placement.stats
            return StoreStats(
                tuple(t.medium for t in self.tiers),
                tuple(dataclasses.replace(c) for c in s.tiers),
                s.misses, s.stored, s.removed, s.lost, s.rejected,
            )  # fmt: skip

    def physical(self) -> list[tuple[int, int]]:
        """(blocks, bytes) per tier counted from the tiers themselves."""
        with self._lock:
            return [t.held() for t in self.tiers]

    def hottest(self, n: int) -> list[int]:
        with self._lock:
            return self.placement.hottest(n)

    def snapshot_events(self) -> list[Event]:
        """BlockStored events describing everything held (for a publisher's resync)."""
        with self._lock:
            events: list[Event] = []
            for index, tier in enumerate(self.tiers):
                events.extend(self._plans.stored(k, tier.medium) for k in self.placement.keys(index))
            return coalesce(events)

    # -- internals -----------------------------------------------------------------------------
    def _fits_now(self, tier: int, nbytes: int) -> bool:
        p = self.placement
        return p.stats.tiers[tier].bytes + p.charge(tier, nbytes) <= p.capacities[tier]

    def _read_ahead(self, keys: Sequence[int], to: int | None = None) -> Iterator[int]:
        """``keys``, each run of ``READ_AHEAD`` read by the disk tiers that hold them (not tier
        ``to``) on two threads (``DiskTier.read_ahead``) before the caller moves it."""
        n, where = self.READ_AHEAD, self.placement.tier_of
        for start in range(0, len(keys), n):
            run = keys[start : start + n]
            with contextlib.ExitStack() as stack:
                for index, tier in enumerate(self.tiers):
                    if isinstance(tier, DiskTier) and index != to:
                        stack.enter_context(tier.read_ahead(k for k in run if where(k) == index))
                yield from run

    def _prefix_len(self, keys: Sequence[int]) -> int:
        return next((i for i, k in enumerate(keys) if k not in self.placement), len(keys))

    def _put(self, key, tensor, meta: BlockMeta, tier, copy, events) -> bool:
        if key in self.placement:
            self.placement.touch(key)
            return False
        if tensor.dtype not in DTYPE_CODES or tensor.dim() > MAX_DIMS:
            raise ValueError(f"unsupported block: dtype {tensor.dtype}, {tensor.dim()} dims")
        steps = self.placement.plan_put(key, tensor.nbytes, tier)
        meta.block_size = len(meta.token_ids) or (tensor.shape[2] if tensor.dim() == 5 else 0)
        self._meta[key] = meta
        self._plans.execute(steps, {key: tensor}, not copy, events)
        return key in self.placement

    def _get(self, key: int, events: list[Event]) -> torch.Tensor | None:
        tier = self.placement.tier_of(key)
        if tier is None:
            self.placement.plan_get(key)  # counts the miss
            return None
        try:
            tensor = self.tiers[tier].load(key)  # read (and verify) before deciding anything
        except (OSError, AgentError) as exc:
            self._plans.lose(key, exc, events)
            self.placement.stats.misses += 1
            return None
        _, steps = self.placement.plan_get(key)
        if not steps:
            return tensor
        self._plans.execute(steps, {key: tensor}, True, events)
        where = self.placement.tier_of(key)
        return self.tiers[where].load(key) if where is not None else tensor

    def _emit(self, events: list[Event]) -> None:
        if events and self._on_events is not None:
            self._on_events(coalesce(net_effect(events)))
