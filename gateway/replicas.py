"""The replica pool: what the gateway knows of each replica, and snapshots for the policies."""

from __future__ import annotations

import re
from collections.abc import Iterable

from policies.types import ClusterView, ReplicaState

from .config import ReplicaConfig


class Replica:
    __slots__ = (
        "id", "url", "models", "static_models", "healthy", "draining", "in_flight",
        "running", "waiting", "kv_usage", "failures", "metrics_ok", "removing", "remote_in_flight",
        "others", "others_waiting", "_scraped_others", "_remote_at_scrape", "kv_tokens", "held",
        "pull_ms_per_token", "models_due",
    )

    def __init__(self, cfg: ReplicaConfig) -> None:
        self.id = cfg.id
        self.url = cfg.url
        self.models: frozenset[str] = frozenset(cfg.models)
        self.static_models = bool(cfg.models)
        self.models_due = 0  # health rounds until /v1/models is asked again (gateway.health)
        self.healthy = True  # optimistic until the first health check says otherwise
        self.draining = False
        self.in_flight = 0
        self.held = 0  # of in_flight: held at this gateway until a prefill they follow is done
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.failures = 0  # consecutive
        self.metrics_ok = False
        self.removing = False  # drained and removed from the pool once idle
        self.remote_in_flight = 0  # other gateways' in-flight here (shared state heartbeat)
        self.others = 0  # the engine's requests beyond the gateways' own, at the last scrape
        self.others_waiting = 0  # of which waiting for a slot
        self._scraped_others = 0  # ``others`` as the scrape computed it
        self._remote_at_scrape = 0  # ``remote_in_flight`` when it did
        self.kv_tokens = 0  # the engine's prefix-cache size in tokens, as it reports it (0: unknown)
        self.pull_ms_per_token = -1.0  # KV pulls from a peer, as it advertises them (< 0: none)

    def record_engine(self, running: int, waiting: int, kv_usage: float) -> None:
        """The engine's own counts, just scraped.  What the gateways sent is known exactly and
        now; the scrape is up to a health interval old.  So it only adds what the gateways did
        not send (other clients): those requests are taken to stay until the next scrape."""
        self.running, self.waiting, self.kv_usage = running, waiting, kv_usage
        self._scraped_others = max(0, running + waiting - self.in_flight - self.remote_in_flight)
        self._remote_at_scrape = self.remote_in_flight
        self._set_others(self._scraped_others)

    def set_remote(self, remote_in_flight: int) -> None:
        """Other gateways' in-flight here, from the shared state's heartbeat.  It lags: requests
        another gateway had running when we scraped may only show up now.  A rise since the
        scrape is taken to be those (the scrape counted them as other clients'), so it comes off
        ``others`` rather than being counted twice, and stays off when they finish; until the next
        scrape ``others`` only shrinks (new foreign requests show at that scrape)."""
        self.remote_in_flight = remote_in_flight
        rise = max(0, remote_in_flight - self._remote_at_scrape)
        self._set_others(min(self.others, max(0, self._scraped_others - rise)))

    def _set_others(self, others: int) -> None:
        self.others = others
        self.others_waiting = min(self.waiting, others)

    def state(self) -> ReplicaState:
        """The policies' snapshot: ``in_flight`` is cluster-wide (ours + other gateways'), and
        ``running`` + ``waiting`` add the engine's other requests to it (``record_engine``), so
        ``load`` counts every request the replica has now, not as of the last scrape."""
        sent = self.in_flight + self.remote_in_flight
        waiting = self.others_waiting
        return ReplicaState(  # positional: the fields' order (the cheapest call)
            self.id, self.url, self.healthy, sent, sent + self.others - waiting, waiting,
            self.kv_usage, self.models, self.draining, self.held, self.pull_ms_per_token,
        )

    def to_json(self) -> dict:
        return {
            "id": self.id, "url": self.url, "models": sorted(self.models),
            "healthy": self.healthy, "draining": self.draining, "in_flight": self.in_flight,
            "held": self.held, "running": self.running, "waiting": self.waiting,
            "kv_usage": self.kv_usage, "consecutive_failures": self.failures, "removing": self.removing,
            "remote_in_flight": self.remote_in_flight,
            "kv_pull_ms_per_token": self.pull_ms_per_token if self.pull_ms_per_token >= 0 else None,
        }


class ReplicaPool:
    """Mutable pool state owned by the gateway's event loop (single-threaded, no locks)."""

    def __init__(self, configs: Iterable[ReplicaConfig], eject_after_failures: int = 3) -> None:
        self._replicas: dict[str, Replica] = {}
        self.eject_after = eject_after_failures
        for cfg in configs:
            self.add(cfg)

    def __iter__(self):
        return iter(list(self._replicas.values()))

    def __len__(self) -> int:
        return len(self._replicas)

    def get(self, replica_id: str) -> Replica | None:
        return self._replicas.get(replica_id)

    def add(self, cfg: ReplicaConfig) -> Replica:
        if cfg.id in self._replicas:
            raise ValueError(f"replica {cfg.id!r} already in the pool")
        rep = Replica(cfg)
        self._replicas[cfg.id] = rep
        return rep

    def remove(self, replica_id: str) -> Replica | None:
        return self._replicas.pop(replica_id, None)

    def snapshot(self, now: float = 0.0) -> ClusterView:
        return ClusterView(tuple(r.state() for r in self._replicas.values()), now)

    def models(self) -> dict[str, list[Replica]]:
        """Model name -> healthy, non-draining replicas serving it."""
        out: dict[str, list[Replica]] = {}
        for rep in self._replicas.values():
            if rep.healthy and not rep.draining:
                for m in rep.models:
                    out.setdefault(m, []).append(rep)
        return out

    def knows_model(self, model: str) -> bool:
        """True when some replica (healthy or not) lists ``model``, or lists nothing yet."""
        return any(not r.models or model in r.models for r in self._replicas.values())

    def set_remote_in_flight(self, totals: dict[str, int]) -> None:
        """Other gateways' in-flight per replica (replicas absent from ``totals`` get 0)."""
        for rep in self._replicas.values():
            rep.set_remote(max(0, int(totals.get(rep.id, 0))))

    # --- request accounting -------------------------------------------------------------
    def begin(self, replica_id: str, held: bool = False) -> None:
        """A request is on its way to ``replica_id`` (``held``: at the gateway for now)."""
        rep = self._replicas.get(replica_id)
        if rep is not None:
            rep.in_flight += 1
            rep.held += held

    def release(self, replica_id: str) -> None:
        """A request held for ``replica_id`` is sent, or given up (``end`` follows then)."""
        rep = self._replicas.get(replica_id)
        if rep is not None and rep.held > 0:
            rep.held -= 1

    def end(self, replica_id: str) -> None:
        rep = self._replicas.get(replica_id)
        if rep is not None and rep.in_flight > 0:
            rep.in_flight -= 1
            if rep.removing and rep.in_flight == 0:
                self._replicas.pop(replica_id, None)

    def drain(self, replica_id: str, draining: bool = True) -> Replica | None:
        rep = self._replicas.get(replica_id)
        if rep is not None:
            rep.draining = draining
        return rep

    def retire(self, replica_id: str) -> bool | None:
        """Drain and remove once idle.  True: removed now; False: pending; None: unknown id."""
        rep = self._replicas.get(replica_id)
        if rep is None:
            return None
        if rep.in_flight == 0:
            del self._replicas[replica_id]
            return True
        rep.draining = rep.removing = True
        return False

    def record_success(self, replica_id: str) -> None:
        rep = self._replicas.get(replica_id)
        if rep is not None:
            rep.failures = 0
            rep.healthy = True

    def record_failure(self, replica_id: str) -> bool:
        """Count a failure; eject (mark unhealthy) after N in a row.  Returns True on ejection."""
        rep = self._replicas.get(replica_id)
        if rep is None:
            return False
        rep.failures += 1
        if rep.failures >= self.eject_after and rep.healthy:
            rep.healthy = False
            return True
        return False


_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # older vLLM name
}


_CACHE_INFO = "vllm:cache_config_info"
PULL_INFO = "kvgate:kv_pull_info"  # an engine that can pull a prefix's KV from a peer says so
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _samples(text: str, name: str):
    """(labels, value) of each sample of metric ``name`` in Prometheus ``text``: found with
    ``str.find`` (in C) rather than line by line in Python, since a real vLLM /metrics is ~45 KB,
    ~540 lines, nearly all of them histogram buckets (line by line: 1.5 ms of the event loop per
    replica per health round; this: ~0.1 ms)."""
    start = text.find(name)
    while start >= 0:
        nxt = text.find(name, start + 1)
        if start == 0 or text[start - 1] == "\n":
            end = text.find("\n", start)
            rest = text[start + len(name) : end if end >= 0 else len(text)]
            labels = ""
            if rest.startswith("{"):
                close = rest.rfind("}")
                labels, rest = rest[: close + 1], rest[close + 1 :]
            if rest[:1] in (" ", "\t"):
                parts = rest.split()
                if parts:
                    yield labels, parts[0]
        start = nxt


def parse_engine_metrics(text: str) -> dict[str, float]:
    """Sum the load gauges an engine exposes in Prometheus text (vLLM names), and its KV-cache
    size in tokens (``kv_tokens``: ``block_size`` x ``num_gpu_blocks`` from the labels of
    ``vllm:cache_config_info``, summed over engines; absent when it does not say, or has prefix
    caching off).  ``pull_ms_per_token``: what its pulls of KV from a peer cost (``kvgate:kv_pull_info``,
    labels ``kv_bytes_per_token`` and ``link_gbps``; the slowest of its engines); absent when it
    advertises none."""
    out: dict[str, float] = {}
    for name, key in _GAUGES.items():
        for _, value in _samples(text, name):
            try:
                out[key] = out.get(key, 0.0) + float(value)
            except ValueError:
                continue
    for labels, _ in _samples(text, _CACHE_INFO):
        tokens = _cache_tokens(labels)
        if tokens:
            out["kv_tokens"] = out.get("kv_tokens", 0.0) + tokens
    for labels, value in _samples(text, PULL_INFO):
        ms = _pull_ms_per_token(labels, value)
        if ms >= 0:
            out["pull_ms_per_token"] = max(ms, out.get("pull_ms_per_token", 0.0))
    return out


def _cache_tokens(label_text: str) -> int:
    """``block_size`` x ``num_gpu_blocks`` from a ``cache_config_info`` sample's labels (0 if
    either is missing or prefix caching is off)."""
    labels = dict(_LABEL.findall(label_text))
    if labels.get("enable_prefix_caching") == "False":
        return 0
    try:
        return int(labels["block_size"]) * int(labels["num_gpu_blocks"])
    except (KeyError, ValueError):
        return 0


def _pull_ms_per_token(label_text: str, sample: str) -> float:
    """ms to move one token's KV over the advertised link: ``kv_bytes_per_token`` x 8 bits over
    ``link_gbps``; -1 when a label is missing or not positive, or the sample's value is 0."""
    labels = dict(_LABEL.findall(label_text))
    try:
        value = float(sample)
        per_token = float(labels["kv_bytes_per_token"])
        gbps = float(labels["link_gbps"])
    except (KeyError, ValueError):
        return -1.0
    if value <= 0 or per_token <= 0 or gbps <= 0:
        return -1.0
    return per_token * 8 / (gbps * 1e6)
