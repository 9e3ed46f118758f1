"""KV cache events in vLLM's wire format (pure: no torch, no sockets).

The store reports what it holds through ``BlockStored`` / ``BlockRemoved`` events; a publisher
batches them and sends them exactly as vLLM's ZMQ publisher does, so any consumer of vLLM KV
events (our gateway included) can read them.

Wire format.  A ZMQ message has three frames: topic (bytes), an 8-byte big-endian sequence
number, and a msgpack payload ``[ts, [event, ...], dp_rank]``.  Events (vLLM >= 0.10, tagged maps)::

    {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | None,
     "token_ids": [t, ...], "block_size": n, "lora_id": None, "medium": "GPU" | "CPU" | "DISK"}
    {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": ...}
    {"type": "AllBlocksCleared"}

Older engines encode events as arrays, tag first, fields in declaration order
(``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium]``,
``["BlockRemoved", hashes, medium]``, ``["AllBlocksCleared"]``), trailing fields may be missing,
and some encode the batch as a map ``{"ts", "events", "data_parallel_rank"}``.  ``decode_batch``
accepts all of these and ignores unknown fields and event types.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgpack

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    medium: str | None = MEDIUM_GPU
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...] = field(default_factory=tuple)
    dp_rank: int | None = None


def event_to_wire(event: Event) -> dict:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
        }
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(ts: float, events: Iterable[Event], dp_rank: int | None = 0) -> bytes:
    """msgpack payload ``[ts, [event, ...], dp_rank]`` with events as tagged maps."""
    return msgpack.packb([ts, [event_to_wire(e) for e in events], dp_rank], use_bin_type=True)


_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
)
_REMOVED_FIELDS = ("block_hashes", "medium")


def _as_map(raw: object) -> dict | None:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        names = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(raw[0], ())
        return {"type": raw[0], **dict(zip(names, raw[1:], strict=False))}
    return None


def event_from_wire(raw: object) -> Event | None:
    """One event from its map or array form; None for an unknown type."""
    obj = _as_map(raw)
    if obj is None:
        return None
    kind = obj.get("type")
    if kind == "BlockStored":
        return BlockStored(
            block_hashes=tuple(obj.get("block_hashes") or ()),
            parent_block_hash=obj.get("parent_block_hash"),
            token_ids=tuple(obj.get("token_ids") or ()),
            block_size=int(obj.get("block_size") or 0),
            medium=obj.get("medium"),
            lora_id=obj.get("lora_id"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(tuple(obj.get("block_hashes") or ()), obj.get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> EventBatch:
    """Inverse of ``encode_batch``; also reads older array-form events and map-form batches."""
    raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if isinstance(raw, dict):
        ts, items, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, (list, tuple)) and len(raw) >= 2:
        ts, items, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise ValueError("not a KV event batch")
    events = tuple(e for e in map(event_from_wire, items or ()) if e is not None)
    return EventBatch(float(ts or 0.0), events, rank)


def zmq_frames(topic: bytes, seq: int, payload: bytes) -> tuple[bytes, bytes, bytes]:
    """The three frames vLLM's publisher sends for one batch."""
    return topic, seq.to_bytes(8, "big"), payload


def _split(ev: BlockStored) -> list[BlockStored]:
    """One event per block (token ids cut per block when they are ``block_size`` each)."""
    n = len(ev.block_hashes)
    per = ev.block_size if ev.block_size and len(ev.token_ids) == n * ev.block_size else 0
    out, parent = [], ev.parent_block_hash
    for i, key in enumerate(ev.block_hashes):
        toks = ev.token_ids[i * per : (i + 1) * per] if per else (ev.token_ids if n == 1 else ())
        out.append(BlockStored((key,), parent, toks, ev.block_size, ev.medium, ev.lora_id))
        parent = key
    return out


def net_effect(events: Sequence[Event]) -> list[Event]:
    """The same change of state said once, with every stored parent before its children.

    Per (block, medium) the stores and removals of ``events`` add up to +1 (stored), -1
    (removed) or 0 (a transient: e.g. placed, then demoted within one operation).  The result
    lists the removals first (in their order), then the stores, each block after its parent when
    both are stored, so a chain put tail-first still reads root-first (and ``coalesce`` can merge
    it into one event).  A batch that clears everything is returned as it is.
    """
    if any(isinstance(e, AllBlocksCleared) for e in events):
        return list(events)
    delta: dict[tuple[int, str | None], int] = {}
    last: dict[tuple[int, str | None], BlockStored] = {}
    for ev in events:
        if isinstance(ev, BlockStored):
            for one in _split(ev):
                slot = (one.block_hashes[0], one.medium)
                delta[slot] = delta.get(slot, 0) + 1
                last[slot] = one
        elif isinstance(ev, BlockRemoved):
            for key in ev.block_hashes:
                slot = (key, ev.medium)
                delta[slot] = delta.get(slot, 0) - 1
    out: list[Event] = [BlockRemoved((k,), m) for (k, m), d in delta.items() if d < 0]
    stored = {slot[0]: last[slot] for slot, d in delta.items() if d > 0}
    done: set[int] = set()
    for key in stored:
        path = []
        while key in stored and key not in done:  # climb to the first ancestor not yet out
            done.add(key)
            path.append(stored[key])
            key = stored[key].parent_block_hash
        out.extend(reversed(path))
    return out


def coalesce(events: Sequence[Event]) -> list[Event]:
    """Merge runs that vLLM would have sent as one event.

    Adjacent ``BlockRemoved`` of one medium merge; adjacent ``BlockStored`` merge when they share
    medium, block size and LoRA and the second's parent is the first's last hash (a chain).
    """
    out: list[Event] = []
    for ev in events:
        prev = out[-1] if out else None
        if (
            isinstance(ev, BlockRemoved)
            and isinstance(prev, BlockRemoved)
            and prev.medium == ev.medium
        ):
            out[-1] = BlockRemoved(prev.block_hashes + ev.block_hashes, ev.medium)
        elif (
            isinstance(ev, BlockStored)
            and isinstance(prev, BlockStored)
            and (prev.medium, prev.block_size, prev.lora_id)
            == (ev.medium, ev.block_size, ev.lora_id)
            and prev.block_hashes
            and ev.parent_block_hash == prev.block_hashes[-1]
        ):
            out[-1] = BlockStored(
                prev.block_hashes + ev.block_hashes,
                prev.parent_block_hash,
                prev.token_ids + ev.token_ids,
                ev.block_size,
                ev.medium,
                ev.lora_id,
            )
        else:
            out.append(ev)
    return out
