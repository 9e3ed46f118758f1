"""One parse of a request body into the features routing needs (pure; no I/O)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import orjson
import xxhash

from policies.hashing import (
    BYTES_PER_TOKEN,
    hash_bytes,
    model_seed,
    render_chat_parts,
    render_completion,
)
from policies.types import RequestFeatures

from .errors import BadRequest

CHAT = "chat"
COMPLETION = "completion"
RESPONSES = "responses"
EMBEDDINGS = "embeddings"

ROUTES: dict[str, str] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETION,
    "/v1/responses": RESPONSES,
    "/v1/embeddings": EMBEDDINGS,
}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: str
    body: dict
    features: RequestFeatures


def _loads(raw: bytes) -> dict:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _first_turn_key(messages: list, text: str, start: int, ends: list[int]) -> str:
    """Hash of the conversation up to and including its first user message (its canonical text
    without tools: a slice of the text already rendered, so nothing is rendered twice)."""
    last = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), 0)
    return "turn:" + xxhash.xxh3_64_hexdigest(text[start : ends[last]].encode("utf-8", "surrogatepass"))


def _responses_messages(body: dict) -> list:
    messages: list = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    inp = body.get("input")
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        for item in inp:
            if isinstance(item, dict):
                messages.append({"role": item.get("role", item.get("type", "")), "content": item.get("content")})
            else:
                raise BadRequest("'input' items must be objects", param="input")
    elif inp is not None:
        raise BadRequest("'input' must be a string or a list", param="input")
    return messages


def _render(kind: str, body: dict) -> tuple[str, list | None, int, list[int]]:
    """The canonical prompt text and, for chat-like requests, the message list, where the
    messages start in the text and where each one ends."""
    try:
        if kind == CHAT:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("'messages' must be a non-empty list", param="messages")
            text, start, ends = render_chat_parts(messages, body.get("tools"))
            return text, messages, start, ends
        if kind == RESPONSES:
            messages = _responses_messages(body)
            text, start, ends = render_chat_parts(messages, body.get("tools"))
            return text, messages, start, ends
        field = "prompt" if kind == COMPLETION else "input"
        if field not in body:
            raise BadRequest(f"'{field}' is required", param=field)
        return render_completion(body[field]), None, 0, []
    except TypeError as exc:
        raise BadRequest(str(exc)) from exc


def _max_tokens(body: dict) -> int:
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BadRequest(f"'{key}' must be a non-negative integer", param=key)
            return value
    return 0


def tokens_per_hash(chunk_bytes: int, bytes_per_token: float) -> int:
    """The engine tokens one prefix hash (``chunk_bytes`` of rendered prompt) stands for."""
    return max(1, round(chunk_bytes / bytes_per_token))


def parse_request(kind: str, raw: bytes, headers: Mapping[str, str], **options) -> ParsedRequest:
    """Decode a client's body and :func:`parse_body` it (``options``: parse_body's)."""
    return parse_body(kind, _loads(raw), headers, **options)


def parse_body(
    kind: str,
    body: dict,
    headers: Mapping[str, str],
    *,
    session_header: str = "x-session-id",
    chunk_bytes: int = 256,
    bytes_per_token: Callable[[str], float] | None = None,
) -> ParsedRequest:
    """Validate a decoded body just enough to route it and compute its prefix hashes; token
    counts are the rendered prompt's bytes over ``bytes_per_token(model)``
    (``gateway.tokenrate``; default 4)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    text, messages, start, ends = _render(kind, body)
    data = text.encode("utf-8", "surrogatepass")
    session = headers.get(session_header) or None
    if session is None and isinstance(body.get("user"), str) and body["user"]:
        session = "user:" + body["user"]
    if session is None and messages:
        session = _first_turn_key(messages, text, start, ends)
    rate = BYTES_PER_TOKEN if bytes_per_token is None else bytes_per_token(model)
    features = RequestFeatures(
        model=model,
        prefix_hashes=tuple(hash_bytes(data, model_seed(model), chunk_bytes)),
        tokens_per_hash=tokens_per_hash(chunk_bytes, rate),
        prompt_tokens=max(1, int(len(data) / rate)),
        prompt_bytes=len(data),
        max_tokens=_max_tokens(body),
        session_key=session,
        stream=stream,
    )
    return ParsedRequest(kind=kind, body=body, features=features)
