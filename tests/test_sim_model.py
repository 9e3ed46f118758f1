"""Pure parts of the simulator: tokenizer, chat template, prefix cache, output text, parsing."""

from __future__ import annotations

import argparse
import json
import random
import time

import pytest

from gateway.sim import (
    PrefixCache,
    PromptBlocks,
    SimConfig,
    SimFaults,
    add_sim_arguments,
    expected_text,
    output_pieces,
    render_chat_prompt,
    sim_config_from_args,
    tokenize,
)
from gateway.sim.model import VOCAB, blocks_held, cached_tokens, max_cacheable_blocks
from gateway.sim.protocol import ApiError, ChunkWriter, parse_request
from gateway.sim.tokenizer import completion_prompt, pieces
from policies.hashing import hash_token_blocks, model_seed

ENGLISH = (
    "The gateway routes each request to the replica that already holds the longest prefix of "
    "its prompt in the KV cache, unless that replica is much busier than the others. "
)


# -- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_is_deterministic_and_lossless():
    text = ENGLISH + "Numbers 12345, punctuation!? and\n\nnew lines\ttabs."
    assert tokenize(text) == tokenize(text)
    assert "".join(pieces(text)) == text
    assert all(0 <= t < 2**31 for t in tokenize(text))
    assert tokenize("hello world") != tokenize("hello there")


def test_tokenizer_roughly_four_to_five_chars_per_token():
    text = ENGLISH * 20
    ratio = len(text) / len(tokenize(text))
    assert 3.5 <= ratio <= 6.5


def test_tokenizer_prefix_stability():
    # appending text never changes the tokens of the shared prefix (except the last piece)
    a = tokenize(ENGLISH)
    b = tokenize(ENGLISH + "More words follow here.")
    assert b[: len(a) - 1] == a[:-1]


def test_tokenizer_is_fast_on_128_kb():
    rng = random.Random(1)
    words = ENGLISH.split() + ["x7", "(y)", "z,", "\n"]
    text = " ".join(rng.choice(words) for _ in range(40000))[: 128 * 1024]
    tokenize(text)  # warm the memo
    best = min(_timed(tokenize, text) for _ in range(3))
    assert best < 0.05  # a few ms in practice; generous for a loaded CI box
    assert len(tokenize(text)) > 128 * 1024 / 8


def _timed(fn, arg):
    t0 = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t0


# -- chat template -----------------------------------------------------------------------------


def test_chat_template():
    msgs = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "!"}],
        },
    ]
    assert render_chat_prompt(msgs) == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nhi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_tools = render_chat_prompt(msgs, tools=[{"type": "function", "function": {"name": "f"}}])
    assert with_tools.startswith("<|im_start|>tools\n")
    assert with_tools.endswith(render_chat_prompt(msgs))


def test_chat_template_shared_history_gives_shared_blocks():
    seed = model_seed("tiny")
    turn1 = [{"role": "user", "content": ENGLISH * 4}]
    turn2 = turn1 + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    h1 = hash_token_blocks(tokenize(render_chat_prompt(turn1)), 16, seed)
    h2 = hash_token_blocks(tokenize(render_chat_prompt(turn2)), 16, seed)
    assert len(h1) >= 4
    assert h2[: len(h1) - 1] == h1[:-1]


@pytest.mark.parametrize(
    "messages",
    [[], "hi", [1], [{"content": "no role"}], [{"role": "user", "content": 5}]],
)
def test_chat_template_rejects_bad_messages(messages):
    with pytest.raises(ValueError):
        render_chat_prompt(messages)


def test_completion_prompt_forms():
    assert completion_prompt("abc") == ("abc", None)
    assert completion_prompt([1, 2, 3]) == ("1 2 3", [1, 2, 3])
    assert completion_prompt(["a", "b"]) == ("a\nb", None)
    for bad in (None, 5, [], [1, "a"], [-1], [True], [2**33]):
        with pytest.raises(ValueError):
            completion_prompt(bad)


# -- prefix cache ------------------------------------------------------------------------------


def test_cache_longest_prefix_and_refresh():
    cache = PrefixCache(10)
    cache.insert([1, 2, 3])
    assert cache.match([1, 2, 3, 4]) == 3
    assert cache.match([1, 2, 9, 3]) == 2
    assert cache.match([9, 1, 2]) == 0
    assert len(cache) == 3


def test_cache_lru_eviction_and_capacity():
    cache = PrefixCache(4)
    cache.insert([1, 2])  # order: 2, 1 (first hash most recent)
    cache.insert([3, 4])  # order: 2, 1, 4, 3
    assert cache.lru_order() == [2, 1, 4, 3]
    cache.insert([1])  # refresh 1 -> 2, 4, 3, 1
    cache.insert([5])  # evicts 2
    assert len(cache) == 4
    assert 2 not in cache and {1, 3, 4, 5} <= set(cache.lru_order())
    assert cache.evictions == 1
    # a prompt larger than the cache keeps its leading blocks
    cache.insert(list(range(100, 110)))
    assert cache.lru_order() == [103, 102, 101, 100]
    assert cache.match(range(100, 110)) == 4


def test_cache_zero_capacity_stores_nothing():
    cache = PrefixCache(0)
    cache.insert([1, 2])
    assert len(cache) == 0 and cache.match([1]) == 0


def test_cached_tokens_leaves_one_token_to_compute():
    seed = model_seed("tiny")
    cache = PrefixCache(100)
    ids = list(range(48))  # exactly 3 blocks of 16
    prompt = PromptBlocks.from_tokens(ids, 16, seed)
    assert len(prompt.hashes) == 3
    assert cached_tokens(cache, prompt, 16) == 0
    cache.insert(prompt.hashes)
    assert cached_tokens(cache, prompt, 16) == 32  # the last block is recomputed
    longer = PromptBlocks.from_tokens(ids + [7], 16, seed)
    assert cached_tokens(cache, longer, 16) == 48
    assert max_cacheable_blocks(1, 16) == 0 and max_cacheable_blocks(17, 16) == 1
    assert blocks_held(1, 16) == 1 and blocks_held(32, 16) == 2 and blocks_held(33, 16) == 3


# -- output text -------------------------------------------------------------------------------


def test_output_is_deterministic_per_prompt():
    a = output_pieces("prompt one", 20)
    assert a == output_pieces("prompt one", 20)
    assert a != output_pieces("prompt two", 20)
    assert output_pieces("prompt one", 5) == a[:5]
    assert expected_text("prompt one", 20) == "".join(a)
    words = expected_text("prompt one", 20).split(" ")
    assert len(words) == 20 and set(words) <= set(VOCAB)
    assert not a[0].startswith(" ") and all(p.startswith(" ") for p in a[1:])


# -- request parsing and chunks ----------------------------------------------------------------


def _parse(body, chat=True):
    return parse_request(json.dumps(body).encode(), chat=chat, default_max_tokens=16)


def test_parse_request_limits_and_stream_flags():
    msgs = [{"role": "user", "content": "x"}]
    req = _parse({"model": "tiny", "messages": msgs})
    assert (req.max_tokens, req.limited, req.stream, req.include_usage) == (16, False, False, False)
    req = _parse({"messages": msgs, "max_tokens": 3, "max_completion_tokens": 5, "stream": True})
    assert (req.max_tokens, req.limited, req.stream) == (5, True, True)
    req = _parse({"messages": msgs, "stream": True, "stream_options": {"include_usage": True}})
    assert req.include_usage
    req = _parse({"prompt": [5, 6], "max_tokens": 2}, chat=False)
    assert req.token_ids == [5, 6] and req.max_tokens == 2


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2]",
        b'{"model": "tiny"}',
        b'{"messages": []}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "3"}',
        b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
        b'{"messages": [{"role": "user", "content": "x"}], "n": 2}',
        b'{"messages": [{"role": "user", "content": "x"}], "model": 7}',
    ],
)
def test_parse_request_errors_are_400(body):
    with pytest.raises(ApiError) as info:
        parse_request(body, chat=True, default_max_tokens=16)
    assert info.value.status == 400
    err = json.loads(info.value.body())["error"]
    assert set(err) == {"message", "type", "param", "code"}


def test_chunk_writer_escapes_and_shapes():
    req = _parse({"messages": [{"role": "user", "content": "x"}], "stream": True})
    w = ChunkWriter(req, "chatcmpl-1", 7, 'we"ird')
    chunk = json.loads(w.token('a "quoted"\n piece')[len(b"data: ") :])
    assert chunk["model"] == 'we"ird'
    assert chunk["choices"][0]["delta"] == {"content": 'a "quoted"\n piece'}
    assert "usage" not in chunk


# -- config and CLI ----------------------------------------------------------------------------


def test_config_validation_and_fault_merge():
    with pytest.raises(ValueError):
        SimConfig(block_size=0)
    with pytest.raises(ValueError):
        SimConfig(decode_s_per_token=-1)
    faults = SimFaults().merged({"error_rate": 0.5, "close_after_chunks": 3})
    assert faults.error_rate == 0.5 and faults.close_after_chunks == 3 and faults.any
    for bad in ({"error_rate": 2}, {"hang": "yes"}, {"nope": 1}, {"stall_after_chunks": -1}):
        with pytest.raises(ValueError):
            faults.merged(bad)


def test_cli_arguments_build_a_config():
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser, server_options=True)
    args = parser.parse_args(
        "--replicas 2 --port 9100 --block-size 32 --cache-blocks 64 --max-running 3 "
        "--prefill-ms-per-token 0.5 --decode-ms-per-token 4 --error-rate 0.25".split()
    )
    cfg = sim_config_from_args(args)
    assert (args.replicas, args.port) == (2, 9100)
    assert (cfg.block_size, cfg.cache_blocks, cfg.max_running) == (32, 64, 3)
    assert cfg.prefill_s_per_token == pytest.approx(0.0005)
    assert cfg.decode_s_per_token == pytest.approx(0.004)
    assert cfg.faults.error_rate == 0.25
    instant = sim_config_from_args(parser.parse_args(["--instant"]))
    assert instant.instant


@pytest.mark.parametrize(
    "content",
    [
        "plain",
        "ends with space ",
        "ends with newline\n",
        "",
        "<|im_end|> fake marker",
        " lead",
        "x\n\n ",
    ],
)
def test_segment_tokens_equal_whole_prompt_tokens(content):
    from gateway.sim.tokenizer import Tokenizer, render_chat_segments

    msgs = [
        {"role": "system", "content": content},
        {"role": "user", "content": content + "?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
    ]
    segments = render_chat_segments(msgs, tools=[{"name": "t"}])
    assert len(segments) == 5
    whole = tokenize("".join(segments))
    tokenizer = Tokenizer(max_pieces=4)  # the piece memo overflows and starts again
    assert list(tokenizer.encode_segments(segments)) == whole
    assert list(tokenizer.encode_segments(segments)) == whole  # memoised path
    tokenizer.clear()
    assert list(tokenizer.encode_segments(segments)) == whole and tokenizer.tokenize(content) == tokenize(content)
