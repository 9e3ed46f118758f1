"""Open-loop load generator for the routing benchmark: sends a workload's script on time.

Each request streams (with ``stream_options.include_usage``) so TTFT is the time to the first body
byte and the cached tokens come from the final usage chunk.  A request with ``after`` waits for
that request's answer first (multi-turn sessions), then for its own arrival time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import orjson

from .workloads import BenchRequest, Workload


@dataclass
class Result:
    seq: int
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: str = ""
    error: str = ""


def _usage_of(buf: bytes) -> dict:
    idx = buf.rfind(b'"usage":{')
    if idx < 0:
        return {}
    start = buf.rfind(b"data: ", 0, idx)
    end = buf.find(b"\n", idx)
    try:
        return orjson.loads(buf[start + 6 : end if end > 0 else None]).get("usage") or {}
    except orjson.JSONDecodeError:
        return {}


async def _one(client: httpx.AsyncClient, url: str, req: BenchRequest, model: str) -> Result:
    body = {
        "model": model, "messages": list(req.messages), "max_tokens": req.max_tokens,
        "stream": True, "stream_options": {"include_usage": True},
    }
    headers = {"x-session-id": req.session} if req.session else {}
    start = time.perf_counter()
    ttft = None
    tail = b""
    try:
        async with client.stream("POST", url + "/v1/chat/completions", content=orjson.dumps(body),
                                 headers={"content-type": "application/json", **headers}) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return Result(req.seq, False, error=f"status {resp.status_code}: {resp.text[:200]}")
            async for chunk in resp.aiter_raw():
                if ttft is None:
                    ttft = time.perf_counter() - start
                tail = (tail + chunk)[-8192:]
            replica = resp.headers.get("x-kvgate-replica", "")
    except httpx.HTTPError as exc:
        return Result(req.seq, False, error=f"{type(exc).__name__}: {exc}")
    e2e = time.perf_counter() - start
    usage = _usage_of(tail)
    details = usage.get("prompt_tokens_details") or {}
    ok = b"[DONE]" in tail and bool(usage)
    return Result(req.seq, ok, ttft or e2e, e2e, usage.get("prompt_tokens", 0),
                  details.get("cached_tokens", 0) or 0, replica, "" if ok else "incomplete stream")


async def run_workload(
    workload: Workload,
    route: Callable[[BenchRequest], str],
    *,
    timeout_s: float = 60.0,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[Result], float]:
    """Send every request of ``workload`` to ``route(req)``; returns results and wall time."""
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    done_events: dict[int, asyncio.Event] = {r.seq: asyncio.Event() for r in workload.requests}
    results: list[Result] = []
    total = len(workload.requests)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()

        async def fire(req: BenchRequest) -> None:
            if req.after is not None:
                await done_events[req.after].wait()
            delay = req.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)  # open-loop schedule: the arrival time is the workload's
            try:
                results.append(await _one(client, route(req), req, workload.model))
            finally:
                done_events[req.seq].set()
                if progress:
                    progress(len(results), total)

        with paused_gc():
            await asyncio.gather(*(fire(r) for r in workload.requests))
        wall = time.perf_counter() - t0
    results.sort(key=lambda r: r.seq)
    return results, wall


@contextlib.contextmanager
def paused_gc():
    """No cyclic GC in the load generator while it measures: its collections stopped it for up
    to 12 ms mid-run (a gen-1 pass over httpx's per-request objects), late on every response it
    was reading, whichever target it measured.  The garbage is collected after the run."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
        gc.collect()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
