"""``kvgate up``: run the services of ``compose.yaml`` as local processes, without Docker.

The compose file is the one definition of the stack; this runs it here so tests (and anyone
without a Docker engine) start exactly the topology that ``docker compose up`` starts.

What runs
  * a service whose ``command`` starts with ``kvgate`` runs as ``python -m gateway.cli ...``
    with the service's ``environment`` (the caller's ``KVGATE_*`` variables are not inherited,
    as a container would not inherit them);
  * an image ``redis*`` runs the local ``redis-server`` with the service's command;
  * an image ``nginx*`` runs the local ``nginx`` with the config file mounted into
    ``/etc/nginx/conf.d/``;
  * an image ``*prometheus*`` runs the local ``prometheus`` with the mounted ``prometheus.yml``;
  * anything else (grafana, locust, ...) needs its image: it is skipped, and said so, as are the
    three above when their program is not installed.
  Services of a profile run only with ``--profile NAME``; ``--services A B`` runs those and what
  they depend on. ``${VAR}``, ``${VAR:-default}`` and ``$$`` are interpolated as compose does.

Port mapping (:class:`PortMap`)
  Every (service, container port) pair the file declares (``expose:`` and the container side of
  ``ports:``), taken in the file's order of services and then ports, gets the local port
  ``BASE + i`` (``--base-port``, default 18000), whether or not that service runs, so a port
  never moves when the selection changes. In each command argument, environment value,
  healthcheck and mounted config file:
  * ``NAME:PORT`` of any service                     -> ``127.0.0.1:LOCAL``
  * ``localhost|127.0.0.1|0.0.0.0:PORT`` of the service itself -> ``127.0.0.1:LOCAL``
  * ``--port PORT``, ``--port=PORT``, ``*PORT=PORT`` (env) and nginx ``listen PORT`` of the
    service itself -> ``LOCAL``
  * any other ``0.0.0.0`` -> ``127.0.0.1`` (local processes listen on loopback only).
  So the file must spell service addresses as ``name:port`` in full.

Order and health
  Services start in ``depends_on`` order; one waits for each dependency it declares with
  ``condition: service_healthy`` to pass its healthcheck, polled locally: a ``python -c`` check
  runs as is (rewritten), a check naming an ``http://`` URL has that URL fetched (2xx), a redis
  service must answer PING, anything else must accept a TCP connection. When every service is
  healthy the URLs are printed. Ctrl-C or SIGTERM stops the services in reverse dependency order
  (each gets SIGKILL after 10 s, as with ``docker compose stop``); a service that exits on its own
  stops the rest (exit status 1).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from .errors import ConfigError

DEFAULT_FILE = "compose.yaml"
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
    """Container ``(service, port)`` -> local port, and the rewriting of addresses (module doc)."""

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


# ------------------------------------------------------------------------------ health probes

Probe = Callable[[], bool]


def http_probe(url: str) -> Probe:
    def probe() -> bool:
        try:
            return httpx.get(url, timeout=2.0).is_success
        except httpx.HTTPError:
            return False

    return probe


def command_probe(argv: Sequence[str], env: Mapping[str, str]) -> Probe:
    def probe() -> bool:
        try:
            done = subprocess.run(list(argv), env=dict(env), capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0

    return probe


def tcp_probe(port: int, payload: bytes = b"", expect: bytes = b"") -> Probe:
    def probe() -> bool:
        try:
            with socket.create_connection((LOOPBACK, port), timeout=2.0) as s:
                if payload:
                    s.sendall(payload)
                    return s.recv(64).startswith(expect)
                return True
        except OSError:
            return False

    return probe


def healthcheck_probe(
    svc: Mapping, service: str, kind: str, ports: PortMap, env: Mapping[str, str]
) -> tuple[Probe, str]:
    """A local probe equivalent to the service's healthcheck, and a description of it."""
    test = (svc.get("healthcheck") or {}).get("test") or []
    if isinstance(test, str):
        test = ["CMD-SHELL", test]
    argv = [str(t) for t in test[1:]] if test and test[0] in ("CMD", "CMD-SHELL") else []
    if test and test[0] == "CMD-SHELL":
        argv = shlex.split(" ".join(argv))
    own = ports.own_ports(service)
    if argv and Path(argv[0]).name in ("python", "python3"):
        local = [sys.executable, *ports.rewrite_argv(argv[1:], service)]
        return command_probe(local, env), "python healthcheck"
    url = next((a for a in argv if a.startswith(("http://", "https://"))), None)
    if url:
        local_url = ports.rewrite(url, service)
        return http_probe(local_url), f"GET {local_url}"
    if not own:
        raise ConfigError(f"service {service!r} has no healthcheck URL and no port to probe")
    port = ports.local(service, own[0])
    if kind == "redis":
        return tcp_probe(port, b"PING\r\n", b"+PONG"), "redis PING"
    return tcp_probe(port), f"TCP {LOOPBACK}:{port}"


# ------------------------------------------------------------------------------ local services


@dataclass
class LocalService:
    name: str
    kind: str  # kvgate | redis | nginx | prometheus | skipped
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    probe: Probe | None = None
    probe_text: str = ""
    reason: str = ""  # why it is skipped
    stop_signal: int = signal.SIGTERM
    proc: subprocess.Popen | None = None
    healthy: bool = False


def _which(program: str) -> str | None:
    return shutil.which(program) or shutil.which(program, path="/usr/sbin:/usr/local/sbin:/sbin")


def _mounted_file(svc: Mapping, compose_dir: Path, target_prefix: str) -> Path | None:
    for vol in svc.get("volumes") or []:
        if isinstance(vol, dict):
            source, target = vol.get("source", ""), vol.get("target", "")
        else:
            source, _, rest = str(vol).partition(":")
            target = rest.split(":")[0]
        if target.startswith(target_prefix) and source.startswith((".", "/")):
            path = (compose_dir / source).resolve()
            if path.is_file():
                return path
    return None


def child_env(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in base.items() if not k.startswith("KVGATE_")}
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def plan_service(
    name: str, svc: Mapping, ports: PortMap, compose_dir: Path, workdir: Path,
    base_env: Mapping[str, str],
) -> LocalService:
    """How ``name`` runs here (or why it does not); writes rewritten config files under ``workdir``."""
    image = str(svc.get("image", ""))
    argv = command_argv(svc)
    svc_env = ports.rewrite_env(environment(svc), name)
    own = ports.own_ports(name)
    image_name = image.rsplit("/", 1)[-1].split(":")[0]
    env = child_env(base_env, svc_env)

    if argv[:1] == ["kvgate"]:
        local = LocalService(name, "kvgate", [sys.executable, "-m", "gateway.cli", *ports.rewrite_argv(argv[1:], name)],
                             env, stop_signal=signal.SIGINT)
    elif image_name.startswith("redis"):
        program = _which("redis-server")
        if not program:
            return LocalService(name, "skipped", reason="redis-server is not installed")
        args = argv[1:] if argv[:1] == ["redis-server"] else []
        port = ports.local(name, own[0] if own else 6379)
        data = workdir / name
        data.mkdir(parents=True, exist_ok=True)
        local = LocalService(name, "redis", [program, *args, "--port", str(port), "--bind", LOOPBACK,
                                             "--dir", str(data)], env)
    elif image_name.startswith("nginx"):
        program = _which("nginx")
        conf = _mounted_file(svc, compose_dir, "/etc/nginx/conf.d/")
        if not program or not conf:
            why = "nginx is not installed" if not program else "no config mounted into /etc/nginx/conf.d/"
            return LocalService(name, "skipped", reason=why)
        local = LocalService(name, "nginx", _nginx_argv(program, conf, name, ports, workdir), env,
                             stop_signal=signal.SIGQUIT)
    elif "prometheus" in image_name:
        program = _which("prometheus")
        conf = _mounted_file(svc, compose_dir, "/etc/prometheus/")
        if not program or not conf or not own:
            why = "prometheus is not installed" if not program else "no prometheus.yml mounted"
            return LocalService(name, "skipped", reason=why)
        local = LocalService(name, "prometheus", _prometheus_argv(program, conf, name, ports, workdir), env)
    else:
        what = f"image {image}" if image else "an image"
        return LocalService(name, "skipped", reason=f"needs {what} (no local equivalent)")
    local.probe, local.probe_text = healthcheck_probe(svc, name, local.kind, ports, env)
    return local


def _nginx_argv(program: str, conf: Path, name: str, ports: PortMap, workdir: Path) -> list[str]:
    root = workdir / name
    (root / "conf.d").mkdir(parents=True, exist_ok=True)
    # nginx's workers may run as another user (when started as root): let them reach their files.
    for d in (workdir, root):
        d.chmod(0o755)
    site = root / "conf.d" / conf.name
    site.write_text(ports.rewrite_nginx(conf.read_text(encoding="utf-8"), name), encoding="utf-8")
    temp = "\n".join(
        f"  {kind}_temp_path {root / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    main = root / "nginx.conf"
    main.write_text(
        f"daemon off;\nworker_processes 1;\npid {root / 'nginx.pid'};\nerror_log stderr warn;\n"
        f"events {{ worker_connections 1024; }}\n"
        f"http {{\n  access_log off;\n{temp}\n  include {site};\n}}\n",
        encoding="utf-8",
    )
    return [program, "-e", "stderr", "-p", str(root), "-c", str(main)]


def _prometheus_argv(program: str, conf: Path, name: str, ports: PortMap, workdir: Path) -> list[str]:
    root = workdir / name
    root.mkdir(parents=True, exist_ok=True)
    local_conf = root / "prometheus.yml"
    local_conf.write_text(ports.rewrite(conf.read_text(encoding="utf-8"), name), encoding="utf-8")
    port = ports.local(name, ports.own_ports(name)[0])
    return [
        program, f"--config.file={local_conf}", f"--storage.tsdb.path={root / 'data'}",
        f"--web.listen-address={LOOPBACK}:{port}", "--log.level=warn",
    ]


# ------------------------------------------------------------------------------ running


class Stack:
    """The planned services, started in order and stopped in reverse."""

    def __init__(self, services: Mapping[str, Mapping], plans: Mapping[str, LocalService],
                 order: Sequence[str], out=None) -> None:
        self.services = services
        self.plans = plans
        self.order = list(order)
        self.started: list[LocalService] = []
        self.out = out or sys.stdout
        self._lock = threading.Lock()
        self.width = max((len(n) for n in order), default=8)

    def say(self, line: str) -> None:
        with self._lock:
            self.out.write(line + "\n")
            self.out.flush()

    def _pump(self, svc: LocalService) -> None:
        assert svc.proc is not None and svc.proc.stdout is not None
        for raw in svc.proc.stdout:
            self.say(f"{svc.name:<{self.width}} | {raw.rstrip()}")

    def start(self, stop: threading.Event, timeout: float) -> None:
        """Start every service after its dependencies; raises RuntimeError on a failure."""
        for name in self.order:
            svc = self.plans[name]
            if svc.kind == "skipped":
                continue
            for dep, cond in depends_on(self.services[name]).items():
                dep_plan = self.plans.get(dep)
                if dep_plan is None or dep_plan.kind == "skipped":
                    self.say(f"kvgate up: {name} depends on {dep}, which does not run here")
                elif cond == "service_healthy":
                    self.wait_healthy(dep_plan, stop, timeout)
            if stop.is_set():
                return
            svc.proc = subprocess.Popen(
                svc.argv, env=svc.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True,  # Ctrl-C reaches `kvgate up` only; it stops them in order
            )
            self.started.append(svc)
            threading.Thread(target=self._pump, args=(svc,), daemon=True).start()
        for svc in self.started:
            self.wait_healthy(svc, stop, timeout)

    def wait_healthy(self, svc: LocalService, stop: threading.Event, timeout: float) -> None:
        """Poll the service's healthcheck until it passes (start-up readiness, not ordering)."""
        deadline = time.monotonic() + timeout
        while not svc.healthy and not stop.is_set():
            assert svc.proc is not None and svc.probe is not None
            if svc.proc.poll() is not None:
                raise RuntimeError(f"{svc.name} exited with status {svc.proc.returncode} before it was healthy")
            if svc.probe():
                svc.healthy = True
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{svc.name} not healthy after {timeout:.0f}s ({svc.probe_text})")
            stop.wait(0.2)

    def exited(self) -> LocalService | None:
        return next((s for s in self.started if s.proc is not None and s.proc.poll() is not None), None)

    def stop(self, grace: float = 10.0) -> None:
        """Stop dependents before their dependencies (entry point, gateways, then replicas and
        redis): each level of services gets its stop signal together, then SIGKILL after ``grace``
        seconds (as ``docker compose stop`` does)."""
        depth: dict[str, int] = {}
        for svc in self.started:  # started in dependency order: dependencies already have a depth
            deps = [depth[d] for d in depends_on(self.services[svc.name]) if d in depth]
            depth[svc.name] = 1 + max(deps, default=-1)
        for level in sorted(set(depth.values()), reverse=True):
            batch = [s for s in self.started if depth[s.name] == level and s.proc and s.proc.poll() is None]
            for svc in batch:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(svc.proc.pid, svc.stop_signal)
            deadline = time.monotonic() + grace
            for svc in batch:
                try:
                    svc.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.say(f"kvgate up: {svc.name} did not stop in {grace:.0f}s: killing it")
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(svc.proc.pid, signal.SIGKILL)
                    svc.proc.wait()


def summary(stack: Stack, ports: PortMap, services: Mapping[str, Mapping], compose_file: str) -> str:
    lines = [f"kvgate up is ready: {compose_file} as local processes"]
    entry = None
    for name in stack.order:
        plan = stack.plans[name]
        if plan.kind == "skipped":
            lines.append(f"  {name:<{stack.width}}  skipped: {plan.reason}")
            continue
        own = ports.own_ports(name)
        scheme = "redis" if plan.kind == "redis" else "http"
        addr = ports.url(name, scheme) if own else "(no port)"
        published = [str(p) for p in services[name].get("ports") or []]
        mapped = ", ".join(f"{name}:{p}" for p in own)
        extra = f"; published {', '.join(published)} by compose" if published else ""
        lines.append(f"  {name:<{stack.width}}  {addr:<26} ({mapped}{extra})")
        is_gateway = plan.kind == "kvgate" and plan.argv[3:4] == ["serve"]
        if own and (plan.kind == "nginx" or is_gateway) and (entry is None or (published and not entry[1])):
            entry = (ports.url(name), bool(published))
    if entry:
        lines.append(f"OpenAI base URL: {entry[0]}/v1    metrics: {entry[0]}/metrics    stop: Ctrl-C")
    return "\n".join(lines)


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--file", "-f", default=DEFAULT_FILE, help="compose file (default compose.yaml)")
    parser.add_argument("--services", nargs="+", default=[], metavar="NAME",
                        help="run only these services (and what they depend on)")
    parser.add_argument("--profile", action="append", default=[], metavar="NAME",
                        help="also run the services of this compose profile (repeatable)")
    parser.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT,
                        help="first local port of the mapping (default 18000)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds each service may take to become healthy (default 60)")


def run_up(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    compose_path = Path(args.file).resolve()
    services = load_compose(compose_path)
    ports = PortMap.build(services, args.base_port)
    names = start_order(select_services(services, args.profile, args.services), services)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    with tempfile.TemporaryDirectory(prefix="kvgate-up-") as tmp:
        plans = {
            n: plan_service(n, services[n], ports, compose_path.parent, Path(tmp), os.environ)
            for n in names
        }
        stack = Stack(services, plans, names, out)
        status = 0
        try:
            stack.start(stop, args.timeout)
            if not stop.is_set():
                stack.say(summary(stack, ports, services, args.file))
            while not stop.is_set():
                dead = stack.exited()
                if dead is not None:
                    stack.say(f"kvgate up: {dead.name} exited with status {dead.proc.returncode}: stopping")
                    status = 1
                    break
                stop.wait(0.5)
        except RuntimeError as exc:
            stack.say(f"kvgate up: {exc}")
            status = 1
        finally:
            stack.say("kvgate up: stopping")
            stack.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    stack.say("kvgate up stopped")
    return status
