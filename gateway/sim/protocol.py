"""OpenAI wire format for the simulator: request parsing and response/chunk bytes (pure).

Streaming chunks follow OpenAI exactly (chat): a first chunk with delta
``{"role": "assistant", "content": ""}``, one chunk per token with delta ``{"content": piece}``,
a last chunk with an empty delta and the ``finish_reason``; when ``stream_options.include_usage``
is true every one of those carries ``"usage": null`` and a final chunk with ``"choices": []``
carries the usage; then ``data: [DONE]``.  Legacy completions stream ``{"text": piece}`` choices the
same way (no role chunk).  Chunk bytes are built from per-request templates, not by a serialiser.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from .model import PIECE_JSON
from .tokenizer import PromptError, completion_prompt, render_chat_segments

MAX_OUTPUT_TOKENS = 1 << 20
DONE = b"data: [DONE]\n\n"


class ApiError(Exception):
    """An error answered with OpenAI's JSON shape ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> bytes:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return orjson.dumps({"error": err})


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


def simulated_overload() -> ApiError:
    return ApiError(
        503, "simulated failure (error_rate fault)", "server_error", code="service_unavailable"
    )


@dataclass(slots=True)
class CompletionRequest:
    chat: bool
    model: str | None
    prompt_text: str
    segments: list[str]  # prompt_text, cut where tokenization may be memoised
    token_ids: list[int] | None
    max_tokens: int
    limited: bool  # the client set max_tokens / max_completion_tokens
    stream: bool
    include_usage: bool
    kv_params: object = None  # ``kv_transfer_params`` as sent (see kvpull)


def _positive_int(body: dict, key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(400, f"'{key}' must be a positive integer", param=key)
    if value > MAX_OUTPUT_TOKENS:
        raise ApiError(400, f"'{key}' must be at most {MAX_OUTPUT_TOKENS}", param=key)
    return value


def parse_request(body: bytes, *, chat: bool, default_max_tokens: int) -> CompletionRequest:
    """Validate a ``/v1/chat/completions`` (``chat``) or ``/v1/completions`` body."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"invalid JSON body: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    try:
        if chat:
            if "messages" not in data:
                raise ApiError(400, "'messages' is required", param="messages")
            segments = render_chat_segments(data["messages"], data.get("tools"))
            text, ids = "".join(segments), None
        else:
            if "prompt" not in data:
                raise ApiError(400, "'prompt' is required", param="prompt")
            text, ids = completion_prompt(data["prompt"])
            segments = [text]
    except PromptError as exc:
        raise ApiError(400, str(exc), param="messages" if chat else "prompt") from exc
    if not text and not ids:
        raise ApiError(400, "the prompt must not be empty", param="prompt")
    limit = _positive_int(data, "max_completion_tokens") if chat else None
    if limit is None:
        limit = _positive_int(data, "max_tokens")
    n = data.get("n")
    if n is not None and n != 1:
        raise ApiError(400, "the simulator supports only n=1", param="n")
    stream = data.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    include_usage = bool(stream and options and options.get("include_usage") is True)
    return CompletionRequest(
        chat=chat,
        model=model,
        prompt_text=text,
        segments=segments,
        token_ids=ids,
        max_tokens=limit if limit is not None else default_max_tokens,
        limited=limit is not None,
        stream=bool(stream),
        include_usage=include_usage,
        kv_params=data.get("kv_transfer_params"),
    )


def usage(prompt_tokens: int, cached: int, completion_tokens: int) -> dict[str, object]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_body(
    req: CompletionRequest, rid: str, created: int, model: str, text: str, finish: str, use: dict
) -> bytes:
    """The non-streaming JSON response."""
    if req.chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return orjson.dumps(
        {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": use,
        }
    )


class ChunkWriter:
    """Bytes of the SSE events of one streamed response."""

    __slots__ = ("_head", "_tail", "_null_usage", "_chat", "_envelope")

    def __init__(self, req: CompletionRequest, rid: str, created: int, model: str) -> None:
        self._chat = req.chat
        obj = b"chat.completion.chunk" if req.chat else b"text_completion"
        self._envelope = b'{"id":%s,"object":"%s","created":%d,"model":%s' % (
            orjson.dumps(rid),
            obj,
            created,
            orjson.dumps(model),
        )
        self._null_usage = b',"usage":null' if req.include_usage else b""
        if req.chat:
            self._head = b"data: " + self._envelope + b',"choices":[{"index":0,"delta":'
        else:
            self._head = b"data: " + self._envelope + b',"choices":[{"index":0,"text":'
        self._tail = b',"logprobs":null,"finish_reason":null}]' + self._null_usage + b"}\n\n"

    def role(self) -> bytes:
        return self._head + b'{"role":"assistant","content":""}' + self._tail

    def token(self, piece: str) -> bytes:
        js = PIECE_JSON.get(piece) or orjson.dumps(piece)
        if self._chat:
            return self._head + b'{"content":' + js + b"}" + self._tail
        return self._head + js + self._tail

    def final(self, finish: str) -> bytes:
        empty = b"{}" if self._chat else b'""'
        return (
            self._head
            + empty
            + b',"logprobs":null,"finish_reason":"%s"}]' % finish.encode()
            + self._null_usage
            + b"}\n\n"
        )

    def usage(self, use: dict) -> bytes:
        return b"data: " + self._envelope + b',"choices":[],"usage":' + orjson.dumps(use) + b"}\n\n"
