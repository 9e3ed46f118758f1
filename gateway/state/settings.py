"""Tuning of the shared-state sync (defaults suit a LAN Redis and a few gateways)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .backoff import Backoff


@dataclass(frozen=True)
class SyncSettings:
    heartbeat_s: float = 0.5  # publish our in-flight counts / read everyone's this often
    load_ttl_s: float = 2.0  # a gateway silent this long no longer counts (its hash expires)
    read_count: int = 512  # stream entries per read
    block_s: float = 1.0  # XREAD BLOCK time (also bounds how long a dead link goes unnoticed)
    max_batch: int = 512  # events per publish
    flush_interval_s: float | None = None  # least time between publishes; None: the store's own
    outbox_max: int = 10_000  # events kept while the store is away (oldest dropped beyond)
    op_timeout_s: float = 2.0  # bound on any one store call (plus block_s for reads)
    catchup_timeout_s: float = 10.0  # ready without the replay once the store was away this long
    backoff: Backoff = field(default_factory=Backoff)  # probe schedule while the store is away

    def __post_init__(self) -> None:
        if self.flush_interval_s is not None and self.flush_interval_s < 0:
            raise ValueError("flush_interval_s must be >= 0")
        if min(self.heartbeat_s, self.load_ttl_s, self.block_s, self.op_timeout_s) <= 0:
            raise ValueError("sync intervals and timeouts must be positive")
        if min(self.read_count, self.max_batch, self.outbox_max) < 1:
            raise ValueError("read_count, max_batch and outbox_max must be >= 1")
