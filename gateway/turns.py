"""A conversation's next turn, prefilled before it is asked (pure; no I/O).

A chat client sends the whole conversation again with each turn: the previous prompt (cached on
the replica that served it), the answer it got, and its new message.  Engines cache the prompt's
blocks, not what they generated (or, where they keep generated blocks, not as the chat template
renders the answer in the next prompt), so the next turn prefills the answer again, on the
critical path of its time to first token.  When the policy asks for it (``cache_aware``,
``warm_turns``), the gateway sends, as soon as a turn's answer is complete, a warm to the replica
that served it: the conversation with the answer appended, one output token (``gateway.warms``).
The next turn then finds the answer's blocks there and prefills only its new message.

Only requests that look like a conversation are followed: a chat request with a session key from
a header or ``user``, or one that already holds an earlier answer (an assistant message), asking
for one plain answer (``n`` 1); the answer must be text, with no tool calls.
"""

from __future__ import annotations

import orjson

from .features import CHAT

MAX_CAPTURE_BYTES = 1 << 20  # a streamed answer longer than this is not followed


def continues(kind: str, body: dict, explicit_session: bool) -> bool:
    """Whether a turn of ``body`` is likely to be followed by another that resends it."""
    if kind != CHAT or body.get("n", 1) != 1:
        return False
    if explicit_session or (isinstance(body.get("user"), str) and body["user"]):
        return True
    messages = body.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and m.get("role") == "assistant" for m in messages
    )


def _text_answer(message: object) -> str | None:
    if not isinstance(message, dict) or message.get("tool_calls") or message.get("function_call"):
        return None
    content = message.get("content")
    return content if isinstance(content, str) and content else None


def answer_from_json(data: bytes) -> str | None:
    """The answer of a non-streamed chat completion (None: not one plain text answer)."""
    try:
        obj = orjson.loads(data)
        choices = obj.get("choices")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    return _text_answer(choices[0].get("message"))


def answer_from_sse(data: bytes) -> str | None:
    """The answer of a streamed chat completion, from its events' deltas (None: not one plain
    text answer, an error event, or a stream that did not end with ``[DONE]``)."""
    parts: list[str] = []
    done = False
    for line in data.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            break
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(event, dict) or "error" in event:
            return None
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                return None
            delta = choice.get("delta") or {}
            if delta.get("tool_calls") or delta.get("function_call"):
                return None
            piece = delta.get("content")
            if isinstance(piece, str):
                parts.append(piece)
    text = "".join(parts)
    return text if done and text else None


def next_turn_body(body: dict, answer: str) -> dict:
    """The client's body with its answer appended as the assistant's message (the prompt the next
    turn starts with)."""
    out = dict(body)
    out["messages"] = [*body["messages"], {"role": "assistant", "content": answer}]
    return out
