"""What every kvgate locustfile shares: the OpenAI-style client user, TTFT and cache accounting.

* :class:`KvgateUser` posts plain JSON to ``/v1/chat/completions`` (no openai SDK inside locust).
  Streaming requests are timed to their last byte, and the time to the first token (the first
  chunk with content or tool calls) is recorded as its own locust entry, type ``TTFT``.
* Every response's ``usage`` (``stream_options.include_usage`` when streaming) is added to the
  run's :data:`TALLY`: prompt tokens, ``prompt_tokens_details.cached_tokens`` and the replica that
  served it (``x-kvgate-replica``), per workload. At test stop the cached-token hit rate is
  printed (on the master) and written to ``--cache-report PATH`` (``.json`` and ``.csv``; by default
  ``<--csv prefix>_cache.json/.csv`` when ``--csv`` is given). Workers send their tallies to the
  master with their regular reports.

Options added to locust: ``--model`` (default tiny), ``--max-tokens`` (default 24),
``--api-key``, ``--cache-report``.
"""

from __future__ import annotations

import csv
import json
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from locust import HttpUser, events
from locust.runners import WorkerRunner

CHAT_PATH = "/v1/chat/completions"


# ------------------------------------------------------------------------------ accounting


@dataclass
class WorkloadTally:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replicas: dict[str, int] = field(default_factory=dict)

    def add(self, prompt: int, cached: int, replica: str | None) -> None:
        self.requests += 1
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        if replica:
            self.replicas[replica] = self.replicas.get(replica, 0) + 1

    def merge(self, other: dict) -> None:
        self.requests += int(other.get("requests", 0))
        self.prompt_tokens += int(other.get("prompt_tokens", 0))
        self.cached_tokens += int(other.get("cached_tokens", 0))
        for replica, n in (other.get("replicas") or {}).items():
            self.replicas[replica] = self.replicas.get(replica, 0) + int(n)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "hit_rate": round(self.hit_rate, 4),
            "replicas": dict(sorted(self.replicas.items())),
        }


class UsageTally:
    """Prompt and cached tokens per workload (greenlets are cooperative: no lock needed)."""

    def __init__(self) -> None:
        self.workloads: dict[str, WorkloadTally] = {}

    def add(self, workload: str, usage: dict, replica: str | None) -> None:
        details = usage.get("prompt_tokens_details") or {}
        tally = self.workloads.setdefault(workload, WorkloadTally())
        tally.add(int(usage.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0), replica)

    def total(self) -> WorkloadTally:
        out = WorkloadTally()
        for t in self.workloads.values():
            out.merge(t.as_dict())
        return out

    def drain(self) -> dict:
        data = {k: v.as_dict() for k, v in self.workloads.items()}
        self.workloads = {}
        return data

    def merge(self, data: dict | None) -> None:
        for workload, d in (data or {}).items():
            self.workloads.setdefault(workload, WorkloadTally()).merge(d)

    def report(self) -> dict[str, Any]:
        return {
            "total": self.total().as_dict(),
            "workloads": {k: v.as_dict() for k, v in sorted(self.workloads.items())},
        }

    def summary(self) -> str:
        lines = ["kvgate cached-token hit rate (usage.prompt_tokens_details.cached_tokens / prompt_tokens):"]
        rows = [*sorted(self.workloads.items()), ("total", self.total())]
        for name, t in rows:
            lines.append(
                f"  {name:<8} {t.hit_rate:7.1%}  {t.cached_tokens:>9} / {t.prompt_tokens:<9} tokens"
                f"  {t.requests} requests over {len(t.replicas)} replicas"
            )
        return "\n".join(lines)

    def write(self, path: str | Path) -> tuple[Path, Path]:
        """Write ``path`` as JSON and the same stem as CSV (one row per workload, then total)."""
        json_path = Path(path).with_suffix(".json")
        csv_path = json_path.with_suffix(".csv")
        json_path.parent.mkdir(parents=True, exist_ok=True)
        report = self.report()
        json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        with csv_path.open("w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(["workload", "requests", "prompt_tokens", "cached_tokens", "hit_rate"])
            for name, d in [*report["workloads"].items(), ("total", report["total"])]:
                w.writerow([name, d["requests"], d["prompt_tokens"], d["cached_tokens"], d["hit_rate"]])
        return json_path, csv_path


TALLY = UsageTally()


# ------------------------------------------------------------------------------ locust hooks


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    group = parser.add_argument_group("kvgate")
    group.add_argument("--model", default="tiny", help="model name to request (default tiny)")
    group.add_argument("--max-tokens", type=int, default=24, help="max_tokens per request (default 24)")
    group.add_argument("--api-key", default="none", help="bearer token sent to the gateway")
    group.add_argument("--cache-report", default="",
                       help="write the cached-token report here (.json and .csv; default <--csv>_cache)")


@events.report_to_master.add_listener
def _send_tally(client_id, data) -> None:
    data["kvgate_usage"] = TALLY.drain()


@events.worker_report.add_listener
def _receive_tally(client_id, data) -> None:
    TALLY.merge(data.get("kvgate_usage"))


@events.test_start.add_listener
def _reset(environment, **_kwargs) -> None:
    TALLY.drain()


@events.test_stop.add_listener
def _report(environment, **_kwargs) -> None:
    if isinstance(environment.runner, WorkerRunner):
        return
    print(TALLY.summary(), flush=True)
    opts = environment.parsed_options
    path = getattr(opts, "cache_report", "") or ""
    if not path and getattr(opts, "csv_prefix", None):
        path = f"{opts.csv_prefix}_cache.json"
    if path:
        json_path, csv_path = TALLY.write(path)
        print(f"kvgate cache report: {json_path} {csv_path}", flush=True)


# ------------------------------------------------------------------------------ SSE


class StreamError(Exception):
    """The stream broke the OpenAI streaming contract (error event, no [DONE], bad JSON)."""


DONE = object()


def sse_events(chunks: Iterable[bytes]) -> Iterator[Any]:
    """Parsed ``data:`` payloads of an SSE byte stream; :data:`DONE` for ``[DONE]``."""
    buf = b""
    event_name = ""
    for chunk in chunks:
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.rstrip(b"\r")
            if line.startswith(b"event:"):
                event_name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    yield DONE
                    return
                try:
                    data = json.loads(payload)
                except ValueError as exc:
                    raise StreamError(f"bad JSON in stream: {payload[:120]!r}") from exc
                if event_name == "error" or (isinstance(data, dict) and "error" in data):
                    raise StreamError(f"error event: {json.dumps(data)[:300]}")
                yield data
            elif not line:
                event_name = ""


# ------------------------------------------------------------------------------ the user


@dataclass
class Reply:
    text: str
    usage: dict
    replica: str | None


class KvgateUser(HttpUser):
    """An OpenAI client speaking plain JSON to kvgate (or any OpenAI-compatible server)."""

    abstract = True
    workload = "base"

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.model = getattr(opts, "model", None) or "tiny"
        self.max_tokens = int(getattr(opts, "max_tokens", None) or 24)
        self.api_key = getattr(opts, "api_key", None) or "none"
        self.user_id = uuid.uuid4().hex[:12]

    def chat(
        self, messages: list[dict], *, stream: bool, headers: dict | None = None, **extra: Any
    ) -> Reply | None:
        """One chat completion; None when it failed (already reported to locust as a failure)."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens, **extra}
        hdrs = {"authorization": f"Bearer {self.api_key}", **(headers or {})}
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
            return self._stream(body, hdrs)
        name = f"{CHAT_PATH} [{self.workload}]"
        with self.client.post(CHAT_PATH, json=body, headers=hdrs, name=name, catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:300]}")
                return None
            try:
                data = resp.json()
                text = data["choices"][0]["message"].get("content") or ""
                usage = data["usage"]
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                resp.failure(f"not a chat completion: {exc!r}")
                return None
            return self._done(resp, text, usage)

    def _stream(self, body: dict, headers: dict) -> Reply | None:
        name = f"{CHAT_PATH} [{self.workload}, stream]"
        start = time.perf_counter()
        with self.client.post(CHAT_PATH, json=body, headers=headers, name=name, stream=True,
                              catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:300]}")
                return None
            ttft_ms = None
            pieces: list[str] = []
            usage = None
            done = False
            try:
                for event in sse_events(resp.iter_content(chunk_size=None)):
                    if event is DONE:
                        done = True
                        break
                    for choice in event.get("choices") or []:
                        delta = choice.get("delta") or {}
                        if ttft_ms is None and (delta.get("content") or delta.get("tool_calls")):
                            ttft_ms = (time.perf_counter() - start) * 1000
                        pieces.append(delta.get("content") or "")
                    if event.get("usage"):
                        usage = event["usage"]
            except (StreamError, OSError, ValueError) as exc:
                resp.failure(f"stream broken: {exc}")
                return None
            finally:
                # Locust timed the headers only: make the entry the time to the last byte.
                resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            if not done:
                resp.failure("stream ended without [DONE]")
                return None
            if usage is None:
                resp.failure("stream had no usage chunk (stream_options.include_usage)")
                return None
            if ttft_ms is not None:
                self.environment.events.request.fire(
                    request_type="TTFT", name=self.workload, response_time=ttft_ms,
                    response_length=0, exception=None, context={},
                )
            return self._done(resp, "".join(pieces), usage)

    def _done(self, resp, text: str, usage: dict) -> Reply:
        replica = resp.headers.get("x-kvgate-replica")
        TALLY.add(self.workload, usage, replica)
        resp.success()
        return Reply(text, usage, replica)
