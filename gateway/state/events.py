"""Index-change events: what one gateway tells the others about a routing decision.

An event says "gateway ``gateway`` (process instance ``origin``) sent a request whose prompt has the
prefix chain ``hashes`` to ``replica``, for session ``session``".  Receivers apply it to their local
view exactly as the routing policy does on dispatch: ``PrefixIndex.insert(replica, hashes)`` and
``SessionTable.bind(session, replica)``.

``seq`` is assigned by the publisher when the event leaves its outbox: consecutive per ``origin``,
so a receiver that sees a jump knows entries were trimmed from the stream before it read them.
``wall_us`` is the publisher's wall clock (microseconds) at the decision (for the apply-lag metric and stale-session checks).

Wire format: one Redis stream entry has one field, ``e``, holding the event as one binary blob
(little-endian; lengths in bytes)::

    u8 version (1) | u64 seq | u64 wall_us | u32 len(replica) | u32 len(session) or 0xFFFFFFFF
    when there is none | u32 len(gateway) | u32 len(origin) | the four strings (utf-8) | the
    hashes: n x u64, n = what is left / 8

One field and one blob keep both ends cheap: the publisher packs an event with one struct call,
the tailer unpacks it with one ``unpack_from`` and a few slices.

Stream ids are Redis's ``<ms>-<seq>`` strings; :func:`parse_id` turns one into a comparable tuple.
"""

from __future__ import annotations

import struct
import sys
from array import array
from dataclasses import dataclass

ZERO_ID = "0-0"


@dataclass(frozen=True, slots=True)
class Event:
    replica: str
    hashes: tuple[int, ...] = ()
    session: str | None = None
    gateway: str = ""
    origin: str = ""
    seq: int = 0
    wall_us: int = 0


def parse_id(stream_id: str | bytes) -> tuple[int, int]:
    if isinstance(stream_id, bytes):
        stream_id = stream_id.decode()
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def format_id(ms: int, seq: int = 0) -> str:
    return f"{ms}-{seq}"


def pack_hashes(hashes: tuple[int, ...]) -> bytes:
    arr = array("Q", hashes)  # OverflowError for values outside uint64
    if sys.byteorder == "big":  # pragma: no cover - wire format is little-endian
        arr.byteswap()
    return arr.tobytes()


def unpack_hashes(data: bytes) -> tuple[int, ...]:
    if len(data) % 8:
        raise ValueError("hash field is not a multiple of 8 bytes")
    arr = array("Q")
    arr.frombytes(data)
    if sys.byteorder == "big":  # pragma: no cover
        arr.byteswap()
    return tuple(arr)


_HEAD = struct.Struct("<BQQIIII")
_NONE = 0xFFFFFFFF
VERSION = 1


def encode(ev: Event) -> bytes:
    r, g, o = ev.replica.encode(), ev.gateway.encode(), ev.origin.encode()
    s = b"" if ev.session is None else ev.session.encode()
    head = _HEAD.pack(VERSION, ev.seq, ev.wall_us, len(r), _NONE if ev.session is None else len(s),
                      len(g), len(o))
    return b"".join((head, r, s, g, o, pack_hashes(ev.hashes)))


def decode(blob: bytes) -> Event:
    """The event in one stream entry's blob; ``ValueError`` when it is malformed."""
    try:
        version, seq, wall_us, lr, ls, lg, lo = _HEAD.unpack_from(blob)
    except struct.error as exc:
        raise ValueError(f"short event blob: {exc}") from exc
    if version != VERSION:
        raise ValueError(f"unknown event version {version}")
    i = _HEAD.size
    replica = blob[i : i + lr].decode()
    i += lr
    session = None
    if ls != _NONE:
        session = blob[i : i + ls].decode()
        i += ls
    gateway = blob[i : i + lg].decode()
    origin = blob[i + lg : i + lg + lo].decode()
    i += lg + lo
    if i > len(blob):
        raise ValueError("event blob shorter than its header says")
    return Event(replica, unpack_hashes(blob[i:]), session, gateway, origin, seq, wall_us)
