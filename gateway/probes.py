"""Health probes of ``kvgate up``: local checks equivalent to a compose service's healthcheck.

A probe is a callable that answers True once the service is healthy.  :func:`healthcheck_probe`
picks one for a service (rules in :mod:`gateway.up`'s module doc).
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

from .compose import LOOPBACK, PortMap
from .errors import ConfigError

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

