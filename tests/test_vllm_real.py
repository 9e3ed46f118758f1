"""kvgate in front of two REAL vLLM servers (CPU build; a tiny random Llama from vllm_model.py).

One module-scoped pair of vLLM servers (prefix caching, prompt-token details, KV events) and one
``kvgate serve`` subprocess in front of them; the official ``openai`` client drives the gateway.
Skipped only when the vLLM venv is absent (``make test`` makes it: ``make vllm-venv``).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
import uuid

import httpx
import openai
import pytest
import zmq

from tests.topology import poll_until
from tests.vllm_model import ensure_model
from tests.vllm_servers import (
    BLOCK_SIZE,
    MAX_NUM_SEQS,
    MODEL_NAME,
    Rig,
    VllmServer,
    complete_prompt,
    covering,
    metric_value,
    model_cache_root,
    receive_events,
    start_gateway,
    start_vllm,
    stop_group,
    stored_events,
    vllm_python,
    wait_healthy,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")  # stopped as soon as this module is done: 6 GB of memory back
def rig(tmp_path_factory):
    python = vllm_python()
    if python is None:
        pytest.skip(
            "the vLLM venv (.venv-vllm) is absent: `make vllm-venv` (run by `make test`) makes it"
        )
    work = str(tmp_path_factory.mktemp("vllm"))
    model = ensure_model(python, model_cache_root())
    ctx = zmq.Context()
    servers: list[VllmServer] = []
    subs = []
    gw_proc = None
    try:
        servers = [start_vllm(python, model, work, name) for name in ("a", "b")]
        for srv in servers:  # SUB connects now and again until the server binds: no event is missed
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(srv.events_endpoint)
            subs.append(sub)
        wait_healthy(servers, timeout=400)
        base, gw_proc = start_gateway([s.url for s in servers], work, MAX_NUM_SEQS)
        yield Rig(servers, subs, base, ctx)
    finally:
        if gw_proc is not None:
            stop_group(gw_proc, signal.SIGINT, grace=20)
        for srv in servers:
            srv.stop()
        for sub in subs:
            sub.close()
        ctx.term()


GREEDY = {"temperature": 0, "seed": 7, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


# --- the OpenAI surface, passed through ----------------------------------------------------------
def test_models_union_and_unknown_model_is_openai_404(rig):
    client = rig.client()
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    replicas = httpx.get(rig.gateway + "/admin/replicas").json()
    listed = replicas["replicas"]
    assert sorted(r["url"] for r in listed) == sorted(s.url for s in rig.servers)
    assert all(r["models"] == [MODEL_NAME] and r["healthy"] for r in listed)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.status_code == 404
    assert info.value.body["code"] == "model_not_found"


def test_greedy_chat_is_vllms_own_output_through_the_gateway(rig):
    messages = [{"role": "user", "content": "Tell me about prefix caches " + uuid.uuid4().hex}]
    direct = [
        rig.client(s.url).chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
        for s in rig.servers
    ]
    rid = "kvgate-test-" + uuid.uuid4().hex
    raw = rig.client().chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=messages, extra_headers={"x-request-id": rid}, **GREEDY
    )
    via = raw.parse()
    text = direct[0].choices[0].message.content
    assert text and direct[1].choices[0].message.content == text  # same weights, same greedy text
    assert via.choices[0].message.content == text
    assert via.usage.completion_tokens == 12 and via.choices[0].finish_reason == "length"
    assert via.usage.prompt_tokens == direct[0].usage.prompt_tokens
    # vLLM's own body, not a rewrite: its fingerprint, and its id made from the x-request-id
    # header the gateway passed on (vLLM names a chat completion chatcmpl-<x-request-id>).
    assert via.system_fingerprint.startswith("vllm-") and via.id == f"chatcmpl-{rid}"
    assert raw.headers["x-request-id"] == rid
    assert raw.headers["x-kvgate-replica"] in {s.url.split("://")[1] for s in rig.servers}
    assert raw.headers["x-kvgate-policy"] == "cache_aware"


def test_streaming_chat_relays_vllms_chunks_and_usage(rig):
    messages = [{"role": "user", "content": "Stream a greedy answer " + uuid.uuid4().hex}]
    whole = rig.client(rig.servers[0].url).chat.completions.create(
        model=MODEL_NAME, messages=messages, **GREEDY
    )
    stream = rig.client().chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 12
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_pass_through(rig):
    prompt = "def fibonacci(n):  # " + uuid.uuid4().hex
    args = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "temperature": 0,
        "max_tokens": 6,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    direct = rig.client(rig.servers[1].url).completions.create(**args)
    via = rig.client().completions.create(**args)
    # The tokens, not only the text: the tiny random model's 6 tokens may decode to "".
    assert via.choices[0].text == direct.choices[0].text
    assert via.choices[0].token_ids == direct.choices[0].token_ids
    assert len(via.choices[0].token_ids) == 6
    assert via.usage.completion_tokens == 6 and via.id.startswith("cmpl-")
    # vLLM's own 400 (too many tokens for the context) comes back as it is: no retry, no 502.
    too_long = {**args, "max_tokens": 100_000}
    errors = []
    for client in (rig.client(rig.servers[1].url), rig.client()):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**too_long)
        errors.append(info.value)
    assert errors[1].status_code == 400 and errors[1].body == errors[0].body
    assert errors[1].response.headers.get("x-kvgate-attempts") == "1"


# --- cache-aware routing against real prefix caches ---------------------------------------------
def test_cache_aware_routes_a_shared_prefix_to_one_replica_and_vllm_hits(rig):
    # cache_aware's defaults (an 8B model on an H100: 0.1 ms of prefill per token, 100 ms ties)
    # call a prefix worth less than ~1000 tokens a tie and spread sessions over the ties; this one
    # is worth more (about 2300 of this model's tokens, 1300 of the gateway's estimate).
    system = uuid.uuid4().hex + ("You are a careful assistant for the kvgate project. " * 100)
    engine_hits = {
        s.url: metric_value(httpx.get(s.url + "/metrics").text, "vllm:prefix_cache_hits_total")
        for s in rig.servers
    }
    before = httpx.get(rig.gateway + "/metrics").text
    seen, reasons = [], []
    questions = ("What is a KV cache?", "What is a prefix?", "Why route by prefix?", "Sessions?")
    for i, question in enumerate(questions):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        stream = i == len(questions) - 1  # the last one streams: usage from the SSE tail
        raw = rig.client().chat.completions.with_raw_response.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=2,
            temperature=0,
            stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        )
        usage = raw.parse().usage if not stream else [c for c in raw.parse() if c.usage][-1].usage
        seen.append(
            (
                raw.headers["x-kvgate-replica"],
                usage.prompt_tokens_details.cached_tokens,
                int(raw.headers["x-kvgate-predicted-cached-tokens"]),
                usage.prompt_tokens,
            )
        )
        reasons.append(raw.headers["x-kvgate-reason"])
    replicas = {r for r, *_ in seen}
    assert len(replicas) == 1, (seen, reasons)
    assert reasons[1:] == ["prefix-hit"] * 3, reasons
    cached = [c for _, c, _, _ in seen]
    assert cached[0] == 0, seen  # a fresh prefix: vLLM computed it
    # vLLM's own count: whole blocks of the shared system prompt (its 128-token blocks).
    assert all(c >= BLOCK_SIZE and c % BLOCK_SIZE == 0 and c < p for _, c, _, p in seen[1:]), seen
    # The gateway expected the hits, counted in vLLM's blocks (engine_block_tokens=128).
    assert all(pred > 0 and pred % BLOCK_SIZE == 0 for _, _, pred, _ in seen[1:]), seen
    chosen = rig.server_by_id(replicas.pop())
    for srv in rig.servers:
        hits = metric_value(httpx.get(srv.url + "/metrics").text, "vllm:prefix_cache_hits_total")
        if srv is chosen:
            assert hits - engine_hits[srv.url] >= sum(cached), (hits, engine_hits, seen)
        else:
            assert hits == engine_hits[srv.url]  # the other replica never saw the prefix

    last_delta = []

    def counted():  # the gateway records the outcome after the response: poll until it is in
        text = httpx.get(rig.gateway + "/metrics").text
        delta = metric_value(
            text, "kvgate_actual_cached_tokens_total", policy="cache_aware"
        ) - metric_value(before, "kvgate_actual_cached_tokens_total", policy="cache_aware")
        last_delta[:] = [delta]
        return text if delta == sum(cached) else None

    try:
        after = poll_until(counted, 30, "actual cached tokens in the gateway's /metrics")
    except TimeoutError as exc:
        raise AssertionError(f"gateway counted {last_delta} cached tokens, vLLM said {seen}") from exc
    predicted = metric_value(
        after, "kvgate_predicted_cached_tokens_total", policy="cache_aware"
    ) - metric_value(before, "kvgate_predicted_cached_tokens_total", policy="cache_aware")
    assert predicted == sum(pred for _, _, pred, _ in seen)


def test_a_shared_prefix_shorter_than_a_vllm_block_is_predicted_as_vllm_counts_it(rig):
    """vLLM caches whole 128-token blocks: a shorter shared system prompt comes back 0 cached.

    The gateway hashes 256-byte chunks (64 tokens by its estimate), so it holds the prompt's first
    chunk; counted in hashes it would predict 64 cached tokens for a 0, and cache_aware would learn
    from every such request that the replica evicts (see ``engine_block_tokens``).
    """
    from gateway.features import CHAT, parse_request

    system = "Answer in one short sentence. " * 8  # 240 characters, 115 tokens
    bodies = [
        {"model": MODEL_NAME, "max_tokens": 1, "temperature": 0,
         "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}
        for q in ("What is a block?", "What is a token?")
    ]  # fmt: skip
    hashes = [
        parse_request(CHAT, json.dumps(b).encode(), {}).features.prefix_hashes for b in bodies
    ]
    assert hashes[0][0] == hashes[1][0]  # one shared chunk in the gateway's view
    only_system = {"model": MODEL_NAME, "messages": [{"role": "system", "content": system}]}
    shared = httpx.post(rig.servers[0].url + "/tokenize", json=only_system).json()["count"]
    assert shared < BLOCK_SIZE  # ... and less than one block in vLLM's
    session = {"x-session-id": "short-" + uuid.uuid4().hex}  # both to one replica
    seen = []
    for body in bodies:
        resp = httpx.post(rig.gateway + "/v1/chat/completions", json=body, headers=session)
        assert resp.status_code == 200, resp.text
        cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        predicted = resp.headers["x-kvgate-predicted-cached-tokens"]
        seen.append((resp.headers["x-kvgate-replica"], cached, predicted))
    assert seen[0][0] == seen[1][0], seen
    assert seen[1][1:] == (0, "0"), seen  # vLLM cached nothing, and the gateway said so


# --- load scraping of a real /metrics page -------------------------------------------------------
async def test_load_scraper_reads_a_busy_vllm(rig):
    from gateway.config import ReplicaConfig
    from gateway.fastclient import FastClient
    from gateway.health import check_replica
    from gateway.replicas import Replica, parse_engine_metrics

    target = rig.servers[1]
    replica_id = target.url.split("://")[1]
    body = {
        "model": MODEL_NAME,
        "prompt": "count: " + uuid.uuid4().hex,
        "max_tokens": 4000,  # the model's context is 4096
        "temperature": 0,
        "ignore_eos": True,
    }

    async def gateway_sees(running_at_least: int, running_at_most: int):
        replicas = (await http.get(rig.gateway + "/admin/replicas")).json()["replicas"]
        row = next(r for r in replicas if r["id"] == replica_id)
        return running_at_least <= row["running"] <= running_at_most and row

    async def scrape_while_busy(http, still_generating) -> None:
        rep = Replica(ReplicaConfig(target.url))
        deadline = time.monotonic() + 60
        probes = FastClient()  # the gateway's probes go out on its upstream client
        try:
            while rep.running < 1:  # vLLM updates its gauges once per engine step
                still_generating()
                assert time.monotonic() < deadline, "vllm:num_requests_running never reached 1"
                assert await check_replica(probes, rep, timeout=30.0)
                await asyncio.sleep(0.05)
        finally:
            await probes.aclose()
        page = (await http.get(target.url + "/metrics")).text
        parsed = parse_engine_metrics(page)
        assert parsed["running"] == metric_value(page, "vllm:num_requests_running")
        assert parsed["waiting"] == metric_value(page, "vllm:num_requests_waiting")
        assert parsed["kv_usage"] == metric_value(page, "vllm:kv_cache_usage_perc")
        info = re.search(r"^vllm:cache_config_info\{(.*)\} 1\.0$", page, re.M)
        assert info, "vLLM does not report vllm:cache_config_info"
        labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1)))
        blocks = int(labels["num_gpu_blocks"])
        assert blocks > 0 and parsed["kv_tokens"] == int(labels["block_size"]) * blocks
        assert rep.kv_tokens == parsed["kv_tokens"]
        assert rep.models == frozenset({MODEL_NAME}) and rep.metrics_ok
        assert rep.running == 1 and rep.waiting == 0 and rep.kv_usage > 0

        deadline = time.monotonic() + 60
        while not (row := await gateway_sees(1, 1)):
            still_generating()
            assert time.monotonic() < deadline, "the gateway never scraped the running request"
            await asyncio.sleep(0.05)
        assert row["kv_usage"] > 0 and row["waiting"] == 0

    class Ended(Exception):
        """The request finished before the scrapes saw it running."""

    def still_generating() -> None:
        if gen.done():
            raise Ended(repr(gen.exception() or gen.result().status_code))

    async with httpx.AsyncClient(timeout=30) as http:
        # Not streamed: vLLM's API server then does little per token and answers /metrics while
        # the engine generates (a streamed request kept it from answering for up to 10 s with the
        # other core busy).  It runs until the test hangs up, when vLLM aborts it.  With both
        # cores busy the gateway's probes can be late for the whole of a 4,000-token request (it
        # happened once in a full run): then it is sent again, three times at most.
        for attempt in range(3):
            body["prompt"] = "count: " + uuid.uuid4().hex
            gen = asyncio.create_task(http.post(target.url + "/v1/completions", json=body, timeout=300))
            try:
                await scrape_while_busy(http, still_generating)
                break
            except Ended as exc:
                assert attempt < 2, f"three requests ended ({exc}) before a scrape saw one running"
            finally:
                gen.cancel()  # the client hangs up
        # vLLM aborts the request and the gateway's next scrape says so.
        deadline = time.monotonic() + 60
        while not await gateway_sees(0, 0):
            assert time.monotonic() < deadline, "the gateway never saw the request end"
            await asyncio.sleep(0.05)


# --- KV events from the real engine --------------------------------------------------------------
def test_kv_events_from_real_vllm_decode_and_feed_the_prefix_index(rig):
    from policies.prefix_index import PrefixIndex
    from worker_agent.shared import ChainTracker

    server, sub = rig.servers[0], rig.subs[0]
    while sub.poll(0):  # events of earlier tests
        sub.recv_multipart()
    words = " ".join(f"item{i}" for i in range(300))
    first = f"{uuid.uuid4().hex} {words}"
    tokens = complete_prompt(server, first)
    full = len(tokens) // BLOCK_SIZE
    assert full >= 2, len(tokens)
    got = receive_events(sub, covering(full * BLOCK_SIZE))
    seqs = [s for s, _, _ in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    stored = stored_events(b for _, b, _ in got)
    assert stored[0].parent_block_hash is None  # a fresh prefix starts at the root
    assert all(e.block_size == BLOCK_SIZE for e in stored)
    assert all(len(e.token_ids) == BLOCK_SIZE * len(e.block_hashes) for e in stored)
    chain = [h for e in stored for h in e.block_hashes]
    token_ids = [t for e in stored for t in e.token_ids]
    assert token_ids[: full * BLOCK_SIZE] == tokens[: full * BLOCK_SIZE]  # the blocks of our prompt
    for prev, ev in zip(stored, stored[1:], strict=False):
        assert ev.parent_block_hash == prev.block_hashes[-1]  # one chain, run after run

    # The same prompt, longer: vLLM hits the first blocks and stores the rest under the last one.
    longer = complete_prompt(server, first + " " + words)
    assert longer[: len(tokens)] == tokens
    more = receive_events(sub, covering((len(longer) // BLOCK_SIZE - full) * BLOCK_SIZE))
    tail = stored_events(b for _, b, _ in more)
    assert tail[0].parent_block_hash == chain[full - 1]
    tail_tokens = [t for e in tail for t in e.token_ids]
    n_tail = len(tail_tokens) // BLOCK_SIZE * BLOCK_SIZE
    assert tail_tokens[:n_tail] == longer[full * BLOCK_SIZE : full * BLOCK_SIZE + n_tail]

    # A gateway prefix index fed with these events knows the replica holds the whole chain.
    index = PrefixIndex()
    index.apply_events("a", stored=[(e.parent_block_hash, e.block_hashes) for e in stored + tail])
    whole = tuple(chain[:full]) + tuple(h for e in tail for h in e.block_hashes)
    assert index.match(whole) == {"a": len(whole)}
    assert index.stats()["orphan_events"] == 0
    # So does the agent's chain tracker (what an agent publishes to the gateways).
    tracker = ChainTracker()
    chains = tracker.apply([e for _, b, _ in got + more for e in b.events])
    assert whole in chains

    # The replay socket serves the same payloads from any sequence number.
    dealer = rig.ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(server.replay_endpoint)
        dealer.send_multipart([b"", seqs[0].to_bytes(8, "big")])
        replayed = {}
        while True:
            assert dealer.poll(10_000), "no end-of-replay marker"
            _, _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            replayed[int.from_bytes(seq, "big")] = payload
        assert all(replayed[s] == payload for s, _, payload in got + more)
    finally:
        dealer.close()
