"""Peer proxies and routers as benchmark subprocesses: nginx, sglang-router, vllm-router, kvgate.

Each ``*_proc`` function returns a :class:`~gateway.bench.procs.Proc` (start it, stop it) whose
ready URL is ``/health`` on the given port.  :func:`tree_cpu_seconds` reads the CPU time a process
and its descendants have used (nginx's workers are children of its master).

The Rust routers come from PyPI (``pip install sglang-router vllm-router``); :func:`find_peer`
looks next to this interpreter, on ``PATH``, and in the folders of ``$KVGATE_PEERS_BIN``
(``os.pathsep``-separated).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..servers import free_port
from .procs import Proc, find_tool

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def find_peer(name: str, extra_dirs: Iterable[str] = ()) -> str | None:
    """Path of executable ``name``: this environment, ``PATH``, ``extra_dirs``, ``$KVGATE_PEERS_BIN``."""
    found = find_tool(name)
    if found:
        return found
    dirs = [*extra_dirs, *filter(None, os.environ.get("KVGATE_PEERS_BIN", "").split(os.pathsep))]
    for d in dirs:
        path = Path(d) / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def _hostport(url: str) -> str:
    return url.split("://", 1)[1].rstrip("/")


NGINX_CONF = """\
daemon off;
master_process on;
worker_processes {workers};
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream replicas {{
{servers}
        keepalive {keepalive};
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://replicas;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


def nginx_config(upstreams: Sequence[str], port: int, workdir: str, *, workers: str = "auto",
                 keepalive: int = 64) -> str:
    """A plain round-robin reverse proxy: upstream keep-alive, no response buffering (streams)."""
    servers = "\n".join(f"        server {_hostport(u)};" for u in upstreams)
    return NGINX_CONF.format(workers=workers, dir=workdir, servers=servers, keepalive=keepalive, port=port)


def nginx_proc(upstreams: Sequence[str], port: int, workdir: str, *, exe: str | None = None,
               workers: str = "auto", keepalive: int = 64) -> Proc:
    exe = exe or find_peer("nginx", ["/usr/sbin"])
    if exe is None:
        raise FileNotFoundError("nginx is not installed (apt-get install nginx-light)")
    os.makedirs(workdir, exist_ok=True)
    conf = os.path.join(workdir, "nginx.conf")
    with open(conf, "w", encoding="utf-8") as fh:
        fh.write(nginx_config(upstreams, port, workdir, workers=workers, keepalive=keepalive))
    argv = [exe, "-p", workdir, "-c", conf, "-e", os.path.join(workdir, "error.log")]
    return Proc("nginx", argv, f"http://127.0.0.1:{port}/health")


def other_port(port: int) -> int:
    """A free port that is not ``port`` (which nobody listens on yet: ``free_port`` may pick it
    again, and a router given it twice dies on its second bind after passing its health check)."""
    while (other := free_port()) == port:
        pass
    return other


def sglang_router_proc(urls: Sequence[str], port: int, policy: str = "round_robin",
                       exe: str | None = None) -> Proc:
    exe = exe or find_peer("sglang-router")
    if exe is None:
        raise FileNotFoundError("sglang-router is not installed (pip install sglang-router)")
    argv = [exe, "launch", "--worker-urls", *urls, "--policy", policy, "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warn", "--prometheus-port", str(other_port(port))]
    return Proc("sglang-router", argv, f"http://127.0.0.1:{port}/health")


def vllm_router_proc(urls: Sequence[str], port: int, policy: str = "round_robin",
                     exe: str | None = None) -> Proc:
    exe = exe or find_peer("vllm-router")
    if exe is None:
        raise FileNotFoundError("vllm-router is not installed (pip install vllm-router)")
    argv = [exe, "--worker-urls", *urls, "--policy", policy, "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", "--prometheus-port", str(other_port(port))]
    return Proc("vllm-router", argv, f"http://127.0.0.1:{port}/health")


def kvgate_proc(urls: Sequence[str], port: int, policy: str = "round_robin", *,
                name: str = "kvgate", env: dict[str, str] | None = None,
                source_tree: str | None = None, log_level: str = "warning") -> Proc:
    """``kvgate serve`` in a subprocess (``source_tree``: import ``gateway`` from that checkout)."""
    if source_tree:
        boot = ("import sys; sys.path.insert(0, sys.argv.pop(1)); from gateway.cli import main; "
                "sys.exit(main(sys.argv[1:]))")
        argv = [sys.executable, "-c", boot, os.path.abspath(source_tree), "serve"]
    else:
        argv = [sys.executable, "-m", "gateway.cli", "serve"]
    argv += ["--port", str(port), "--policy", policy, "--log-level", log_level]
    for u in urls:
        argv += ["--replica", u]
    return Proc(name, argv, f"http://127.0.0.1:{port}/health", env=dict(env or {}))


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, utime + stime ticks) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()  # after "(comm)": state is field 3
    return int(fields[1]), int(fields[11]) + int(fields[12])


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                children.setdefault(st[0], []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, all threads) used so far by ``pid`` and its live descendants."""
    ticks = 0
    for p in descendants(pid):
        st = _stat(p)
        if st is not None:
            ticks += st[1]
    return ticks / CLK_TCK


def machine_busy_seconds() -> float:
    """CPU seconds all cores have spent not idle since boot (from /proc/stat)."""
    with open("/proc/stat", encoding="ascii") as fh:
        parts = fh.readline().split()[1:]
    values = [int(x) for x in parts]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    busy = sum(values[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / CLK_TCK
