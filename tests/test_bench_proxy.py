"""``kvgate bench proxy`` parts: the mock replica, the peers' configs, CPU accounting, the report,
and (when wrk is installed) a one-second end-to-end run."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil

import httpx
import orjson
import pytest

from gateway.bench import mock_upstream, peers
from gateway.bench import proxy as bench
from tests.topology import free_port_block

CHAT = "/v1/chat/completions"


@pytest.fixture(params=["spread", "burst"])
async def mock(request):
    port = free_port_block(2)
    servers = await mock_upstream.serve("127.0.0.1", [port, port + 1], chunks=16, spread=request.param == "spread")
    yield f"http://127.0.0.1:{port}"
    for s in servers:
        s.close()


async def test_mock_replica_answers_json_streams_and_probes(mock):
    async with httpx.AsyncClient(timeout=5) as c:
        r = await c.post(mock + CHAT, content=bench.request_body("json", 16))
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        async with c.stream("POST", mock + CHAT, content=bench.request_body("stream", 16)) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            text = "".join([t async for t in r.aiter_text()])
        events = [ln[6:] for ln in text.split("\n") if ln.startswith("data: ")]
        assert len(events) == 17 and events[-1] == "[DONE]"  # 16 chunks, the last with [DONE] too
        assert orjson.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
        assert (await c.get(mock + "/health")).status_code == 200
        assert (await c.get(mock + "/v1/models")).json()["data"][0]["id"] == "tiny"
        assert (await c.get(mock + "/nope")).status_code == 404


async def test_mock_replica_answers_pipelined_requests_in_order(mock):
    host, port = mock.split("://")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    stream = bench.request_body("stream", 16).encode()
    req = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
    writer.write(req % (len(stream), stream) + b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    data = await reader.read()  # the server closes after the second answer
    writer.close()
    first, second = data.split(b"0\r\n\r\n", 1)
    assert first.startswith(b"HTTP/1.1 200 OK") and b"data: [DONE]" in first
    assert second.startswith(b"HTTP/1.1 200 OK") and second.endswith(b"content-length: 0\r\n\r\n")


def test_nginx_config_is_a_keepalive_unbuffered_round_robin_proxy(tmp_path):
    conf = peers.nginx_config(["http://127.0.0.1:9001", "http://127.0.0.1:9002/"], 8080, str(tmp_path))
    assert "server 127.0.0.1:9001;" in conf and "server 127.0.0.1:9002;" in conf
    assert "keepalive 64;" in conf and "proxy_buffering off;" in conf
    assert 'proxy_set_header Connection "";' in conf and "proxy_http_version 1.1;" in conf
    assert "listen 127.0.0.1:8080" in conf and f"pid {tmp_path}/nginx.pid;" in conf


def test_cpu_accounting_reads_proc():
    me = os.getpid()
    assert me in peers.descendants(me)
    sum(i * i for i in range(200_000))  # some CPU to count
    assert peers.tree_cpu_seconds(me) > 0
    assert peers.machine_busy_seconds() > 0


def test_find_peer_looks_in_extra_folders(tmp_path, monkeypatch):
    exe = tmp_path / "vllm-router-test"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert peers.find_peer("vllm-router-test") is None or shutil.which("vllm-router-test")
    assert peers.find_peer("vllm-router-test", [str(tmp_path)]) == str(exe)
    monkeypatch.setenv("KVGATE_PEERS_BIN", str(tmp_path))
    assert peers.find_peer("vllm-router-test") == str(exe)


def _sample(target, cell, rnd, rps, p50, p99, cpu_s=0.0, requests=1000):
    return bench.Sample(target=target, cell=cell, round=rnd, requests=requests, errors=0, duration_s=1.0,
                        rps=rps, p50_ms=p50, p90_ms=p50, p99_ms=p99, mean_ms=p50, target_cpu_s=cpu_s,
                        replica_cpu_s=0.01, wrk_cpu_s=0.1, others_cpu_s=0.0)


def test_summary_takes_medians_and_added_latency_per_round():
    targets = [bench.Target("direct", "u", None), bench.Target("kvgate", "u", object()),
               bench.Target("vllm-router", "u", object())]
    cells = [bench.Cell("stream", 32), bench.Cell("json", 1)]
    samples = []
    for rnd, (d50, k50) in enumerate([(1.0, 3.0), (2.0, 3.5), (1.5, 9.0)]):
        samples.append(_sample("direct", "stream c=32", rnd, 10000, d50, d50 * 2))
        samples.append(_sample("kvgate", "stream c=32", rnd, 7000 + rnd, k50, k50 * 2, cpu_s=0.12))
        samples.append(_sample("vllm-router", "stream c=32", rnd, 6000, d50 + 3, d50 * 2 + 8, cpu_s=0.2))
        samples.append(_sample("direct", "json c=1", rnd, 5000, 0.1, 0.2))
        samples.append(_sample("kvgate", "json c=1", rnd, 4000, 0.25, 0.4, cpu_s=0.09))
    summaries = bench.summarize(samples, targets, cells)
    by = {(s.target, s.cell): s for s in summaries}
    k = by[("kvgate", "stream c=32")]
    assert k.rps == 7001 and k.p50_ms == 3.5
    assert k.added_p50_ms == pytest.approx(2.0)  # per-round differences 2.0, 1.5, 7.5
    assert k.cpu_us_per_req == pytest.approx(120)
    assert by[("direct", "stream c=32")].added_p50_ms is None and by[("direct", "json c=1")].cpu_us_per_req is None
    lines = bench.goals(summaries, [1, 32])
    assert any(ln.startswith("- [x] stream c=32: req/s >= vllm-router's") for ln in lines)
    assert any(ln.startswith("- [x] stream c=32: added p50/p99") for ln in lines)
    assert any(ln.startswith("- [x] stream c=32: CPU <= 150 us") for ln in lines)
    assert any(ln.startswith("- [x] json c=1: added p50 <= 0.2 ms") for ln in lines)
    table = bench.table(summaries)
    assert "| stream c=32 | kvgate" in table and "+2.00" in table


def test_wrk_script_posts_the_chat_body():
    script = bench.WRK_SCRIPT.format(body=bench.request_body("stream", 16))
    assert 'wrk.method = "POST"' in script and '"stream":true' in script and '"max_tokens":14' in script
    assert "latency:percentile(99)" in script


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("wrk") is None, reason="needs wrk")
def test_end_to_end_run_writes_reports_and_the_readme_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## Performance\n\n<!-- bench:proxy -->\nold\n<!-- /bench:proxy -->\n\n## After\n")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    targets = "direct,kvgate" + (",nginx" if peers.find_peer("nginx", ["/usr/sbin"]) else "")
    args = parser.parse_args(["--duration", "1", "--rounds", "1", "--warmup", "0", "--connections", "2",
                              "--targets", targets, "--out", str(tmp_path / "out"), "--readme", str(readme)])
    assert bench.run(args) == 0
    data = json.loads((tmp_path / "out" / "proxy.json").read_text())
    rows = {(s["target"], s["cell"]): s for s in data["summary"]}
    for name in targets.split(","):
        for cell in ("stream c=2", "json c=2"):
            assert rows[(name, cell)]["rps"] > 0 and rows[(name, cell)]["errors"] == 0
    assert rows[("kvgate", "json c=2")]["cpu_us_per_req"] > 0
    text = readme.read_text()
    assert "old" not in text and "| json c=2" in text and text.endswith("## After\n")
