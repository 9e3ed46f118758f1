"""Prefill-only requests that make a hot prefix's copy without a client waiting for it.

A policy that decides a prefix needs another copy (``cache_aware`` with ``warm_copies``) keeps
the request that triggered it with a replica holding the prefix and sets ``Decision.warm``: the
replica that should get the copy.  ``Warmer.start`` sends it there as a request of its own --
the client's body with one output token, not streamed, with the decision's pull hint when the
copy is pulled from a holder (``kv_transfer_params``) -- in the background:

* reported to the policy as a dispatch at once (``on_dispatch`` with the warm decision, before
  any other request is decided), so the next decisions see the copy being computed (a follower
  may hold for it, ``Decision.hold_s``) and no second copy is asked for;
* counted in the replica's in-flight load while it runs;
* its first (and only) token reported like a client request's (``PrefillHolds.first_token``:
  followers held for the copy are released), then ``on_complete`` with what the replica said
  it cached; a warm that fails is not retried (the index forgets what it did not compute);
* part of the replica's passive health like a client request: a refused connection, a timeout
  or a 502/503/504 counts toward ejection (``failed``, the proxy's), an answer resets the count.

The client's answer never waits for it, and its outcome never reaches the client.

``Warmer.start_turn`` sends the other kind (``gateway.turns``): once a conversation's turn is
answered, the prompt with the answer appended, to the replica that served it, when the policy's
``warm_turn`` takes it (a decision of reason ``warm-turn``); the same path from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable

import orjson

from policies.types import ClusterView, Decision, Outcome, RequestFeatures

from . import fastclient as fc
from .errors import KvgateError
from .features import CHAT, COMPLETION, ParsedRequest
from .holds import PrefillHolds
from .kvhints import pull_hint_body
from .replicas import ReplicaPool
from .turns import next_turn_body
from .upstream import RETRYABLE_STATUS, UpstreamClient, error_kind
from .wire import cached_tokens, usage_from_json

log = logging.getLogger("kvgate.warm")

# Fields that ask for more than one output token (or a stream), dropped from a warm's body.
_DROP = ("max_completion_tokens", "min_tokens", "stream_options", "n", "best_of", "logprobs",
         "top_logprobs", "echo")


WARM_KINDS = (CHAT, COMPLETION)  # routes with a generated answer to cut short


def warm_body(kind: str, body: dict) -> dict | None:
    """The body of a warm for a client's ``body``: the same prompt, one output token, no stream;
    None for a route without a generated answer to cut short (embeddings, responses)."""
    if kind not in WARM_KINDS:
        return None
    out = {k: v for k, v in body.items() if k not in _DROP}
    out["max_tokens"] = 1
    out["stream"] = False
    return out


class Warmer:
    """Sends the warms a policy asks for; one per proxy, built with it."""

    def __init__(self, pool: ReplicaPool, policy, client: UpstreamClient, holds: PrefillHolds,
                 counter, clock: Callable[[], float],
                 features_of: Callable[..., ParsedRequest] | None = None,
                 failed: Callable[[str, str], None] = lambda replica, kind: None) -> None:  # fmt: skip
        self.pool = pool
        self.policy = policy
        self.client = client
        self.holds = holds
        self.counter = counter  # kvgate_warm_requests_total{replica, outcome}
        self.clock = clock
        self.tasks: set[asyncio.Task] = set()
        self.features_of = features_of  # parse_body(body, headers) of a chat body
        self.warm_turn = getattr(policy, "warm_turn", None)
        self.failed = failed  # (replica, kind): counts toward the replica's passive ejection

    def start(self, parsed: ParsedRequest, path: str, headers: list[tuple[bytes, bytes]],
              warm: Decision, view: ClusterView) -> bool:  # fmt: skip
        """Report ``warm`` to the policy and send it in the background; False (nothing sent,
        nothing reported) when the route has no warm or the replica is gone."""
        rep = self.pool.get(warm.replica)
        if parsed.kind not in WARM_KINDS or rep is None:
            return False
        features = dataclasses.replace(parsed.features, max_tokens=1, session_key=None, stream=False)
        self.policy.on_dispatch(features, warm, view)  # now: before the next decision
        self.pool.begin(warm.replica)
        coro = self._run(rep.url, path, headers, parsed, features, warm)  # the body off this path
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return True

    def start_turn(self, turn: tuple, answer: str, replica: str, request_id: bytes) -> bool:
        """Warm a conversation's next turn (``gateway.turns``): the prompt of ``turn`` (parsed,
        path, headers) with ``answer`` appended, on ``replica``, if the policy takes it now."""
        parsed, path, headers = turn
        if self.warm_turn is None or self.features_of is None:
            return False
        body = next_turn_body(parsed.body, answer)
        try:
            nxt = self.features_of(body, {})
        except KvgateError:
            return False
        view = self.pool.snapshot(self.clock())
        warm = self.warm_turn(nxt.features, replica, view)
        if warm is None:
            return False
        hs = [h for h in headers if h[0] != b"x-request-id"] + [(b"x-request-id", request_id + b"-next")]
        return self.start(nxt, path, hs, warm, view)

    async def _run(self, url: str, path: str, headers, parsed: ParsedRequest,
                   features: RequestFeatures, warm: Decision) -> None:  # fmt: skip
        replica = warm.replica
        started = self.clock()
        ok = False
        ttft = None
        usage = None
        outcome = "error"
        try:
            plain = warm_body(parsed.kind, parsed.body)
            body = pull_hint_body(plain, warm, self.pool) or orjson.dumps(plain)
            resp = await self.client.request("POST", url, path, headers, body)
            try:
                data = await resp.aread()
            finally:
                await resp.aclose()
            ok = resp.status < 400
            outcome = "ok" if ok else f"status_{resp.status}"
            if resp.status in RETRYABLE_STATUS:
                self.failed(replica, outcome)
            elif ok:
                self.pool.record_success(replica)
            if ok:
                ttft = self.clock() - started
                usage = usage_from_json(data)
                self.holds.first_token(features, replica)
        except fc.HTTPError as exc:
            log.warning("warm failed", extra={"replica": replica, "error": str(exc)})
            self.failed(replica, error_kind(exc))
        finally:
            self.pool.end(replica)
            self.counter.labels(replica, outcome).inc()
            prompt = (usage or {}).get("prompt_tokens") or 0
            self.policy.on_complete(features, replica, Outcome(
                ok=ok, prompt_tokens=prompt if isinstance(prompt, int) else 0,
                cached_tokens=cached_tokens(usage), latency_s=self.clock() - started, ttft_s=ttft,
                predicted_cached_tokens=warm.predicted_cached_tokens,
            ))

    async def aclose(self) -> None:
        """Cancel the warms still in flight (shutdown)."""
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
