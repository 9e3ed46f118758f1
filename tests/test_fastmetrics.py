"""gateway.fastmetrics exposes exactly what prometheus_client would for the same updates."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.fastmetrics import FastCounter, FastHistogram

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.1, 1, 10)


def _without_created(text: bytes) -> list[str]:
    lines = text.decode().splitlines()
    return [ln for ln in lines if "_created" not in ln]


def test_same_exposition_as_prometheus_client():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    c1 = FastCounter("x_requests_total", "Requests", ["route", "status"], registry=ours)
    c2 = Counter("x_requests_total", "Requests", ["route", "status"], registry=theirs)
    h1 = FastHistogram("x_latency_seconds", "Latency", ["route"], buckets=BUCKETS, registry=ours)
    h2 = Histogram("x_latency_seconds", "Latency", ["route"], buckets=BUCKETS, registry=theirs)
    rng = random.Random(7)
    for _ in range(500):
        route = rng.choice(["/a", "/b"])
        status = rng.choice(["200", "502"])
        amount = rng.choice([1, 2, 0.5])
        c1.labels(route, status).inc(amount)
        c2.labels(route, status).inc(amount)
        value = rng.choice([0.001, 0.0025, 0, 20.0, rng.random() / 10])  # bucket edges included
        h1.labels(route).observe(value)
        h2.labels(route).observe(value)
    assert _without_created(generate_latest(ours)) == _without_created(generate_latest(theirs))


def test_label_values_are_strings_and_counters_only_grow():
    r = CollectorRegistry()
    c = FastCounter("y_total", "y", ["status"], registry=r)
    c.labels(200).inc()
    c.labels("200").inc(2)
    assert c.labels(200) is c.labels("200")
    assert 'y_total{status="200"} 3.0' in generate_latest(r).decode()
    with pytest.raises(ValueError):
        c.labels("200").inc(-1)
    with pytest.raises(ValueError):
        c.labels("200", "extra")


def test_unlabelled_metrics_and_duplicate_names():
    r = CollectorRegistry()
    c = FastCounter("z_total", "z", registry=r)
    h = FastHistogram("z_seconds", "z", buckets=(1,), registry=r)
    c.inc()
    h.observe(2)
    text = generate_latest(r).decode()
    assert "z_total 1.0" in text and 'z_seconds_bucket{le="+Inf"} 1.0' in text and "z_seconds_sum 2.0" in text
    with pytest.raises(ValueError):
        FastCounter("z_total", "again", registry=r)
    with pytest.raises(ValueError):
        FastHistogram("w_seconds", "w", buckets=())
