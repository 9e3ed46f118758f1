"""Spawn a throw-away ``redis-server`` on a loopback port (``kvgate demo --gateways 2``, tests).

No persistence (``--save '' --appendonly no``): a restart starts empty, which is also how the tests
exercise a gateway's resynchronisation after Redis comes back.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time


def find_redis_server() -> str | None:
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if shutil.which("/usr/bin/redis-server") else None
    )


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalRedis:
    def __init__(self, binary: str | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.binary = binary or find_redis_server()
        if self.binary is None:
            raise FileNotFoundError("redis-server not found on PATH")
        self.host = host
        self.port = port or _free_port(host)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", self.host, "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            if self._answers():
                return
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"redis-server on port {self.port} did not answer in {timeout}s")

    def _answers(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def flushall(self) -> None:
        """Empty every database (tests start from a clean server)."""
        with socket.create_connection((self.host, self.port), timeout=2.0) as s:
            s.sendall(b"FLUSHALL\r\n")
            if not s.recv(16).startswith(b"+OK"):
                raise RuntimeError("FLUSHALL failed")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and wait until the port refuses connections."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> LocalRedis:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
