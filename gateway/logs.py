"""Structured JSON logs (one object per line) for the gateway."""

from __future__ import annotations

import logging
import sys
import time

import orjson

_STD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def setup_logging(level: str = "info", stream=None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("kvgate")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def rounded(value: float | None, digits: int = 2) -> float | None:
    """A figure for a log line (None stays None: the field is unknown)."""
    return None if value is None else round(value, digits)


def access_fields(ex, policy: str, cached: int | None, elapsed_s: float) -> dict:
    """The access log line of a finished exchange (``gateway.proxy``): where it went and why,
    what the policy predicted for its first choice (``cache_aware``'s TTFT, queue and cached
    tokens) and what happened."""
    decision = ex.decision
    scores = decision.scores
    return {
        "request_id": ex.request_id, "route": ex.route, "status": ex.status,
        "replica": ex.replica, "policy": policy, "reason": decision.reason,
        "predicted_ttft_ms": rounded(scores.get("ttft_ms")),
        "predicted_queue_ms": rounded(scores.get("queue_ms")),
        "predicted_cached_tokens": decision.predicted_cached_tokens,
        "hold_ms": round(decision.hold_s * 1000, 2), "cached_tokens": cached,
        "attempts": ex.attempts, "model": ex.features.model,
        "duration_ms": round(elapsed_s * 1000, 2),
        "ttft_ms": None if ex.ttft is None else round(ex.ttft * 1000, 2),
    }
