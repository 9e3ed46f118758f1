"""The demo topology, started as `kvgate demo` in a subprocess, driven by the official openai SDK."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from gateway.sim.model import expected_text
from gateway.sim.tokenizer import render_chat_prompt
from tests.topology import free_port, free_port_block, spawn_ready

LONG_SYSTEM = "You are kvgate's demo assistant. Answer briefly and cite the manual. " * 40


def _start_demo():
    port, sim_port = free_port(), free_port_block(3)
    base = f"http://127.0.0.1:{port}"
    proc = spawn_ready(
        [sys.executable, "-m", "gateway.cli", "demo", "--port", str(port), "--sim-port", str(sim_port)],
        base + "/ready", timeout=60, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return base, proc


@pytest.fixture(scope="module")
def demo():
    base, proc = _start_demo()
    try:
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise


@pytest.fixture
def client(demo):
    return openai.OpenAI(base_url=demo[0] + "/v1", api_key="unused", max_retries=0)


def test_chat_non_streaming_text_and_usage(client):
    messages = [{"role": "user", "content": "Hello there, what is kvgate?"}]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12)
    assert resp.choices[0].message.content == expected_text(render_chat_prompt(messages), 12)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 12 and resp.usage.prompt_tokens > 0


def test_chat_streaming_text_and_usage(client):
    messages = [{"role": "user", "content": "Stream me something deterministic."}]
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=9, stream=True, stream_options={"include_usage": True}
    )
    pieces, usage, roles = [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            if choice.delta.content:
                pieces.append(choice.delta.content)
    assert "".join(pieces) == expected_text(render_chat_prompt(messages), 9)
    assert len(pieces) == 9 and roles == ["assistant"]
    assert usage is not None and usage.completion_tokens == 9


def test_repeated_long_prefix_is_cached(client):
    """A long shared prefix sent twice comes back with cached tokens (whichever replica served it)."""
    seen = []
    for question in ("What is a KV cache?", "What is a prefix?", "Why route by prefix?", "And sessions?"):
        messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": question}]
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=4)
        resp = raw.parse()
        seen.append((raw.headers["x-kvgate-replica"], resp.usage.prompt_tokens_details.cached_tokens))
    # The demo's three replicas each see the prefix at most once cold; later requests hit.
    assert max(c for _, c in seen) > 0, seen
    assert sum(1 for _, c in seen if c > 0) >= len(seen) - 3


def test_completions_and_models_and_errors(client, demo):
    comp = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5)
    assert comp.choices[0].text and comp.usage.completion_tokens == 5
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"
    bad = httpx.post(demo[0] + "/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_demo_stops_cleanly_on_ctrl_c():
    base, proc = _start_demo()
    assert httpx.get(base + "/health").json()["healthy_replicas"] == 3
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "kvgate demo is up" in out and "kvgate demo stopped" in out
    assert "Traceback" not in out
