"""SoloSync: the shared-state link of a gateway that shares nothing.

A gateway started with no Redis URL and no store handed to it (``kvgate serve`` alone) gets an
embedded store that no other gateway can ever read: publishing its routing history there, tailing it
back and heart-beating its load would keep a copy of what its own local view (``PrefixIndex``,
``SessionTable``) already holds, at a few tens of microseconds of this event loop's CPU per request
(an outbox append, a flusher wake, a publish, a tailer wake, an apply: about 0.1 ms of added
latency per request at one connection, measured with ``wrk`` through the proxy).  So such a gateway
runs no sync at all: :class:`SoloSync` has :class:`~gateway.state.sync.StateSync`'s surface for
the app (status, readiness, gauges) and does nothing else.  Several gateways in one process sharing
one ``MemoryStore`` (``kvgate demo --gateways 2``, the tests) pass the store in and keep the full
sync.
"""

from __future__ import annotations

from .metrics import StateMetrics
from .store import Store


class SoloSync:
    """Always up and caught up; never publishes, reads or heart-beats."""

    shared = False

    def __init__(self, store: Store, gateway_id: str, metrics: StateMetrics | None = None) -> None:
        self.store = store
        self.gateway_id = gateway_id
        self.m = metrics or StateMetrics()
        self.stats = dict.fromkeys(
            ("published", "applied", "dropped", "duplicates", "malformed", "gaps", "snapshots"), 0
        )
        self.m.up.labels(store.backend).set(1)
        self.m.caught_up.set(1)

    def record(self, replica: str, hashes: tuple[int, ...], session: str | None) -> None:
        """Nothing to share (the app does not even wrap its policy to call this)."""

    async def start(self, wait_s: float = 0.0) -> None:
        pass

    async def abort(self) -> None:
        pass

    async def stop(self, flush_s: float = 1.0) -> None:
        pass

    @property
    def caught_up(self) -> bool:
        return True

    def ready(self) -> bool:
        return True

    def refresh_gauges(self) -> None:
        self.m.outbox.set(0)

    def status(self) -> dict:
        return {
            "backend": self.store.backend,
            "shared": False,
            "gateway_id": self.gateway_id,
            "up": True,
            "status": "ok",
            "caught_up": True,
            "down_for_s": 0.0,
            "last_error": "",
            "outbox": 0,
            "last_id": "0-0",
            "remote_gateways": 0,
            **self.stats,
        }
