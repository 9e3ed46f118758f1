"""The compose-file model of ``kvgate up``: reading ``compose.yaml`` and mapping its ports.

``load_compose`` reads and interpolates the ``services`` (``${VAR}``, ``${VAR:-default}``, ``$$``
as compose does); the small accessors below read one service's command, environment, ports and
dependencies; ``select_services`` and ``start_order`` pick and order what runs; :class:`PortMap`
gives every (service, container port) pair a local port and rewrites addresses to it, by the
rules in :mod:`gateway.up`'s module doc.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError

DEFAULT_BASE_PORT = 18000
LOOPBACK = "127.0.0.1"

# ------------------------------------------------------------------------------ the compose file

_VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's variable substitution: ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-d}``, ``${VAR-d}``."""

    def sub(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        op, default = m.group(3), m.group(4) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return _VAR.sub(sub, value)


def _interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_tree(v, env) for v in node]
    if isinstance(node, dict):
        return {k: _interpolate_tree(v, env) for k, v in node.items()}
    return node


def load_compose(path: str | Path, env: Mapping[str, str] | None = None) -> dict[str, dict]:
    """The interpolated ``services`` mapping of a compose file (merge keys resolved by YAML)."""
    env = os.environ if env is None else env
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read compose file {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"compose file {path} is not valid YAML: {exc}") from exc
    services = data.get("services") if isinstance(data, dict) else None
    if not isinstance(services, dict) or not services:
        raise ConfigError(f"compose file {path} has no services")
    out: dict[str, dict] = {}
    for name, svc in services.items():
        if not isinstance(svc, dict):
            raise ConfigError(f"{path}: service {name!r} must be a mapping")
        out[str(name)] = _interpolate_tree(svc, env)
    return out


def command_argv(svc: Mapping) -> list[str]:
    cmd = svc.get("command")
    if cmd is None:
        return []
    if isinstance(cmd, str):
        return shlex.split(cmd)
    return [str(c) for c in cmd]


def environment(svc: Mapping) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        pairs = (item.partition("=") for item in env)
        return {k: v for k, _, v in pairs}
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def container_ports(svc: Mapping) -> list[int]:
    """Ports the service listens on in its container: ``expose:`` then ``ports:`` (container side)."""
    found: list[int] = []
    for item in svc.get("expose") or []:
        found.append(int(str(item).split("/")[0]))
    for item in svc.get("ports") or []:
        if isinstance(item, dict):
            found.append(int(item["target"]))
        else:
            found.append(int(str(item).split("/")[0].rsplit(":", 1)[-1]))
    return list(dict.fromkeys(found))


def depends_on(svc: Mapping) -> dict[str, str]:
    """``{dependency: condition}`` (short syntax: ``service_started``)."""
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        return {str(d): "service_started" for d in deps}
    return {str(d): str((c or {}).get("condition", "service_started")) for d, c in deps.items()}


def select_services(
    services: Mapping[str, Mapping], profiles: Sequence[str] = (), only: Sequence[str] = ()
) -> list[str]:
    """Services to run, in file order: active profiles, or ``only`` plus their dependencies."""
    active = set(profiles)
    if only:
        unknown = sorted(set(only) - set(services))
        if unknown:
            raise ConfigError(f"no such service(s): {unknown}")
        chosen: set[str] = set()
        todo = list(only)
        while todo:
            name = todo.pop()
            if name not in chosen:
                chosen.add(name)
                todo.extend(d for d in depends_on(services[name]) if d in services)
        return [n for n in services if n in chosen]
    return [n for n, s in services.items() if not s.get("profiles") or active & set(s["profiles"])]


def start_order(names: Sequence[str], services: Mapping[str, Mapping]) -> list[str]:
    """``names`` ordered so that dependencies come first (stable in file order)."""
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise ConfigError(f"depends_on cycle: {' -> '.join((*path, name))}")
        state[name] = "visiting"
        for dep in depends_on(services[name]):
            if dep not in services:
                raise ConfigError(f"service {name!r} depends on unknown service {dep!r}")
            if dep in names:
                visit(dep, (*path, name))
        state[name] = "done"
        order.append(name)

    for n in names:
        visit(n, ())
    return order


# ------------------------------------------------------------------------------ port mapping


@dataclass(frozen=True)
class PortMap:
    """Container ``(service, port)`` -> local port, and the rewriting of addresses (gateway.up's doc)."""

    ports: Mapping[tuple[str, int], int]

    @classmethod
    def build(cls, services: Mapping[str, Mapping], base: int = DEFAULT_BASE_PORT) -> PortMap:
        pairs = [(name, p) for name, svc in services.items() for p in container_ports(svc)]
        if base + len(pairs) > 65535:
            raise ConfigError(f"--base-port {base} leaves no room for {len(pairs)} ports")
        return cls({pair: base + i for i, pair in enumerate(pairs)})

    def local(self, service: str, port: int) -> int:
        try:
            return self.ports[(service, port)]
        except KeyError:
            raise ConfigError(f"service {service!r} declares no port {port} (expose: or ports:)") from None

    def own_ports(self, service: str) -> list[int]:
        return [p for (s, p) in self.ports if s == service]

    def url(self, service: str, scheme: str = "http") -> str:
        """Local URL of the service's first port."""
        return f"{scheme}://{LOOPBACK}:{self.local(service, self.own_ports(service)[0])}"

    def rewrite(self, text: str, service: str) -> str:
        names = sorted({s for s, _ in self.ports}, key=len, reverse=True)
        hosts = "|".join([*(re.escape(n) for n in names), r"localhost", r"127\.0\.0\.1", r"0\.0\.0\.0"])
        pattern = re.compile(rf"(?<![\w.-])({hosts}):(\d+)(?!\d)")

        def sub(m: re.Match) -> str:
            host, port = m.group(1), int(m.group(2))
            owner = service if host in ("localhost", "127.0.0.1", "0.0.0.0") else host
            local = self.ports.get((owner, port))
            return f"{LOOPBACK}:{local}" if local is not None else m.group(0)

        text = pattern.sub(sub, text)
        return re.sub(r"(?<![\d.])0\.0\.0\.0(?![\d.])", LOOPBACK, text)

    def rewrite_argv(self, argv: Sequence[str], service: str) -> list[str]:
        own = set(self.own_ports(service))
        out: list[str] = []
        for i, arg in enumerate(argv):
            m = re.fullmatch(r"--port=(\d+)", arg)
            if m and int(m.group(1)) in own:
                arg = f"--port={self.ports[(service, int(m.group(1)))]}"
            elif i and argv[i - 1] == "--port" and arg.isdigit() and int(arg) in own:
                arg = str(self.ports[(service, int(arg))])
            out.append(self.rewrite(arg, service))
        return out

    def rewrite_env(self, env: Mapping[str, str], service: str) -> dict[str, str]:
        own = set(self.own_ports(service))
        out = {}
        for key, value in env.items():
            if key.upper().endswith("PORT") and value.isdigit() and int(value) in own:
                out[key] = str(self.ports[(service, int(value))])
            else:
                out[key] = self.rewrite(value, service)
        return out

    def rewrite_nginx(self, text: str, service: str) -> str:
        own = set(self.own_ports(service))

        def listen(m: re.Match) -> str:
            port = int(m.group(2))
            if port not in own:
                return m.group(0)
            return f"{m.group(1)}{LOOPBACK}:{self.ports[(service, port)]}"

        text = re.sub(r"(?m)^(\s*listen\s+)(?:\S+:)?(\d+)\b", listen, text)
        return self.rewrite(text, service)

