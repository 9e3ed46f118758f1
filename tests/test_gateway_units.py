"""Unit tests of the gateway's pure parts: config, request features, metrics parsing, usage."""

import asyncio

import orjson
import pytest

from gateway.capacity import sync_capacities
from gateway.config import GatewayConfig, ReplicaConfig, load_config
from gateway.errors import BadRequest, ConfigError
from gateway.features import CHAT, COMPLETION, EMBEDDINGS, RESPONSES, parse_request
from gateway.holds import PrefillHolds
from gateway.replicas import ReplicaPool, parse_engine_metrics
from gateway.upstream import request_headers, response_headers
from gateway.wire import cached_tokens, usage_from_sse_tail
from policies import PolicyDeps, RequestFeatures, default_registry
from policies.hashing import hash_bytes, model_seed, render_chat
from policies.prefix_index import PrefixIndex


def chat(messages, **extra):
    return orjson.dumps({"model": "tiny", "messages": messages, **extra})


def test_config_precedence_file_env_cli(tmp_path):
    f = tmp_path / "kvgate.yaml"
    f.write_text(
        "port: 7000\npolicy: random\nreplicas:\n  - http://a:1\n  - {url: 'http://b:2/', models: [m1]}\n"
    )
    cfg = load_config({}, env={}, config_file=str(f))
    assert cfg.port == 7000 and cfg.policy == "random"
    assert [r.url for r in cfg.replicas] == ["http://a:1", "http://b:2"]
    assert cfg.replicas[1].models == ("m1",) and cfg.replicas[1].id == "b:2"
    cfg = load_config({}, env={"KVGATE_PORT": "7100", "KVGATE_CONFIG": str(f)})
    assert cfg.port == 7100 and cfg.policy == "random"
    cfg = load_config({"port": 7200, "replicas": ["http://c:3"]}, env={"KVGATE_PORT": "7100"})
    assert cfg.port == 7200 and [r.id for r in cfg.replicas] == ["c:3"]


def test_config_env_replicas_list_and_policy_params():
    cfg = load_config({}, env={"KVGATE_REPLICAS": "http://a:1,http://b:2", "KVGATE_POLICY_PARAMS": "{c: 1.5}"})
    assert [r.id for r in cfg.replicas] == ["a:1", "b:2"]
    assert cfg.policy_params == {"c": 1.5}


@pytest.mark.parametrize(
    "values",
    [{"port": 0}, {"unknown_setting": 1}, {"replicas": ["ftp://x"]}, {"log_level": "loud"},
     {"replicas": ["http://a:1", "http://a:1"]}, {"port": "abc"}],
)
def test_config_rejects_bad_values(values):
    with pytest.raises(ConfigError):
        load_config(values, env={})


def test_config_bad_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config({}, env={}, config_file=str(f))
    with pytest.raises(ConfigError, match="cannot read"):
        load_config({}, env={}, config_file=str(tmp_path / "missing.yaml"))


def test_features_chat_prefix_hashes_match_the_shared_module():
    system = "You are a helpful assistant. " * 40
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    parsed = parse_request(CHAT, chat(msgs, max_tokens=7), {}, chunk_bytes=256)
    expected = hash_bytes(render_chat(msgs).encode(), model_seed("tiny"), 256)
    assert list(parsed.features.prefix_hashes) == expected
    assert len(expected) == len(render_chat(msgs).encode()) // 256 > 0
    assert parsed.features.max_tokens == 7 and parsed.features.tokens_per_hash == 64


def test_features_shared_prefix_gives_shared_leading_hashes():
    system = "Shared system prompt with plenty of words. " * 30
    a = parse_request(CHAT, chat([{"role": "system", "content": system}, {"role": "user", "content": "A?"}]), {})
    b = parse_request(CHAT, chat([{"role": "system", "content": system}, {"role": "user", "content": "B!"}]), {})
    n = len(system) // 256
    assert a.features.prefix_hashes[:n] == b.features.prefix_hashes[:n]
    other = parse_request(
        CHAT, orjson.dumps({"model": "other", "messages": [{"role": "system", "content": system}]}), {}
    )
    assert not set(other.features.prefix_hashes) & set(a.features.prefix_hashes)


def test_session_key_sources():
    msgs = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": "second"}]
    by_header = parse_request(CHAT, chat(msgs, user="u1"), {"x-session-id": "s-42"})
    assert by_header.features.session_key == "s-42"
    by_user = parse_request(CHAT, chat(msgs, user="u1"), {})
    assert by_user.features.session_key == "user:u1"
    turn1 = parse_request(CHAT, chat(msgs[:1]), {}).features.session_key
    turn3 = parse_request(CHAT, chat(msgs), {}).features.session_key
    assert turn1 == turn3 and turn1.startswith("turn:")
    custom = parse_request(CHAT, chat(msgs), {"x-conv": "c9"}, session_header="x-conv")
    assert custom.features.session_key == "c9"


@pytest.mark.parametrize(
    ("kind", "body", "match"),
    [
        (CHAT, b"{not json", "not valid JSON"),
        (CHAT, b"[1, 2]", "JSON object"),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
        (CHAT, b'{"model": "tiny", "messages": []}', "messages"),
        (CHAT, b'{"model": "tiny", "messages": ["x"]}', "object"),
        (CHAT, b'{"model": "tiny", "messages": [{"role": "user"}], "stream": "yes"}', "stream"),
        (CHAT, b'{"model": "tiny", "messages": [{"role": "user"}], "max_tokens": -1}', "max_tokens"),
        (COMPLETION, b'{"model": "tiny"}', "prompt"),
        (COMPLETION, b'{"model": "tiny", "prompt": 5}', "prompt"),
        (EMBEDDINGS, b'{"model": "tiny"}', "input"),
        (RESPONSES, b'{"model": "tiny", "input": 3}', "input"),
    ],
)
def test_bad_requests_are_400(kind, body, match):
    with pytest.raises(BadRequest, match=match) as info:
        parse_request(kind, body, {})
    assert info.value.status == 400
    err = orjson.loads(info.value.body())["error"]
    assert err["type"] == "invalid_request_error" and err["message"]


def test_completion_and_responses_features():
    comp = parse_request(COMPLETION, b'{"model": "tiny", "prompt": "' + b"x" * 600 + b'"}', {})
    assert len(comp.features.prefix_hashes) == 2 and comp.features.prompt_tokens == 150
    tokens = parse_request(COMPLETION, orjson.dumps({"model": "tiny", "prompt": list(range(300))}), {})
    assert tokens.features.prefix_hashes
    resp = parse_request(RESPONSES, orjson.dumps({"model": "tiny", "input": "hello", "instructions": "be brief"}), {})
    assert resp.features.session_key.startswith("turn:")


def test_parse_engine_metrics_sums_label_sets():
    text = """# HELP vllm:num_requests_running x
vllm:num_requests_running{model_name="a"} 3.0
vllm:num_requests_running{model_name="b"} 2.0
vllm:num_requests_waiting{model_name="a",engine="0"} 4 1700000000
vllm:kv_cache_usage_perc{model_name="a"} 0.25
vllm:prefix_cache_hits_total{model_name="a"} 99
garbage line
"""
    assert parse_engine_metrics(text) == {"running": 5.0, "waiting": 4.0, "kv_usage": 0.25}


def test_parse_engine_metrics_reads_only_whole_samples_of_its_metrics():
    """Names that merely start like a load gauge, and HELP/TYPE lines that mention one, are not
    samples of it; the first and the last line (no newline after it) are."""
    buckets = "".join(f'vllm:time_to_first_token_seconds_bucket{{le="{i}"}} {i}\n' for i in range(40))
    text = ("vllm:num_requests_running 1\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting_by_reason{reason="capacity"} 7.0\n'
            "vllm:num_requests_running_total 50\n"
            + buckets +
            "xvllm:num_requests_running 9\n"
            "vllm:num_requests_waiting{engine=\"0\"} 2.0\n"
            "vllm:num_requests_waiting{engine=\"1\"} NaN-ish\n"
            "vllm:num_requests_running{engine=\"1\"}\t3")  # fmt: skip
    assert parse_engine_metrics(text) == {"running": 4.0, "waiting": 2.0}


def test_parse_engine_metrics_reads_the_cache_size_from_vllms_cache_config_info():
    # As vLLM writes it: the CacheConfig as labels of a constant gauge, one sample per engine.
    text = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_gpu_blocks="4096",prefix_caching_hash_algo="sha256"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="1",num_gpu_blocks="1024",prefix_caching_hash_algo="sha256"} 1.0
"""
    assert parse_engine_metrics(text) == {"kv_tokens": 16 * 5120}
    off = text.replace('"True"', '"False"')
    assert "kv_tokens" not in parse_engine_metrics(off)  # no prefix cache: nothing to model
    assert "kv_tokens" not in parse_engine_metrics('vllm:cache_config_info{block_size="16"} 1.0')
    assert "kv_tokens" not in parse_engine_metrics('vllm:cache_config_info{num_gpu_blocks="x",block_size="16"} 1.0')


def test_parse_engine_metrics_reads_an_advertised_kv_pull_link():
    line = 'kvgate:kv_pull_info{kv_bytes_per_token="131072",link_gbps="100"} 1.0\n'
    assert parse_engine_metrics(line) == {"pull_ms_per_token": pytest.approx(131072 * 8 / 100e9 * 1e3)}
    slow = 'kvgate:kv_pull_info{kv_bytes_per_token="131072",link_gbps="25"} 1.0\n'
    assert parse_engine_metrics(line + slow)["pull_ms_per_token"] == pytest.approx(131072 * 8 / 25e9 * 1e3)
    for bad in ('kvgate:kv_pull_info{kv_bytes_per_token="131072",link_gbps="100"} 0.0',  # off
                'kvgate:kv_pull_info{kv_bytes_per_token="131072"} 1.0',  # no link
                'kvgate:kv_pull_info{kv_bytes_per_token="x",link_gbps="100"} 1.0',
                'kvgate:kv_pull_info{kv_bytes_per_token="131072",link_gbps="0"} 1.0',
                'kvgate:kv_pull_info 1.0'):  # fmt: skip
        assert parse_engine_metrics(bad) == {}


def test_capacities_follow_what_each_engine_reports_and_reapply_only_on_a_real_change():
    index = PrefixIndex()
    pool = ReplicaPool([ReplicaConfig("http://a:1", models=("m",)), ReplicaConfig("http://b:1")])
    a, b = pool.get("a:1"), pool.get("b:1")
    assert sync_capacities(pool, index, lambda model: 64) == []  # nobody said: the default stays
    a.kv_tokens = 64 * 1000
    assert sync_capacities(pool, index, lambda model: 64 if model == "m" else 1) == ["a:1"]
    assert index.configured_capacity("a:1") == index.capacity("a:1") == 1000
    assert index.configured_capacity("b:1") is None
    index.observe("a:1", 100, 100)  # a confirmed hit: learning moves the effective capacity
    a.kv_tokens = 64 * 1050  # within 10%: applying it would throw the learning away
    assert sync_capacities(pool, index, lambda model: 64) == []
    a.kv_tokens = 64 * 2000  # restarted with a bigger cache
    b.kv_tokens = 64 * 10
    assert sync_capacities(pool, index, lambda model: 64) == ["a:1", "b:1"]
    assert index.capacity("a:1") == 2000 and index.capacity("b:1") == 10
    index.drop_replica("a:1")  # removed, restarted, cleared: its configuration goes too
    assert sync_capacities(pool, index, lambda model: 64) == ["a:1"]


def test_a_scrape_adds_only_the_engines_other_requests_to_the_exact_in_flight_count():
    pool = ReplicaPool([ReplicaConfig("http://a:1")])
    rep = pool.get("a:1")
    rep.in_flight = 6
    rep.record_engine(running=6, waiting=0, kv_usage=0.5)  # all ours
    rep.in_flight = 1  # five finished since: the replica is nearly idle, whatever the scrape said
    (state,) = pool.snapshot().replicas
    assert state.load == 1 and state.waiting == 0 and state.kv_usage == 0.5
    rep.in_flight = 6
    rep.record_engine(running=8, waiting=3, kv_usage=0.9)  # 5 requests from other clients
    rep.in_flight = 2
    (state,) = pool.snapshot().replicas
    assert state.load == 2 + 5 and state.waiting == 3 and state.in_flight == 2
    rep.remote_in_flight = 4  # another gateway's, through the shared state
    assert pool.snapshot().replicas[0].load == 6 + 5
    assert rep.to_json()["running"] == 8 and rep.to_json()["waiting"] == 3  # as scraped


def test_usage_from_sse_tail_and_cached_tokens():
    usage = {"prompt_tokens": 100, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 64}}
    tail = (
        b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n'
        b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n"
    )
    assert cached_tokens(usage_from_sse_tail(tail)) == 64
    assert usage_from_sse_tail(b'data: {"choices":[]}\n\ndata: [DONE]\n\n') is None
    assert cached_tokens({"prompt_tokens": 3}) is None


def test_header_filtering():
    raw = [(b"host", b"gw"), (b"content-length", b"5"), (b"authorization", b"Bearer k"),
           (b"connection", b"keep-alive"), (b"x-request-id", b"old")]
    out = request_headers(raw, "rid")
    assert (b"authorization", b"Bearer k") in out and (b"x-request-id", b"rid") in out
    assert not any(k in (b"host", b"content-length", b"connection") for k, _ in out)
    assert len([k for k, _ in out if k == b"x-request-id"]) == 1
    resp = response_headers([(b"content-length", b"9"), (b"Transfer-Encoding", b"chunked"), (b"x-a", b"1")])
    assert resp == [(b"content-length", b"9"), (b"x-a", b"1")]


def test_pool_accounting_and_passive_ejection():
    pool = ReplicaPool([ReplicaConfig("http://a:1"), ReplicaConfig("http://b:2", models=("m",))], 2)
    pool.begin("a:1")
    pool.begin("a:1")
    pool.end("a:1")
    assert pool.get("a:1").in_flight == 1
    pool.end("a:1")
    pool.end("a:1")
    assert pool.get("a:1").in_flight == 0  # never negative
    assert pool.record_failure("b:2") is False
    assert pool.record_failure("b:2") is True
    assert not pool.get("b:2").healthy and pool.models() == {}
    pool.record_success("b:2")
    assert pool.models() == {"m": [pool.get("b:2")]}
    assert pool.knows_model("anything")  # a:1 has not said what it serves yet


def test_gateway_config_defaults_are_valid():
    assert GatewayConfig().validate().policy


async def test_a_held_request_counts_in_flight_and_held_until_it_is_sent() -> None:
    """The snapshot shows a request held for a prefill as in flight (other decisions see it
    coming) and as held (one sent now queues ahead of it); both go when it is released."""
    pool = ReplicaPool([ReplicaConfig("http://a:1")])
    rid = next(iter(pool)).id
    policy = default_registry().build("cache_aware", {}, PolicyDeps(index=PrefixIndex()))
    holds = PrefillHolds(pool, policy)
    req = RequestFeatures("m", (1, 2, 3), 64, 192)
    task = asyncio.ensure_future(holds.wait(rid, 30.0, req))
    await asyncio.sleep(0)  # the hold starts
    state = pool.snapshot().replicas[0]
    assert (state.in_flight, state.held) == (1, 1) and not task.done()
    holds.first_token(req, rid)  # the prefix it waits for exists now (hold_left is 0)
    await asyncio.wait_for(task, 5)
    state = pool.snapshot().replicas[0]
    assert (state.in_flight, state.held) == (0, 0)


def test_the_access_log_line_carries_the_prediction_beside_what_happened() -> None:
    from gateway.exchange import Exchange
    from gateway.logs import access_fields
    from policies.types import Decision

    decision = Decision("r1", reason="prefill-wait", predicted_cached_tokens=640, hold_s=0.0123,
                        scores={"ttft_ms": 41.234, "queue_ms": 2.0})  # fmt: skip
    ex = Exchange("/v1/chat/completions", "id1", b"id1", RequestFeatures("m"), decision, 0.0,
                  replica="r1", status=200, attempts=1, ttft=0.05)  # fmt: skip
    line = access_fields(ex, "cache_aware", 512, 0.25)
    assert line["predicted_ttft_ms"] == 41.23 and line["predicted_queue_ms"] == 2.0
    assert (line["hold_ms"], line["cached_tokens"], line["ttft_ms"]) == (12.3, 512, 50.0)
    assert line["duration_ms"] == 250.0 and line["reason"] == "prefill-wait"
    bare = access_fields(ex, "round_robin", None, 0.25) | {}
    ex.decision = Decision("r1")  # a policy without predictions: the fields are unknown
    assert access_fields(ex, "round_robin", None, 0.25)["predicted_ttft_ms"] is None
    assert bare["cached_tokens"] is None
