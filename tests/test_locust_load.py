"""The locustfiles: a short headless run against the demo topology, in their own processes.

locust monkey-patches the standard library with gevent as it is imported, which breaks asyncio:
this test process therefore never imports loadtest/ or locust; locust runs as a subprocess, and
loadtest/ is checked (by reading its source) not to import the asyncio code of gateway/.
"""

from __future__ import annotations

import ast
import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.topology import free_port, free_port_block, wait_ready

ROOT = Path(__file__).resolve().parents[1]
LOADTEST = ROOT / "loadtest"


def test_loadtest_imports_only_stdlib_locust_and_itself():
    allowed = set(sys.stdlib_module_names) | {"locust", "loadtest", "__future__"}
    files = sorted(LOADTEST.glob("*.py"))
    assert {f.name for f in files} >= {"locustfile.py", "chat.py", "agents.py", "rag.py", "common.py"}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]} if node.level == 0 else {"loadtest"}
            else:
                continue
            assert roots <= allowed, f"{path.name} imports {sorted(roots - allowed)}"
            assert "asyncio" not in roots, f"{path.name} imports asyncio"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    port, sim_port = free_port(), free_port_block(3)
    log = tmp_path_factory.mktemp("demo") / "demo.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "demo", "--port", str(port), "--sim-port", str(sim_port)],
        stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base + "/ready", timeout=60)
        yield base, [f"127.0.0.1:{sim_port + i}" for i in range(3)]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"the demo did not stop on SIGINT:\n{log.read_text()}") from None


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow
def test_headless_locust_run_has_no_failures(demo, tmp_path):
    base, replicas = demo
    prefix = tmp_path / "run"
    locust = Path(sys.executable).parent / "locust"
    cmd = [str(locust) if locust.exists() else "locust", "-f", "loadtest/locustfile.py", "--headless",
           "-u", "8", "-r", "8", "-t", "5s", "--host", base, "--csv", str(prefix), "--only-summary",
           "--max-tokens", "16"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out  # locust exits 1 when any request failed

    stats = {(r["Type"], r["Name"]): r for r in _rows(Path(f"{prefix}_stats.csv"))}
    total = stats[("", "Aggregated")]
    assert int(total["Failure Count"]) == 0 and int(total["Request Count"]) > 0, total
    for name in ("/v1/chat/completions [chat, stream]", "/v1/chat/completions [agent, stream]",
                 "/v1/chat/completions [rag]"):
        assert int(stats[("POST", name)]["Request Count"]) > 0, name
    for workload in ("chat", "agent"):
        ttft = stats[("TTFT", workload)]
        assert int(ttft["Request Count"]) > 0
        stream = stats[("POST", f"/v1/chat/completions [{workload}, stream]")]
        # TTFT is part of the streamed request, which is timed to its last byte.
        assert 0 < float(ttft["Average Response Time"]) <= float(stream["Average Response Time"])

    report = json.loads(Path(f"{prefix}_cache.json").read_text())
    tally = report["total"]
    assert tally["prompt_tokens"] > 0 and 0 < tally["cached_tokens"] < tally["prompt_tokens"]
    assert tally["hit_rate"] == pytest.approx(tally["cached_tokens"] / tally["prompt_tokens"], abs=1e-4)
    assert set(report["workloads"]) == {"chat", "agent", "rag"}
    assert sum(w["requests"] for w in report["workloads"].values()) == tally["requests"]
    assert set(tally["replicas"]) <= set(replicas) and tally["replicas"]
    # RAG and agents resend long shared prefixes: they must hit the replicas' prefix caches.
    assert report["workloads"]["rag"]["cached_tokens"] > 0
    assert report["workloads"]["agent"]["cached_tokens"] > 0
    cache_csv = {r["workload"]: r for r in _rows(Path(f"{prefix}_cache.csv"))}
    assert int(cache_csv["total"]["cached_tokens"]) == tally["cached_tokens"]
    assert "kvgate cached-token hit rate" in out
