"""Configuration of a simulated replica: the timing/cache model and the fault knobs."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace


@dataclass(frozen=True, slots=True)
class SimFaults:
    """Misbehaviour a replica can be told to show (at start, or at runtime via ``POST /sim/faults``).

    * ``error_rate``: fraction of completion requests answered 503 (seeded RNG, per replica).
    * ``hang``: accept completion requests and never answer until the client disconnects.
    * ``close_after_chunks``: send this many body chunks (SSE events; half the JSON body when not
      streaming), then drop the connection without a proper end.  ``None`` = off.
    * ``stall_after_chunks``: the same, but stall forever (until the client disconnects).
    * ``unhealthy``: ``GET /health`` answers 503 (inference still works).
    * ``probe_delay_s``: ``GET /health`` and ``GET /metrics`` answer this many seconds late, as a
      busy engine's API server does (inference still works).
    """

    error_rate: float = 0.0
    hang: bool = False
    close_after_chunks: int | None = None
    stall_after_chunks: int | None = None
    unhealthy: bool = False
    probe_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.error_rate, bool) or not isinstance(self.error_rate, int | float):
            raise ValueError("error_rate must be a number")
        if not 0.0 <= float(self.error_rate) <= 1.0:
            raise ValueError("error_rate must be in [0, 1]")
        delay = self.probe_delay_s
        if isinstance(delay, bool) or not isinstance(delay, int | float) or not 0 <= delay <= 3600:
            raise ValueError("probe_delay_s must be a number of seconds in [0, 3600]")
        for name in ("hang", "unhealthy"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean")
        for name in ("close_after_chunks", "stall_after_chunks"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"{name} must be null or an integer >= 0")

    def merged(self, changes: Mapping[str, object]) -> SimFaults:
        """A copy with ``changes`` applied; unknown keys or bad values raise ``ValueError``."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown fault(s): {', '.join(unknown)}")
        return replace(self, **changes)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @property
    def any(self) -> bool:
        return self != SimFaults()


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated replica.  Times are in seconds; zero costs give an instant mock replica."""

    model: str = "tiny"
    block_size: int = 16
    cache_blocks: int = 2048  # prefix-cache capacity in blocks (0 disables caching)
    max_running: int = 8  # admission limit; the rest queue FIFO
    prefill_s_per_token: float = 0.0001  # per uncached prompt token (-> TTFT)
    decode_s_per_token: float = 0.002  # per output token after the first
    default_max_tokens: int = 16  # output length when the client sets no limit
    faults: SimFaults = field(default_factory=SimFaults)
    seed: int = 0  # seeds the fault RNG
    # KV pulls from a peer replica (``kv_transfer_params``, see gateway.sim.kvpull)
    kv_bandwidth_gbps: float = 100.0  # link between replicas, Gbit/s (0: never pull)
    kv_block_bytes: int = 2 << 20  # KV bytes of one block (8B model, 16 tokens: 2 MiB)
    kv_pull_overhead_s: float = 0.002  # fixed cost of one pull (connect, lookup, setup)
    name: str = ""  # replica name, reported in the x-sim-replica header and /sim/state

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a non-empty string")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.cache_blocks < 0:
            raise ValueError("cache_blocks must be >= 0")
        if self.max_running < 1:
            raise ValueError("max_running must be >= 1")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")
        if self.kv_block_bytes < 0:
            raise ValueError("kv_block_bytes must be >= 0")
        for name in ("prefill_s_per_token", "decode_s_per_token", "kv_bandwidth_gbps",
                     "kv_pull_overhead_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0")

    @property
    def instant(self) -> bool:
        """True when no request ever sleeps (mock replica for proxy benchmarks)."""
        return self.prefill_s_per_token == 0 and self.decode_s_per_token == 0
