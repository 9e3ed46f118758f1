"""Prometheus metrics of one gateway (a registry per app: no module-level state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# The per-request metrics are lock-free (updated from the event loop only): see fastmetrics.py.
from .fastmetrics import FastCounter, FastHistogram

_LAT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = FastCounter(
            "kvgate_requests_total", "Requests answered, by route and status", ["route", "status"], registry=r
        )
        self.latency = FastHistogram(
            "kvgate_request_duration_seconds", "End-to-end latency seen at the gateway", ["route"],
            buckets=_LAT_BUCKETS, registry=r,
        )
        self.ttft = FastHistogram(
            "kvgate_time_to_first_token_seconds", "Time to the first streamed byte from the replica",
            ["route"], buckets=_LAT_BUCKETS, registry=r,
        )
        self.itl = FastHistogram(
            "kvgate_inter_chunk_latency_seconds", "Time between streamed chunks", ["route"],
            buckets=_ITL_BUCKETS, registry=r,
        )
        self.upstream_errors = Counter(
            "kvgate_upstream_errors_total", "Upstream failures by replica and kind", ["replica", "kind"], registry=r
        )
        self.warm_requests = Counter(
            "kvgate_warm_requests_total", "Prefill-only requests that copied a hot prefix (Decision.warm)",
            ["replica", "outcome"], registry=r,
        )
        self.retries = Counter("kvgate_retries_total", "Requests retried on an alternate", ["replica"], registry=r)
        self.ejections = Counter("kvgate_replica_ejections_total", "Passive ejections", ["replica"], registry=r)
        self.in_flight = Gauge("kvgate_replica_in_flight", "Requests in flight per replica", ["replica"], registry=r)
        self.healthy = Gauge("kvgate_replica_healthy", "1 if the replica is healthy", ["replica"], registry=r)
        self.decisions = FastCounter(
            "kvgate_routing_decisions_total", "Routing decisions", ["policy", "reason", "replica"], registry=r
        )
        self.predicted_cached = FastCounter(
            "kvgate_predicted_cached_tokens_total", "Cached prompt tokens the policy predicted", ["policy"], registry=r
        )
        self.actual_cached = FastCounter(
            "kvgate_actual_cached_tokens_total", "Cached prompt tokens the replicas reported", ["policy"], registry=r
        )
        self.prompt_tokens = FastCounter(
            "kvgate_prompt_tokens_total", "Prompt tokens the replicas reported", ["policy"], registry=r
        )
        self.prediction_error = FastHistogram(
            "kvgate_cached_tokens_prediction_error_tokens", "|predicted - actual| cached tokens per request",
            ["policy"], buckets=(0, 16, 64, 256, 1024, 4096, 16384), registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
