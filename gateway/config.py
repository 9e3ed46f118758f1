"""Gateway configuration: defaults < YAML file < ``KVGATE_*`` environment < command line.

Everything is validated here, at start-up; the request path never sees a bad setting.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from .errors import ConfigError


@dataclass(frozen=True)
class ReplicaConfig:
    url: str
    models: tuple[str, ...] = ()  # empty: discovered from the replica's /v1/models
    id: str = ""

    def __post_init__(self) -> None:
        url = self.url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"replica url must start with http:// or https://: {self.url!r}")
        object.__setattr__(self, "url", url)
        if not self.id:
            object.__setattr__(self, "id", url.split("://", 1)[1])


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    replicas: tuple[ReplicaConfig, ...] = ()
    policy: str = "cache_aware"
    policy_params: Mapping[str, Any] = field(default_factory=dict)
    log_level: str = "info"
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    session_header: str = "x-session-id"
    chunk_bytes: int = 256
    max_body_bytes: int = 32 * 1024 * 1024
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 300.0  # longest silence allowed from a replica, also mid-stream
    max_retries: int = 2
    retry_backoff_s: float = 0.02
    health_interval_s: float = 2.0
    eject_after_failures: int = 3
    shutdown_grace_s: float = 15.0
    max_connections_per_replica: int = 256  # idle keep-alive connections kept per replica
    upstream_client: str = "fast"  # fast (asyncio + httptools, gateway/fastclient.py) | httpx
    max_in_flight: int = 0  # requests in flight at once, gateway-wide; over it: 429; 0 = no limit
    http_server: str = "fast"  # fast (asyncio + httptools, gateway/httpserver.py) | uvicorn
    admin_token: str = ""  # empty: admin changes only from loopback clients
    redis_url: str = ""  # empty: embedded in-memory state; redis://host:port/db shares it
    gateway_id: str = ""  # identity in shared state; empty: host:port plus a random suffix

    def validate(self) -> GatewayConfig:
        if not 0 < self.port < 65536:
            raise ConfigError(f"port out of range: {self.port}")
        if self.chunk_bytes < 16:
            raise ConfigError("chunk_bytes must be >= 16")
        if self.max_retries < 0 or self.eject_after_failures < 1:
            raise ConfigError("max_retries must be >= 0 and eject_after_failures >= 1")
        for name in ("connect_timeout_s", "read_timeout_s", "health_interval_s", "shutdown_grace_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.upstream_client not in ("fast", "httpx"):
            raise ConfigError(f"upstream_client must be 'fast' or 'httpx', not {self.upstream_client!r}")
        if self.http_server not in ("fast", "uvicorn"):
            raise ConfigError(f"http_server must be 'fast' or 'uvicorn', not {self.http_server!r}")
        if self.max_in_flight < 0:
            raise ConfigError("max_in_flight must be >= 0 (0: no limit)")
        if self.max_connections_per_replica < 1:
            raise ConfigError("max_connections_per_replica must be >= 1")
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ConfigError(f"unknown log level {self.log_level!r}")
        ids = [r.id for r in self.replicas]
        if len(ids) != len(set(ids)):
            raise ConfigError("replica ids must be unique")
        return self


def _replica(item: Any) -> ReplicaConfig:
    if isinstance(item, str):
        return ReplicaConfig(url=item)
    if isinstance(item, Mapping):
        unknown = set(item) - {"url", "models", "id"}
        if unknown or "url" not in item:
            raise ConfigError(f"replica entries need 'url' (and optional models, id): {item!r}")
        models = item.get("models") or ()
        if isinstance(models, str):
            models = (models,)
        return ReplicaConfig(url=str(item["url"]), models=tuple(models), id=str(item.get("id", "")))
    raise ConfigError(f"bad replica entry: {item!r}")


_FIELDS = {f.name: f for f in dataclasses.fields(GatewayConfig)}


def _coerce(name: str, value: Any) -> Any:
    if name == "replicas":
        if isinstance(value, str):
            value = [v for v in value.replace(" ", ",").split(",") if v]
        return tuple(_replica(v) for v in value)
    if name == "api_keys":
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        return tuple(str(v) for v in value)
    if name == "policy_params":
        if isinstance(value, str):
            value = yaml.safe_load(value) or {}
        if not isinstance(value, Mapping):
            raise ConfigError("policy_params must be a mapping")
        return dict(value)
    default = _FIELDS[name].default
    try:
        if isinstance(default, bool):
            return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: cannot use {value!r}") from exc
    return str(value)


def merge(base: GatewayConfig, values: Mapping[str, Any], source: str) -> GatewayConfig:
    unknown = set(values) - set(_FIELDS)
    if unknown:
        raise ConfigError(f"{source}: unknown setting(s) {sorted(unknown)}")
    changes = {k: _coerce(k, v) for k, v in values.items() if v is not None}
    return dataclasses.replace(base, **changes)


def from_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {path} must hold a mapping")
    return dict(data)


def from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _FIELDS:
        key = "KVGATE_" + name.upper()
        if key in env:
            out[name] = env[key]
    return out


def load_config(
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> GatewayConfig:
    """Build the validated config from a file, the environment and CLI overrides."""
    env = os.environ if env is None else env
    cfg = GatewayConfig()
    path = config_file or env.get("KVGATE_CONFIG")
    if path:
        cfg = merge(cfg, from_file(path), path)
    cfg = merge(cfg, from_env(env), "environment")
    if cli:
        cfg = merge(cfg, {k: v for k, v in cli.items() if v not in (None, [], ())}, "command line")
    return cfg.validate()
