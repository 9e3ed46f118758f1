"""`kvgate up`: compose.yaml's topology as local processes, driven with the openai SDK.

The integration test starts `kvgate up` as a subprocess on free ports, talks to the nginx entry
point with the official openai SDK, checks that both gateways behind it served requests, that a
local Prometheus running deploy/prometheus.yml (rewritten to the local ports) scrapes every
gateway and replica and can evaluate every dashboard query, and that Ctrl-C stops everything.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from gateway.errors import ConfigError
from gateway.up import (
    PortMap,
    interpolate,
    load_compose,
    plan_service,
    select_services,
    start_order,
)
from tests.topology import free_port_block, poll_until, wait_ready

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kvgate.json"
LONG_SYSTEM = "You are the stack test's assistant. Cite the runbook for every answer please. " * 40


def need(program: str) -> bool:
    """True when ``program`` is installed; in CI (where `make test` installs it) it must be."""
    found = shutil.which(program) or shutil.which(program, path="/usr/sbin")
    if not found and os.environ.get("CI"):
        pytest.fail(f"{program} is missing: `make test` installs it (Makefile: system-packages)")
    return bool(found)


# ------------------------------------------------------------------------------ units


@pytest.fixture(scope="module")
def services():
    return load_compose(COMPOSE, env={})


def test_port_map_follows_the_file_order(services):
    ports = PortMap.build(services, 20000)
    assert list(ports.ports.items())[:7] == [
        (("redis", 6379), 20000), (("replica-1", 8000), 20001), (("replica-2", 8000), 20002),
        (("replica-3", 8000), 20003), (("gateway-1", 8000), 20004), (("gateway-2", 8000), 20005),
        (("entrypoint", 8000), 20006),
    ]
    # Services outside the selection keep their ports: locust (profile load) is mapped too.
    assert ("locust", 8089) in ports.ports
    with pytest.raises(ConfigError):
        ports.local("redis", 1234)


def test_rewriting_addresses(services):
    ports = PortMap.build(services, 20000)
    text = "redis://redis:6379/0 http://replica-1:8000,http://replica-3:8000 x-replica-1:8000 replica-1:80001"
    assert ports.rewrite(text, "gateway-1") == (
        "redis://127.0.0.1:20000/0 http://127.0.0.1:20001,http://127.0.0.1:20003 x-replica-1:8000 replica-1:80001"
    )
    assert ports.rewrite("http://127.0.0.1:8000/ready 0.0.0.0 localhost:5555", "gateway-2") == (
        "http://127.0.0.1:20005/ready 127.0.0.1 localhost:5555"
    )
    assert ports.rewrite_argv(["sim", "--host", "0.0.0.0", "--port", "8000"], "replica-2") == [
        "sim", "--host", "127.0.0.1", "--port", "20002",
    ]
    assert ports.rewrite_argv(["--port=8000", "--port", "9"], "replica-1") == ["--port=20001", "--port", "9"]
    nginx = ports.rewrite_nginx("server gateway-2:8000 max_fails=2;\n    listen 8000;\n", "entrypoint")
    assert nginx == "server 127.0.0.1:20005 max_fails=2;\n    listen 127.0.0.1:20006;\n"


def test_interpolation():
    env = {"A": "1", "EMPTY": ""}
    assert interpolate("${A} $A ${B:-d} ${EMPTY:-d} ${EMPTY-d} ${B-e} $$A ${B}", env) == "1 1 d d  e $A "


def test_gateway_plan_has_the_services_environment(services, tmp_path):
    ports = PortMap.build(services, 20000)
    base_env = {"PATH": os.environ["PATH"], "KVGATE_POLICY": "random", "KVGATE_CONFIG": "/x.yaml"}
    plan = plan_service("gateway-1", services["gateway-1"], ports, ROOT, tmp_path, base_env)
    assert plan.kind == "kvgate" and plan.argv == [sys.executable, "-m", "gateway.cli", "serve"]
    env = plan.env
    assert env["KVGATE_HOST"] == "127.0.0.1" and env["KVGATE_PORT"] == "20004"
    assert env["KVGATE_REDIS_URL"] == "redis://127.0.0.1:20000/0"
    assert env["KVGATE_REPLICAS"] == "http://127.0.0.1:20001,http://127.0.0.1:20002,http://127.0.0.1:20003"
    assert env["KVGATE_POLICY"] == "cache_aware"  # the file's value, not the caller's
    assert "KVGATE_CONFIG" not in env  # the caller's KVGATE_* settings do not leak in
    grafana = plan_service("grafana", services["grafana"], ports, ROOT, tmp_path, base_env)
    assert grafana.kind == "skipped" and "grafana/grafana" in grafana.reason


def test_selection_and_order(services):
    names = start_order(select_services(services, only=["gateway-2"]), services)
    assert names == ["redis", "replica-1", "replica-2", "replica-3", "gateway-2"]
    with pytest.raises(ConfigError, match="no such service"):
        select_services(services, only=["nope"])
    loop = {"a": {"depends_on": ["b"]}, "b": {"depends_on": {"a": {"condition": "service_healthy"}}}}
    with pytest.raises(ConfigError, match="cycle"):
        start_order(["a", "b"], loop)


# ------------------------------------------------------------------------------ integration


def _closed(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) != 0


def _start_up(base: int, log: Path, *extra: str, compose: Path = COMPOSE) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "up", "--file", str(compose), "--base-port", str(base), *extra],
        stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _stop(proc: subprocess.Popen, log: Path) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return log.read_text()


def _prom_query(base: str, expr: str) -> dict:
    resp = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=5)
    body = resp.json()
    assert resp.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]


@pytest.mark.slow
def test_kvgate_up_runs_the_compose_topology(tmp_path, services):
    has_nginx, has_prometheus, has_redis = need("nginx"), need("prometheus"), need("redis-server")
    n_ports = len(PortMap.build(services).ports)
    base = free_port_block(n_ports)
    ports = PortMap.build(services, base)
    url = {name: f"http://127.0.0.1:{port}" for (name, _), port in ports.ports.items()}
    log = tmp_path / "up.log"
    proc = _start_up(base, log)
    try:
        entry = url["entrypoint"] if has_nginx else url["gateway-1"]
        wait_ready(entry + "/ready", timeout=90)
        if has_prometheus:
            wait_ready(url["prometheus"] + "/-/ready", timeout=60)
        poll_until(lambda: "kvgate up is ready" in log.read_text(), 60, "the ready banner", 0.25)
        out = log.read_text()
        assert f"OpenAI base URL: {entry}/v1" in out
        assert re.search(r"^  grafana\s+skipped: needs image grafana/", out, re.M), out
        running = ["replica-1", "replica-2", "replica-3", "gateway-1", "gateway-2"]
        running += ["redis"] * has_redis + ["entrypoint"] * has_nginx + ["prometheus"] * has_prometheus
        for name in running:
            port = ports.local(name, ports.own_ports(name)[0])
            assert re.search(rf"^  {name}\s+(http|redis)://127\.0\.0\.1:{port}\s", out, re.M), (name, out)

        client = openai.OpenAI(base_url=entry + "/v1", api_key="unused", max_retries=0)
        replica_ids = {u.split("://")[1] for n, u in url.items() if n.startswith("replica-")}
        seen = []
        for i in range(8):
            messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": f"Question {i}?"}]
            raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=4)
            assert raw.headers["x-kvgate-replica"] in replica_ids
            seen.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
        assert max(seen) > 0, seen  # the long shared prefix was cached somewhere
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "stream please"}], max_tokens=6,
            stream=True, stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert sum(1 for c in chunks for ch in c.choices if ch.delta.content) == 6
        assert chunks[-1].usage.completion_tokens == 6
        assert [m.id for m in client.models.list()] == ["tiny"]

        # The gateways share state through the stack's Redis (KVGATE_REDIS_URL, rewritten).
        if has_redis:
            for gw in ("gateway-1", "gateway-2"):
                store = httpx.get(url[gw] + "/health").json()["store"]
                assert (store["backend"], store["gateway_id"], store["up"]) == ("redis", gw, True), store

        # Both gateways behind the entry point answered some of those requests.
        if has_nginx:
            for gw in ("gateway-1", "gateway-2"):
                metrics = httpx.get(url[gw] + "/metrics").text
                served = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                             if line.startswith("kvgate_requests_total{"))
                assert served > 0, f"{gw} served nothing"

        # The Dockerfile's HEALTHCHECK command passes against a gateway and fails on a dead port.
        hc = next(ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.strip().startswith("CMD ["))
        argv = json.loads(hc.strip()[4:])
        assert argv[0] == "python"
        live = subprocess.run([sys.executable, *argv[1:]], env={**os.environ, "KVGATE_PORT": str(ports.local("gateway-1", 8000))},
                              capture_output=True, timeout=20)
        assert live.returncode == 0, live.stderr
        dead = subprocess.run([sys.executable, *argv[1:]], env={**os.environ, "KVGATE_PORT": str(base + n_ports)},
                              capture_output=True, timeout=20)
        assert dead.returncode != 0

        if has_prometheus:
            prom = url["prometheus"]

            def scraped(expr: str, want: int):
                result = _prom_query(prom, expr)["result"]
                return result if len({r["metric"]["instance"] for r in result}) >= want else None

            gateways = poll_until(
                lambda: scraped("kvgate_requests_total", 2), 30, "kvgate_requests_total", 0.25
            )
            assert {r["metric"]["job"] for r in gateways} == {"kvgate"}
            running = poll_until(
                lambda: scraped("vllm:num_requests_running", 3), 30, "vllm:num_requests_running", 0.25
            )
            assert {r["metric"]["instance"] for r in running} == {url[f"replica-{i}"].split("://")[1] for i in (1, 2, 3)}
            targets = httpx.get(prom + "/api/v1/targets").json()["data"]["activeTargets"]
            assert {t["labels"]["job"] for t in targets} == {"kvgate", "replicas", "prometheus"}
            # Every dashboard query is valid PromQL over these metrics.
            dash = json.loads(DASHBOARD.read_text())
            for panel in dash["panels"]:
                for target in panel.get("targets", []):
                    _prom_query(prom, target["expr"].replace("$__rate_interval", "1m"))
            decisions = _prom_query(prom, "sum by (policy, reason, replica) (kvgate_routing_decisions_total)")
            assert decisions["result"], "no routing decisions scraped"
    finally:
        out = _stop(proc, log)
    assert proc.returncode == 0, out
    assert "kvgate up stopped" in out and "Traceback" not in out, out
    assert "did not stop" not in out, out  # every service stopped on its signal, none was killed
    for (name, _), port in ports.ports.items():
        assert _closed(port), f"{name} still listening on {port} after kvgate up stopped"


def test_kvgate_up_fails_cleanly_when_a_service_dies(tmp_path):
    compose = tmp_path / "compose.yaml"
    compose.write_text(
        "services:\n"
        "  replica:\n"
        "    command: kvgate sim --replicas 1 --host 0.0.0.0 --port 8000\n"
        "    expose: ['8000']\n"
        "    healthcheck: {test: ['CMD', 'python', '-c', \"import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health')\"]}\n"
        "  gateway:\n"
        "    command: " + shlex.join(["kvgate", "serve", "--policy", "no_such_policy"]) + "\n"
        "    environment: {KVGATE_PORT: '8000', KVGATE_REPLICAS: 'http://replica:8000'}\n"
        "    expose: ['8000']\n"
        "    depends_on: {replica: {condition: service_healthy}}\n"
    )
    base = free_port_block(2)
    log = tmp_path / "up.log"
    proc = _start_up(base, log, compose=compose)
    proc.wait(timeout=60)
    out = log.read_text()
    assert proc.returncode == 1, out
    assert "gateway exited with status 2 before it was healthy" in out, out
    assert "no_such_policy" in out and "kvgate up stopped" in out
    assert _closed(base) and _closed(base + 1)
