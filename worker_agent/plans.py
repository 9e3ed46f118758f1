"""Carrying out ``placement.Placement``'s plans against the physical tiers, for ``store``.

``PlanRunner`` does the I/O a plan's steps describe (take a block out, move it between tiers,
drop it, store a staged tensor), reports each state change as a KV event, and drops a block whose
copy cannot be read or written (``lose``).  It runs under the store's lock and shares the store's
tiers, placement and per-block metadata.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .disktier import DiskTier
from .errors import AgentError
from .events import BlockRemoved, BlockStored, Event
from .placement import Placement, Step, StepKind
from .tiers import BlockMeta, MemoryTier

log = logging.getLogger("worker_agent.store")  # the store's drops, under the store's name

Tier = MemoryTier | DiskTier


class PlanRunner:
    def __init__(self, tiers: Sequence[Tier], placement: Placement, meta: dict[int, BlockMeta]) -> None:
        self.tiers = tiers
        self.placement = placement
        self.meta = meta

    def execute(self, steps: list[Step], staged: dict, owned: bool, events: list[Event]) -> None:
        failed: set[int] = set()
        for kind, key, src, dst in steps:
            if key in failed:
                continue
            try:
                if kind is StepKind.TAKE:
                    if key not in staged:
                        staged[key] = self.tiers[src].load(key)
                    self.tiers[src].delete(key)
                    events.append(BlockRemoved((key,), self.tiers[src].medium))
                elif kind is StepKind.MOVE:
                    tensor = self.tiers[src].load(key)
                    self.tiers[dst].store(key, tensor, self.meta[key], owned=True)
                    self.tiers[src].delete(key)
                    events.append(BlockRemoved((key,), self.tiers[src].medium))
                    events.append(self.stored(key, self.tiers[dst].medium))
                elif kind is StepKind.DROP:
                    self.tiers[src].delete(key)
                    self.meta.pop(key, None)
                    events.append(BlockRemoved((key,), self.tiers[src].medium))
                else:
                    self.tiers[dst].store(key, staged.pop(key), self.meta[key], owned=owned)
                    events.append(self.stored(key, self.tiers[dst].medium))
            except (OSError, AgentError) as exc:
                failed.add(key)
                self.lose(key, exc, events)

    def lose(self, key: int, exc: BaseException, events: list[Event]) -> None:
        """Drop a block whose copy failed (read, verify or write) from every tier."""
        log.warning("dropping block %016x: %s", key, exc)
        self.placement.forget(key)
        self.meta.pop(key, None)
        for tier in self.tiers:
            if key in tier:
                tier.delete(key)
                events.append(BlockRemoved((key,), tier.medium))

    def stored(self, key: int, medium: str) -> BlockStored:
        meta = self.meta[key]
        return BlockStored((key,), meta.parent, meta.token_ids, meta.block_size, medium)
