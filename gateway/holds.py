"""Requests held at the gateway until a prefill they follow is done (``Decision.hold_s``).

A policy that predicts a follower does better waiting for a prefill in flight than recomputing
it sets ``Decision.hold_s``: the predicted end of that prefill.  ``PrefillHolds.wait`` holds the
request until a first token from its replica makes the policy's ``hold_left`` 0 (the leader's
prompt is cached there), at most ``hold_s``; the request counts as in flight on the replica
meanwhile, so other decisions see it coming, and as ``held`` there: a request sent now queues
ahead of it.  ``first_token`` is the proxy's report of a first
token (streamed or not): it tells the policy and wakes the requests held on that replica, which
ask ``hold_left`` again.  The policy hooks are optional (``policies.base.BasePolicy`` has them).
"""

from __future__ import annotations

import asyncio

from policies.types import RequestFeatures

from .replicas import ReplicaPool


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class PrefillHolds:
    def __init__(self, pool: ReplicaPool, policy) -> None:
        self.pool = pool
        self._held: dict[str, set[asyncio.Future]] = {}  # replica -> requests waiting there
        self._on_first_token = getattr(policy, "on_first_token", None)
        self._hold_left = getattr(policy, "hold_left", None)

    async def wait(self, replica_id: str, hold_s: float, features: RequestFeatures) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + hold_s
        waiters = self._held.setdefault(replica_id, set())
        self.pool.begin(replica_id, held=True)
        try:
            while (left := deadline - loop.time()) > 0:
                woken = loop.create_future()
                timer = loop.call_later(left, _wake, woken)
                waiters.add(woken)
                try:
                    await woken
                finally:
                    timer.cancel()
                    waiters.discard(woken)
                if self._hold_left is None or self._hold_left(features, replica_id) <= 0:
                    break
        finally:
            self.pool.release(replica_id)
            self.pool.end(replica_id)

    def first_token(self, features: RequestFeatures, replica_id: str) -> None:
        if self._on_first_token is not None:
            self._on_first_token(features, replica_id)
        waiters = self._held.get(replica_id)
        if waiters:
            for woken in list(waiters):
                _wake(woken)
