"""Lock-free Prometheus counters and histograms for the request path.

``prometheus_client``'s metrics take a ``threading.Lock`` on every ``inc``/``observe`` (a histogram
observation takes two) and check observability on each call: about 8 us of the gateway's per-request
CPU went there.  The gateway updates its request metrics from one thread, the event loop, so these
keep plain Python numbers instead, and expose them through a collector registered in the same
registry, with the same names, labels, buckets and text format (``*_total``; ``*_bucket``,
``*_count``, ``*_sum``), minus the optional ``*_created`` series.

API subset: ``FastCounter(name, doc, labelnames, registry=r).labels(*values).inc(amount=1)`` and
``FastHistogram(name, doc, labelnames, buckets=..., registry=r).labels(*values).observe(v)``.
Not thread-safe: update from one thread (collection may run in another: it only reads).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import INF, floatToGoString


class _CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class _HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds  # upper bounds without +Inf
        self.counts = [0] * (len(bounds) + 1)  # the last one counts values above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le semantics: value <= bound
        self.sum += value


class _Family:
    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = (),
                 registry: CollectorRegistry | None = None) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        if not self.labelnames:
            self._children[()] = self._new_child()
        if registry is not None:
            registry.register(self)

    def _new_child(self):
        raise NotImplementedError

    def labels(self, *values: str):
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            key = tuple(str(v) for v in values)
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = self._new_child()
            self._children[values] = child
        return child

    def _items(self) -> list[tuple[tuple[str, ...], object]]:
        seen: set[int] = set()
        out = []
        for key, child in list(self._children.items()):
            if id(child) not in seen and all(isinstance(k, str) for k in key):
                seen.add(id(child))
                out.append((key, child))
        return out

    def describe(self):
        return [self._family()]

    def _family(self):
        raise NotImplementedError


class FastCounter(_Family):
    kind = "counter"

    def _new_child(self) -> _CounterChild:
        return _CounterChild()

    def inc(self, amount: float = 1) -> None:
        self._children[()].inc(amount)

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self):
        fam = self._family()
        for key, child in self._items():
            fam.add_metric(list(key), child.value)
        return [fam]


class FastHistogram(_Family):
    kind = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = (),
                 registry: CollectorRegistry | None = None, buckets: Sequence[float] = ()) -> None:
        bounds = sorted(float(b) for b in buckets if b != INF)
        if not bounds:
            raise ValueError("a histogram needs at least one finite bucket")
        self.bounds = tuple(bounds)
        self._les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(self.bounds)

    def observe(self, value: float) -> None:
        self._children[()].observe(value)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self):
        fam = self._family()
        for key, child in self._items():
            total = 0
            buckets = []
            for le, n in zip(self._les, list(child.counts), strict=True):
                total += n
                buckets.append((le, total))
            fam.add_metric(list(key), buckets, child.sum)
        return [fam]


# ---------------------------------------------------------------------------- request-path helpers
class Children:
    """A metric's label children, looked up in the metric once per label set."""

    __slots__ = ("metric", "cache")

    def __init__(self, metric) -> None:
        self.metric = metric
        self.cache: dict[tuple, object] = {}

    def get(self, *labels: str):
        child = self.cache.get(labels)
        if child is None:
            child = self.cache[labels] = self.metric.labels(*labels)
        return child


_STATUS_LABELS: dict[int, str] = {}


def status_label(status: int) -> str:
    """``str(status)``, made once per status."""
    label = _STATUS_LABELS.get(status)
    if label is None:
        label = _STATUS_LABELS[status] = str(status)
    return label
