"""Run several ASGI apps (gateway, simulated replicas) as uvicorn servers on one event loop.

uvicorn's ``Server.serve`` installs its own signal handlers, which does not compose when several
servers share a loop; :class:`ServerGroup` disables that and owns SIGINT/SIGTERM itself, so Ctrl-C
shuts every server down in uvicorn's order (stop accepting, drain, lifespan shutdown).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import uvicorn


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the group handles signals
        yield


@dataclass
class ServerSpec:
    app: object
    host: str
    port: int
    log_level: str = "warning"
    access_log: bool = False
    graceful_timeout: float = 10.0
    server: str = "uvicorn"  # uvicorn | fast (gateway/httpserver.py)


def _config(spec: ServerSpec) -> uvicorn.Config:
    return uvicorn.Config(
        spec.app,
        host=spec.host,
        port=spec.port,
        log_level=spec.log_level,
        access_log=spec.access_log,
        lifespan="auto",
        timeout_graceful_shutdown=spec.graceful_timeout,
        timeout_keep_alive=30,
        loop="none",
        http="httptools",
    )


def _make_server(spec: ServerSpec):
    if spec.server == "fast":
        from .httpserver import FastServer

        return FastServer(spec.app, spec.host, spec.port, graceful_timeout=spec.graceful_timeout)
    return _QuietServer(_config(spec))


class ServerGroup:
    """Start many servers, wait until all are up, stop them all together."""

    def __init__(self, specs: list[ServerSpec]) -> None:
        self.servers = [_make_server(s) for s in specs]
        self.specs = specs
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(s.serve()) for s in self.servers]
        while not all(s.started for s in self.servers):
            for t in self._tasks:
                if t.done():
                    await self.stop()
                    exc = t.exception()
                    raise RuntimeError(f"a server failed to start: {exc!r}") from exc
            await asyncio.sleep(0.01)

    def request_stop(self) -> None:
        for s in self.servers:
            s.should_exit = True

    async def stop(self) -> None:
        self.request_stop()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def wait(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def run_until_signal(self, on_started: Callable[[], None] | None = None) -> None:
        """Start, then serve until SIGINT/SIGTERM; a second signal forces exit.  ``on_started``
        runs once every server is up (its lifespan's start-up done)."""
        loop = asyncio.get_running_loop()
        hits = 0

        def on_signal() -> None:
            nonlocal hits
            hits += 1
            for s in self.servers:
                s.should_exit = True
                if hits > 1:
                    s.force_exit = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, on_signal)
        try:
            await self.start()
            if on_started is not None:
                on_started()
            await self.wait()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out as an outgoing connection's source port."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for tests and the demo's defaults).

    Picked at random below the ephemeral range: a port the kernel chose with ``bind(0)`` is one
    it also gives to outgoing connections as their source port, and a test suite that opens
    thousands of loopback connections takes it before the server that was to listen there
    binds it (EADDRINUSE)."""
    low = _ephemeral_low()
    if low > 12000:
        rng = random.SystemRandom()  # no state shared with the program's own random module
        for _ in range(100):
            port = rng.randrange(10000, low - 64)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def install_uvloop() -> None:
    """Use uvloop when it is installed (it is, through uvicorn[standard])."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - optional speed-up
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def free_port_block(n: int, host: str = "127.0.0.1") -> int:
    """First of ``n`` consecutive ports that were all free a moment ago."""
    for _ in range(200):
        base = free_port(host)
        if base + n >= 65000:
            continue
        socks: list[socket.socket] = []
        try:
            for i in range(n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                # Like the servers that will bind it: a port held only by TIME_WAIT is free.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports")
