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
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .compose import (  # noqa: F401  (re-exported: tests and callers import them from here)
    DEFAULT_BASE_PORT,
    LOOPBACK,
    PortMap,
    command_argv,
    container_ports,
    depends_on,
    environment,
    interpolate,
    load_compose,
    select_services,
    start_order,
)
from .probes import (  # noqa: F401  (re-exported)
    Probe,
    command_probe,
    healthcheck_probe,
    http_probe,
    tcp_probe,
)

DEFAULT_FILE = "compose.yaml"

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
