"""vLLM-format KV events: encoder/decoder round trip, older array form, coalescing."""

from __future__ import annotations

import pytest

msgpack = pytest.importorskip("msgpack")

from worker_agent.events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    coalesce,
    decode_batch,
    encode_batch,
    zmq_frames,
)


def test_round_trip_dict_form():
    events = [
        BlockStored((1, 2**64 - 1), None, tuple(range(32)), 16, "GPU"),
        BlockStored((3,), 2**64 - 1, (5,) * 16, 16, "CPU", lora_id=7),
        BlockRemoved((1,), "DISK"),
        AllBlocksCleared(),
    ]
    payload = encode_batch(12.5, events, dp_rank=3)
    raw = msgpack.unpackb(payload)
    assert raw[0] == 12.5 and raw[2] == 3
    assert raw[1][0] == {
        "type": "BlockStored",
        "block_hashes": [1, 2**64 - 1],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
    }
    batch = decode_batch(payload)
    assert batch.ts == 12.5 and batch.dp_rank == 3 and list(batch.events) == events


def test_decodes_older_array_form_and_ignores_unknowns():
    payload = msgpack.packb(
        [
            1.0,
            [
                ["BlockStored", [10, 11], 9, [1, 2, 3, 4], 2, None, "GPU", "extra-field"],
                ["BlockStored", [12], 11, [5, 6], 2],  # trailing fields omitted
                ["BlockRemoved", [10]],
                ["AllBlocksCleared"],
                ["SomethingNew", 1, 2],
                {"type": "BlockRemoved", "block_hashes": [11], "medium": "CPU", "group_idx": 0},
            ],
        ]
    )
    batch = decode_batch(payload)
    assert batch.dp_rank is None
    assert list(batch.events) == [
        BlockStored((10, 11), 9, (1, 2, 3, 4), 2, "GPU"),
        BlockStored((12,), 11, (5, 6), 2, None),
        BlockRemoved((10,), None),
        AllBlocksCleared(),
        BlockRemoved((11,), "CPU"),
    ]


def test_decodes_map_form_batch():
    payload = msgpack.packb(
        {"ts": 2.0, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 1}
    )
    batch = decode_batch(payload)
    assert (batch.ts, batch.events, batch.dp_rank) == (2.0, (AllBlocksCleared(),), 1)
    with pytest.raises(ValueError):
        decode_batch(msgpack.packb(5))


def test_coalesce_merges_chains_and_removals_only():
    events = [
        BlockStored((1,), None, (1, 1), 2, "GPU"),
        BlockStored((2,), 1, (2, 2), 2, "GPU"),
        BlockStored((3,), 2, (3, 3), 2, "CPU"),  # other medium: not merged
        BlockStored((9,), 7, (9, 9), 2, "CPU"),  # not a child of 3
        BlockRemoved((1,), "GPU"),
        BlockRemoved((2,), "GPU"),
        BlockRemoved((3,), "CPU"),
    ]
    assert coalesce(events) == [
        BlockStored((1, 2), None, (1, 1, 2, 2), 2, "GPU"),
        BlockStored((3,), 2, (3, 3), 2, "CPU"),
        BlockStored((9,), 7, (9, 9), 2, "CPU"),
        BlockRemoved((1, 2), "GPU"),
        BlockRemoved((3,), "CPU"),
    ]


def test_zmq_frames_match_vllm_layout():
    topic, seq, payload = zmq_frames(b"kv", 258, b"x")
    assert (topic, seq, payload) == (b"kv", b"\x00" * 6 + b"\x01\x02", b"x")


def test_block_keys_use_the_shared_prefix_hash():
    from policies.hashing import hash_token_blocks, model_seed
    from worker_agent.keys import block_keys, parents

    toks = list(range(100))
    keys = block_keys(toks, 16, "tiny")
    assert keys == hash_token_blocks(toks, 16, model_seed("tiny")) and len(keys) == 6
    assert block_keys(toks[:40] + [7] * 60, 16, "tiny")[:2] == keys[:2]  # shared prefix
    assert block_keys(toks[:40] + [7] * 60, 16, "tiny")[2] != keys[2]
    assert block_keys(toks, 16, "tiny", salt="lora-a")[0] != keys[0]
    assert parents(keys[:3]) == [None, keys[0], keys[1]] and parents([]) == []


def test_net_effect_states_each_change_once_root_first():
    from worker_agent.events import net_effect

    tail_first = [
        BlockStored((3,), 2, (5, 6), 2, "GPU"),
        BlockRemoved((9,), "GPU"),  # a victim demoted to make room
        BlockStored((9,), None, (), 2, "CPU"),
        BlockStored((2,), 1, (3, 4), 2, "GPU"),
        BlockRemoved((3,), "GPU"),  # block 3 itself demoted later in the same operation
        BlockStored((3,), 2, (5, 6), 2, "CPU"),
        BlockStored((1,), None, (1, 2), 2, "GPU"),
        BlockStored((7,), None, (), 2, "GPU"),  # placed, then dropped: a transient
        BlockRemoved((7,), "GPU"),
    ]
    out = net_effect(tail_first)
    assert out == [
        BlockRemoved((9,), "GPU"),
        BlockStored((9,), None, (), 2, "CPU"),
        BlockStored((1,), None, (1, 2), 2, "GPU"),
        BlockStored((2,), 1, (3, 4), 2, "GPU"),
        BlockStored((3,), 2, (5, 6), 2, "CPU"),
    ]
    assert coalesce(out)[2] == BlockStored((1, 2), None, (1, 2, 3, 4), 2, "GPU")
    multi = [
        BlockStored((5, 6), 4, (1, 2, 3, 4), 2, "GPU"),
        BlockStored((4,), None, (0, 0), 2, "GPU"),
    ]
    merged = BlockStored((4, 5, 6), None, (0, 0, 1, 2, 3, 4), 2, "GPU")
    assert coalesce(net_effect(multi)) == [merged]
    assert net_effect([AllBlocksCleared(), BlockStored((1,), None)]) == [
        AllBlocksCleared(), BlockStored((1,), None),
    ]
