"""Message framing of the agent's block protocol (pure: bytes in, values out).

Every message starts with a 16-byte frame header (little-endian)::

    off size field
      0    4  magic b"KVT1"
      4    1  op (``Op``)
      5    1  flags (``FLAG_PREFIX``: FETCH stops at the first missing key)
      6    2  reserved, 0
      8    4  count: keys (FETCH), blocks that follow (PUSH, BLOCKS), blocks stored/sent (ACK)
     12    4  body length: bytes of body that follow the header (keys, versions, error text)

Exchanges (one at a time per connection; a connection is reused for many):

* ``FETCH(count=n, body=n x uint64 keys)`` -> ``BLOCKS(count=k)`` + k blocks, repeated, then
  ``ACK(count=total)``; or ``ERROR(body=utf-8 text)`` at any frame boundary.
* ``PUSH(count=n)`` + n blocks -> ``ACK(count=stored)`` or ``ERROR``.

``BLOCKS`` and ``PUSH`` may carry a body: the version of each of their blocks, in order
(``migration.Version``), each ``uint64 counter, uint8 n, n bytes utf-8 writer``; ``(0, "")`` is
"unversioned", and an empty body means every block is.  The versions ride in the frame rather than
in the block header because the block format is also the disk format and the same bytes every
transport moves; versions are the replication protocol's business.

A block on the wire is exactly the ``blockfmt`` serialisation: an 80-byte header (key, dtype,
shape, payload length, xxh3_64 payload checksum) followed by the payload, so blocks are
self-delimiting and checked one by one.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from typing import NamedTuple

from ..errors import ProtocolError
from ..migration import UNVERSIONED, Version

MAGIC = b"KVT1"
_FRAME = struct.Struct("<4sBBHII")
FRAME_SIZE = _FRAME.size  # 16
FLAG_PREFIX = 1
MAX_COUNT = 1 << 20
MAX_BODY = 8 * MAX_COUNT


class Op(enum.IntEnum):
    FETCH = 1
    PUSH = 2
    BLOCKS = 3
    ACK = 4
    ERROR = 5


class Frame(NamedTuple):
    op: Op
    count: int = 0
    body_len: int = 0
    flags: int = 0


def pack_frame(op: Op, count: int = 0, body_len: int = 0, flags: int = 0) -> bytes:
    if not (0 <= count <= MAX_COUNT and 0 <= body_len <= MAX_BODY):
        raise ProtocolError(f"frame too large: count={count}, body={body_len}")
    return _FRAME.pack(MAGIC, op, flags, 0, count, body_len)


def unpack_frame(buf: bytes | bytearray | memoryview) -> Frame:
    if len(buf) != FRAME_SIZE:
        raise ProtocolError(f"frame header is {FRAME_SIZE} bytes, got {len(buf)}")
    magic, op, flags, _reserved, count, body_len = _FRAME.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r}")
    try:
        kind = Op(op)
    except ValueError:
        raise ProtocolError(f"unknown op {op}") from None
    if count > MAX_COUNT or body_len > MAX_BODY:
        raise ProtocolError(f"frame too large: count={count}, body={body_len}")
    return Frame(kind, count, body_len, flags)


def pack_keys(keys: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(keys)}Q", *keys)


def unpack_keys(body: bytes | bytearray | memoryview, count: int) -> list[int]:
    if len(body) != 8 * count:
        raise ProtocolError(f"{count} keys need {8 * count} bytes, got {len(body)}")
    return list(struct.unpack(f"<{count}Q", body))


_VERSION = struct.Struct("<QB")


def pack_versions(versions: Sequence[Version | None]) -> bytes:
    """The body of a ``BLOCKS``/``PUSH`` frame; empty when no block has a version."""
    if all(v is None or v == UNVERSIONED for v in versions):
        return b""
    out = bytearray()
    for v in versions:
        v = v or UNVERSIONED
        writer = v.writer.encode()
        if len(writer) > 255 or not 0 <= v.counter < 1 << 64:
            raise ProtocolError(f"version {v} does not fit the wire format")
        out += _VERSION.pack(v.counter, len(writer)) + writer
    return bytes(out)


def unpack_versions(body: bytes | bytearray | memoryview, count: int) -> list[Version]:
    """Versions of ``count`` blocks (all unversioned for an empty body)."""
    if not body:
        return [UNVERSIONED] * count
    out, pos, view = [], 0, memoryview(body)
    try:
        for _ in range(count):
            counter, n = _VERSION.unpack_from(view, pos)
            pos += _VERSION.size + n
            if pos > len(view):
                raise ProtocolError("truncated version body")
            out.append(Version(counter, bytes(view[pos - n : pos]).decode()))
    except (struct.error, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed version body: {exc}") from exc
    if pos != len(view):
        raise ProtocolError(f"version body has {len(view) - pos} trailing bytes")
    return out


def fetch_message(keys: Sequence[int], *, prefix: bool = False) -> bytes:
    body = pack_keys(keys)
    return pack_frame(Op.FETCH, len(keys), len(body), FLAG_PREFIX if prefix else 0) + body


def error_message(text: str) -> bytes:
    body = text.encode()[:4096]
    return pack_frame(Op.ERROR, 0, len(body)) + body
