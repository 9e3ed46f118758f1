"""Prefix hashing shared by the gateway, the simulator and the worker agent.

Algorithm (one module, one definition; keep this header in sync with the code):

* Seed.  ``seed = xxh3_64(model.encode())`` -- the model name (plus an optional LoRA/salt
  string, joined with ``"\\x00"``) salts every chain, so equal text for two models never collides.
* Approximate mode (no tokenizer; works with any OpenAI backend).  The request is rendered to a
  canonical string (``render_chat`` / ``render_completion``): tools first, then every message in
  order as ``"\\x1e" + role + "\\x1f" + content``; list contents keep their text parts and the URLs of
  image/audio parts; tool calls are rendered as compact JSON.  The UTF-8 bytes are cut into fixed
  chunks of ``chunk_bytes`` (default 256, about 64 tokens of English); only full chunks are hashed,
  like an engine caches only full blocks.
* Token mode (exact).  Token ids are cut into blocks of ``block_size`` tokens (full blocks only) and
  each block is hashed over its little-endian uint32 bytes.
* Chain.  ``h_0 = xxh3_64(chunk_0, seed)``, ``h_i = xxh3_64(chunk_i, seed=h_{i-1})``.  Hash ``i``
  therefore names the whole prefix ``chunk_0..chunk_i``: equal prefixes give equal leading hashes,
  and one lookup per hash finds the longest shared prefix.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import orjson
import xxhash

DEFAULT_CHUNK_BYTES = 256
BYTES_PER_TOKEN = 4  # estimate used to turn approximate chunks into token counts

_xxh3 = xxhash.xxh3_64_intdigest


def model_seed(model: str, salt: str = "") -> int:
    """Chain seed for ``model`` (and an optional LoRA/adapter ``salt``)."""
    key = model if not salt else f"{model}\x00{salt}"
    return _xxh3(key.encode())


def chain_hashes(chunks: Iterable[bytes | memoryview], seed: int) -> list[int]:
    """Chained hashes of ``chunks``: element i names the prefix chunk_0..chunk_i."""
    out: list[int] = []
    h = seed
    for chunk in chunks:
        h = _xxh3(chunk, h)
        out.append(h)
    return out


def hash_bytes(data: bytes, seed: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[int]:
    """Chained hashes of the full ``chunk_bytes``-sized chunks of ``data``."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    view = memoryview(data)
    full = len(data) - len(data) % chunk_bytes
    out: list[int] = []
    h = seed
    for start in range(0, full, chunk_bytes):
        h = _xxh3(view[start : start + chunk_bytes], h)
        out.append(h)
    return out


def hash_token_blocks(token_ids: Sequence[int], block_size: int, seed: int) -> list[int]:
    """Chained hashes of the full ``block_size``-token blocks of ``token_ids``."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    data = array("I", token_ids).tobytes()
    return hash_bytes(data, seed, block_size * 4)


def _content_text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, dict):
                kind = part.get("type")
                if kind == "text":
                    parts.append(str(part.get("text", "")))
                elif kind == "image_url":
                    url = part.get("image_url")
                    parts.append(str(url.get("url", "")) if isinstance(url, dict) else str(url))
                else:
                    parts.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
            else:
                parts.append(str(part))
        return "".join(parts)
    return orjson.dumps(content, option=orjson.OPT_SORT_KEYS).decode()


def render_chat_parts(messages: Sequence[object], tools: object = None) -> tuple[str, int, list[int]]:
    """The canonical text of a chat request (see module header), the offset where its messages
    start (after the tools), and the offset where each message ends."""
    pieces: list[str] = []
    length = 0
    if tools:
        pieces.append("\x1etools\x1f" + orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode())
        length = len(pieces[0])
    start = length
    ends: list[int] = []
    for msg in messages:
        if not isinstance(msg, dict):
            raise TypeError("each message must be an object")
        role = msg.get("role", "")
        piece = f"\x1e{role}\x1f{_content_text(msg.get('content'))}"
        calls = msg.get("tool_calls")
        if calls:
            piece += orjson.dumps(calls, option=orjson.OPT_SORT_KEYS).decode()
        pieces.append(piece)
        length += len(piece)
        ends.append(length)
    return "".join(pieces), start, ends


def render_chat(messages: Sequence[object], tools: object = None) -> str:
    """Canonical text of a chat request (see module header)."""
    return render_chat_parts(messages, tools)[0]


def render_completion(prompt: object) -> str:
    """Canonical text of a completions ``prompt`` (string, list of strings or token ids)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if all(isinstance(p, int) for p in prompt):
            return " ".join(map(str, prompt))
        return "\x1e".join(render_completion(p) for p in prompt)
    if prompt is None:
        return ""
    raise TypeError("prompt must be a string, a list of strings or a list of token ids")
