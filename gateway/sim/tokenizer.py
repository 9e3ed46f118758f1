"""The simulator's cheap deterministic tokenizer and chat template.

Tokenizer.  ``_PIECE`` cuts text into an optional leading space plus a run of word characters, an
optional leading space plus a run of punctuation, or a run of whitespace (so ``"".join(pieces) ==
text``; about one token per 4-5 characters of English, like a BPE).  A piece's id is the low 31
bits of ``xxh3_64(piece.encode())``; a :class:`Tokenizer` memoises ids in a bounded dict, so a
128 KB prompt tokenizes in a few milliseconds.  The same text gives the same ids in every process.

Segments.  The chat template renders each message as one segment that starts with ``<|`` and
ends with ``|>\n``, so no piece ever spans two segments and the tokens of a prompt are the
concatenation of its segments' tokens.  ``Tokenizer.encode_segments`` memoises segments (bounded by a
total token budget): a shared system prompt or conversation history is tokenized once.

Chat template (ChatML-like, always with the generation prompt)::

    <|im_start|>tools\\n{tools as sorted JSON}<|im_end|>\\n      (only when tools are given)
    <|im_start|>{role}\\n{content}[{tool_calls as JSON}]<|im_end|>\\n   (each message, in order)
    <|im_start|>assistant\\n

Content lists keep their text parts; other parts (images, audio) are rendered as sorted JSON.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Sequence

import orjson
import xxhash

_PIECE = re.compile(r" ?\w+| ?[^\w\s]+|\s+")
_ID_MASK = 0x7FFFFFFF

_xxh3 = xxhash.xxh3_64_intdigest


def tokenize(text: str) -> list[int]:
    """Token ids of ``text`` (deterministic, see module header; no memo)."""
    return [_xxh3(piece.encode()) & _ID_MASK for piece in _PIECE.findall(text)]


class Tokenizer:
    """:func:`tokenize` with its memos: piece -> id (bounded by ``max_pieces``) and segment ->
    ids (bounded by ``segment_budget`` tokens).  Each simulated engine owns one, as a real
    engine owns its tokenizer, and empties it on reset: a benchmark that resets the replicas
    between targets then makes every target pay the same tokenizing work."""

    def __init__(self, max_pieces: int = 1 << 19, segment_budget: int = 1 << 21) -> None:
        self.max_pieces = max_pieces
        self.segment_budget = segment_budget
        self._memo: dict[str, int] = {}
        self._segments: dict[str, array] = {}
        self._segment_tokens = 0

    @property
    def memoised_tokens(self) -> int:
        """Tokens held by the segment memo (0 after :meth:`clear`)."""
        return self._segment_tokens

    def clear(self) -> None:
        self._memo.clear()
        self._segments.clear()
        self._segment_tokens = 0

    def tokenize(self, text: str) -> list[int]:
        memo = self._memo
        pieces = _PIECE.findall(text)
        ids = list(map(memo.get, pieces))
        if None in ids:
            for i, tid in enumerate(ids):
                if tid is None:
                    if len(memo) >= self.max_pieces:
                        memo.clear()
                    ids[i] = memo[pieces[i]] = _xxh3(pieces[i].encode()) & _ID_MASK
        return ids  # type: ignore[return-value]

    def encode_segments(self, segments: Sequence[str]) -> array:
        """Token ids (``array('I')``) of ``"".join(segments)``, memoising each segment."""
        out = array("I")
        for seg in segments:
            ids = self._segments.get(seg)
            if ids is None:
                ids = array("I", self.tokenize(seg))
                if self._segment_tokens + len(ids) > self.segment_budget:
                    self._segments.clear()
                    self._segment_tokens = 0
                if len(ids) <= self.segment_budget // 4:
                    self._segments[seg] = ids
                    self._segment_tokens += len(ids)
            out += ids
        return out


def pieces(text: str) -> list[str]:
    """The text of each token of ``text`` (for tests and debugging)."""
    return _PIECE.findall(text)


class PromptError(ValueError):
    """A request whose messages/prompt cannot be rendered (answered 400)."""


def _json(value: object) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _content_text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out: list[str] = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                text = part.get("text", "")
                out.append(text if isinstance(text, str) else _json(text))
            elif isinstance(part, str):
                out.append(part)
            else:
                out.append(_json(part))
        return "".join(out)
    raise PromptError("message content must be a string, a list of parts or null")


def render_chat_prompt(messages: Sequence[object], tools: object = None) -> str:
    """The prompt string the simulator's chat template makes of ``messages`` (see header)."""
    return "".join(render_chat_segments(messages, tools))


def render_chat_segments(messages: Sequence[object], tools: object = None) -> list[str]:
    """The chat template's output, one segment per message (see header)."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty array")
    out: list[str] = []
    if tools:
        try:
            out.append(f"<|im_start|>tools\n{_json(tools)}<|im_end|>\n")
        except TypeError as exc:
            raise PromptError("'tools' cannot be serialised") from exc
    for msg in messages:
        if not isinstance(msg, dict):
            raise PromptError("each message must be an object")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise PromptError("each message needs a string 'role'")
        text = _content_text(msg.get("content"))
        calls = msg.get("tool_calls")
        if calls:
            try:
                text += _json(calls)
            except TypeError as exc:
                raise PromptError("'tool_calls' cannot be serialised") from exc
        out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return out


def completion_prompt(prompt: object) -> tuple[str, list[int] | None]:
    """``(prompt_text, token_ids)`` for a completions ``prompt``.

    A string is the text; a list of ints is taken as token ids (its text, for the output seed, is
    the ids joined by spaces); a list of strings is joined by newlines (the simulator answers a
    batch prompt with one choice).
    """
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in prompt):
            if any(p > 0xFFFFFFFF for p in prompt):
                raise PromptError("token ids must fit in 32 bits")
            return " ".join(map(str, prompt)), list(prompt)
        if all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt), None
    raise PromptError("'prompt' must be a string, an array of strings or an array of token ids")
