"""Real vLLM servers (the CPU build, ``make vllm-venv``) on loopback ports for integration tests.

Each server runs in its own process group (vLLM starts an engine-core process) and is stopped by
group: SIGTERM, then SIGKILL after a grace period. HTTP and KV-event replay ports are picked free.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from gateway.servers import free_port
from tests.topology import spawn_ready

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_NAME = "tiny"
BLOCK_SIZE = 128  # vLLM's KV block size on CPU
MAX_NUM_SEQS = 8  # vLLM's --max-num-seqs (the gateway's cache_aware max_running)


def vllm_python() -> str | None:
    """The vLLM venv's python: ``$KVGATE_VLLM_PYTHON``, else ``.venv-vllm`` (the Makefile's)."""
    path = os.environ.get("KVGATE_VLLM_PYTHON") or os.path.join(REPO, ".venv-vllm", "bin", "python")
    venv = os.path.dirname(os.path.dirname(path))
    if not os.path.exists(path):
        return None
    if "KVGATE_VLLM_PYTHON" not in os.environ and not os.path.exists(
        os.path.join(venv, ".installed")
    ):
        return None  # an install that did not finish
    return path


def model_cache_root() -> str:
    return os.environ.get("KVGATE_VLLM_MODEL_CACHE") or os.path.join(REPO, ".venv-vllm", "models")


@dataclass
class VllmServer:
    url: str
    events_endpoint: str  # ipc://PATH: vLLM's PUB socket
    replay_endpoint: str  # tcp://127.0.0.1:PORT: vLLM's replay ROUTER socket
    proc: subprocess.Popen
    log_path: str
    _log: object = field(default=None, repr=False)

    def log_tail(self, n: int = 3000) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return fh.read()[-n:]
        except OSError:
            return ""

    def stop(self, grace: float = 20.0) -> None:
        stop_group(self.proc, signal.SIGTERM, grace)
        if self._log is not None:
            self._log.close()


def stop_group(proc: subprocess.Popen, sig: int, grace: float) -> None:
    """Stop a process started with ``start_new_session``: ``sig`` to its group, then SIGKILL."""
    if proc.poll() is None:
        _signal_group(proc, sig)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc, signal.SIGKILL)  # stragglers of the group (vLLM's engine core)
    if proc.poll() is None:
        proc.wait(timeout=10)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def start_vllm(python: str, model_dir: str, log_dir: str, name: str) -> VllmServer:
    """Start one server (do not wait); :func:`wait_healthy` waits for it.

    vLLM's KV-event PUB socket binds an ``ipc://`` endpoint, or a ``tcp://`` one only with ``*``
    (all interfaces); given ``tcp://127.0.0.1:PORT`` it connects instead, and in 0.32.0 a SUB bound
    there received nothing. So events go out on a Unix socket in ``log_dir`` (nothing listens
    beyond this machine); the replay ROUTER socket binds a free loopback port.
    """
    port, replay = free_port(), free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{os.path.join(log_dir, f'kv-events-{name}.ipc')}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--kv-events-config",
        json.dumps(events),
    ]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    log_path = os.path.join(log_dir, f"vllm-{name}.log")
    log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed by VllmServer.stop
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=log_dir
    )
    return VllmServer(
        f"http://127.0.0.1:{port}",
        events["endpoint"],
        events["replay_endpoint"],
        proc,
        log_path,
        log,
    )


def wait_healthy(servers: list[VllmServer], timeout: float) -> None:
    """Poll every server's /health until 200; fail early with its log when one exits."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for srv in list(pending):
            if srv.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {srv.proc.returncode}:\n{srv.log_tail()}")
            try:
                if httpx.get(srv.url + "/health", timeout=1.0).status_code == 200:
                    pending.remove(srv)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"vLLM not healthy after {timeout}s:\n{pending[0].log_tail()}")
        if pending:
            time.sleep(0.5)  # start-up poll interval, not event ordering


@dataclass
class Rig:
    """Two vLLM servers, a SUB socket on each one's KV events, a gateway in front of both."""

    servers: list[VllmServer]
    subs: list  # zmq SUB sockets, one per server
    gateway: str
    ctx: object  # the zmq context

    def client(self, base: str | None = None):
        import openai

        url = (base or self.gateway) + "/v1"
        return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)

    def server_by_id(self, replica_id: str) -> VllmServer:
        return next(s for s in self.servers if s.url.endswith(replica_id))


def start_gateway(urls: list[str], log_dir: str, max_running: int) -> tuple[str, subprocess.Popen]:
    """``kvgate serve`` (cache_aware) in front of ``urls``, in its own process group."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
    cmd += ["--policy", "cache_aware", "--policy-param", f"max_running={max_running}"]
    cmd += ["--policy-param", f"engine_block_tokens={BLOCK_SIZE}"]
    cmd += ["--log-level", "warning"] + [arg for url in urls for arg in ("--replica", url)]
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "KVGATE_HEALTH_INTERVAL_S": "0.3", "PYTHONUNBUFFERED": "1"}
    with open(os.path.join(log_dir, "gateway.log"), "w", encoding="utf-8") as log:
        proc = spawn_ready(
            cmd,
            base + "/ready",
            timeout=60,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    return base, proc


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (prometheus_client's parser,
    not the gateway's: an independent reading of the same page)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


# --- KV events ----------------------------------------------------------------------------------
def receive_events(sub, until, timeout: float = 20.0) -> list[tuple[int, object, bytes]]:
    """(seq, decoded batch, payload) from ``sub`` until ``until(batches)`` holds (bounded)."""
    from worker_agent.events import decode_batch

    got: list[tuple[int, object, bytes]] = []
    deadline = time.monotonic() + timeout
    while not until([b for _, b, _ in got]):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"KV events not seen within {timeout}s: {got}")
        if sub.poll(int(left * 1000)):
            topic, seq, payload = sub.recv_multipart()  # vLLM's frames: topic, sequence, msgpack
            if topic != b"" or len(seq) != 8:
                raise AssertionError(f"not vLLM's frame layout: {topic!r}, {seq!r}")
            got.append((int.from_bytes(seq, "big"), decode_batch(payload), payload))
    return got


def stored_events(batches) -> list:
    from worker_agent.events import BlockStored

    return [e for b in batches for e in b.events if isinstance(e, BlockStored)]


def covering(n_tokens: int):
    """``until`` for :func:`receive_events`: BlockStored events hold ``n_tokens`` token ids."""
    return lambda batches: sum(len(e.token_ids) for e in stored_events(batches)) >= n_tokens


def complete_prompt(server: VllmServer, prompt: str) -> list[int]:
    """Run ``prompt`` (1 output token) on ``server``; its prompt token ids (vLLM's /tokenize)."""
    body = {"model": MODEL_NAME, "prompt": prompt}
    tokens = httpx.post(server.url + "/tokenize", json=body).json()
    body.update(max_tokens=1, temperature=0)
    resp = httpx.post(server.url + "/v1/completions", timeout=60, json=body)
    if resp.status_code != 200 or resp.json()["usage"]["prompt_tokens"] != tokens["count"]:
        raise AssertionError(f"{resp.status_code} {resp.text[:500]} vs {tokens['count']} tokens")
    return tokens["tokens"]
