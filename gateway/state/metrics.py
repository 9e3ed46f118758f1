"""Prometheus metrics of the shared-state sync, registered on the gateway's own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


class StateMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry(auto_describe=True)
        self.up = Gauge("kvgate_store_up", "1 when the shared-state store is reachable", ["backend"], registry=r)
        self.caught_up = Gauge(
            "kvgate_store_caught_up", "1 once the local view has replayed the shared stream", registry=r
        )
        self.errors = Counter(
            "kvgate_store_sync_errors_total", "Failed store operations, by operation", ["op"], registry=r
        )
        self.published = Counter(
            "kvgate_store_events_published_total", "Index-change events this gateway published", registry=r
        )
        self.applied = Counter(
            "kvgate_store_events_applied_total", "Other gateways' events applied to the local view",
            registry=r,
        )
        self.dropped = Counter(
            "kvgate_store_events_dropped_total", "Events dropped from a full outbox (store down too long)",
            registry=r,
        )
        self.outbox = Gauge("kvgate_store_outbox_events", "Events waiting to be published", registry=r)
        self.snapshots = Counter(
            "kvgate_store_session_snapshots_total", "Session snapshots loaded (stream trimmed past us)",
            registry=r,
        )
        self.lag = Histogram(
            "kvgate_store_apply_lag_seconds",
            "From a routing decision on another gateway to its apply here (wall clocks)",
            buckets=_LAG_BUCKETS, registry=r,
        )
        self.remote_in_flight = Gauge(
            "kvgate_store_remote_in_flight", "In-flight requests other gateways report, per replica",
            ["replica"], registry=r,
        )
