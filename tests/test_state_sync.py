"""StateSync over a shared store, on both backends: propagation, catch-up, load, outages."""

from __future__ import annotations

import contextlib

from gateway.config import ReplicaConfig
from gateway.replicas import ReplicaPool
from gateway.state import Backoff, StateSync, SyncSettings
from policies import PolicyDeps
from tests.test_state_store import until

FAST = SyncSettings(
    heartbeat_s=0.05, load_ttl_s=0.4, block_s=0.2, op_timeout_s=0.5, catchup_timeout_s=1.0,
    backoff=Backoff(base_s=0.02, cap_s=0.2),
)
CHAIN = (11, 12, 13, 14)


def pool(*ids: str) -> ReplicaPool:
    return ReplicaPool([ReplicaConfig(f"http://{i}", id=i) for i in ids])


@contextlib.asynccontextmanager
async def syncs(backend, n: int = 2, pools=None, settings: SyncSettings = FAST, **store_kw):
    started = []
    try:
        for i in range(n):
            s = StateSync(backend.store(**store_kw), PolicyDeps(), pools[i] if pools else None,
                          gateway_id=f"gw{i}", settings=settings)
            await s.start(wait_s=5.0)
            started.append(s)
        yield started
    finally:
        for s in started:
            await s.stop(flush_s=0.5)


async def test_a_decision_on_one_gateway_reaches_the_other(backend):
    async with syncs(backend) as (a, b):
        assert a.caught_up and b.caught_up and a.ready() and b.ready()
        a.record("r2", CHAIN, "sess-1")
        await until(lambda: b.index.match(CHAIN) == {"r2": 4}, what="index propagation")
        assert b.sessions.peek("sess-1") == "r2"
        # Its own event comes back to A only as the session binding, never a second index insert.
        await until(lambda: a.sessions.peek("sess-1") == "r2", what="own binding")
        assert a.index.match(CHAIN) == {}
        assert await a.store.get_session("sess-1") == "r2"
        assert a.stats["published"] == 1 and b.stats["applied"] == 1 and a.stats["applied"] == 0


async def test_many_events_arrive_in_order_batched(backend):
    async with syncs(backend) as (a, b):
        for i in range(2000):
            a.record(f"r{i % 3}", (i, i + 1_000_000), f"s{i % 50}")
        await until(lambda: b.stats["applied"] == 2000, what="all applied")
        for k in range(50):
            last = max(i for i in range(2000) if i % 50 == k)
            assert b.sessions.peek(f"s{k}") == f"r{last % 3}"
        assert a.stats["dropped"] == 0 and b.stats["duplicates"] == 0


async def test_concurrent_rebinds_converge_on_every_gateway(backend):
    async with syncs(backend, 3) as gws:
        for round_ in range(20):
            for i, g in enumerate(gws):
                g.record(f"r{(i + round_) % 3}", (), "contested")
        await until(lambda: all(g.stats["published"] == 20 for g in gws), what="published")
        stream = await gws[0].store.read("0-0", 10_000, 0)
        final = [e.replica for _, e in stream if e.session == "contested"][-1]
        await until(lambda: all(g.sessions.peek("contested") == final for g in gws),
                    what="convergence on the stream's last binding")


async def test_a_late_gateway_catches_up_before_it_is_ready(backend):
    async with syncs(backend, 1) as (a,):
        for i in range(300):
            a.record("r1", (10**6 + 2 * i, 10**6 + 2 * i + 1), f"late-{i}")
        await until(lambda: a.stats["published"] == 300, what="published")
        async with syncs(backend, 1) as (c,):
            assert c.caught_up and c.ready()
            assert c.stats["applied"] == 300 and c.stats["snapshots"] == 0
            assert all(c.sessions.peek(f"late-{i}") == "r1" for i in range(300))
            assert c.index.match((10**6 + 598, 10**6 + 599)) == {"r1": 2}


async def test_a_trimmed_stream_is_completed_from_the_session_snapshot(backend):
    async with syncs(backend, 1, maxlen=10) as (a,):
        for i in range(400):  # Redis trims whole stream nodes (100 entries): well past maxlen
            a.record(f"r{i % 2}", (i,), f"old-{i}")
        await until(lambda: a.stats["published"] == 400, what="published")
        assert (await a.store.info()).trimmed
        async with syncs(backend, 1, maxlen=10) as (c,):
            assert c.caught_up and c.stats["snapshots"] == 1
            assert c.stats["applied"] < 400
            assert all(c.sessions.peek(f"old-{i}") == f"r{i % 2}" for i in range(400))


async def test_cluster_wide_load_and_dead_gateways_expire(backend):
    pa, pb = pool("r1", "r2"), pool("r1", "r2")
    async with syncs(backend, pools=[pa, pb]) as (a, b):
        for _ in range(3):
            pa.begin("r1")
        pb.begin("r2")
        await until(lambda: pb.get("r1").remote_in_flight == 3, what="A's load seen by B")
        assert pb.snapshot().by_id("r1").in_flight == 3
        assert pb.snapshot().by_id("r2").in_flight == 1  # its own, not counted twice
        await until(lambda: pa.get("r2").remote_in_flight == 1, what="B's load seen by A")
        assert pa.get("r1").remote_in_flight == 0
        await a.abort()  # a crash: no goodbye, the heartbeat just stops
        await until(lambda: pb.get("r1").remote_in_flight == 0, what="dead gateway's load expiring")
        assert b.status()["remote_gateways"] == 0


async def test_outage_keeps_local_state_and_republishes_after(backend):
    async with syncs(backend) as (a, b):
        a.record("r1", CHAIN, "before")
        await until(lambda: b.sessions.peek("before") == "r1", what="first event")
        backend.outage_start()
        try:
            a.record("r2", (21, 22), "during")
            await until(lambda: not a.link.up and not b.link.up, what="both see the outage")
            assert a.status()["status"] == "degraded" and a.status()["last_error"]
            a.record("r3", (31, 32), "during-2")
            assert a.status()["outbox"] >= 1
            assert b.index.match(CHAIN) == {"r1": 4}  # the local view still answers
        finally:
            backend.outage_end()
        await until(lambda: b.sessions.peek("during-2") == "r3", what="republished after outage")
        stream = [(i, e.seq, e.session) for i, e in await b.store.read("0-0", 100, 0)]
        assert b.sessions.peek("during") == "r2", (b.stats, a.stats, stream)
        assert b.index.match((21, 22)) == {"r2": 2}, (b.stats, a.stats, stream)
        assert a.link.up and b.link.up and a.status()["outbox"] == 0
        assert a.m.errors.labels("publish")._value.get() >= 1


async def test_a_full_outbox_drops_the_oldest_and_keeps_the_newest(backend):
    small = SyncSettings(**{**FAST.__dict__, "outbox_max": 50})
    async with syncs(backend, settings=small) as (a, b):
        backend.outage_start()
        try:
            a.record("r0", (), "probe")
            await until(lambda: not a.link.up, what="A sees the outage")
            for i in range(80):
                a.record("r1", (1000 + i,), f"o{i}")
            assert a.status()["outbox"] == 50
            assert a.stats["dropped"] >= 30
        finally:
            backend.outage_end()
        await until(lambda: b.sessions.peek("o79") == "r1", what="newest events delivered")
        assert b.sessions.peek("o0") is None and b.sessions.peek("o30") == "r1"


async def test_a_gateway_starting_while_the_store_is_down_becomes_ready_cold(backend):
    backend.outage_start()
    try:
        s = StateSync(backend.store(), PolicyDeps(), None, "cold", settings=FAST)
        await s.start(wait_s=0.1)
        try:
            assert not s.caught_up and not s.ready() and not s.link.up
            await until(s.ready, what="ready after catchup_timeout_s")
            s.record("r1", (1,), "x")  # the request path never blocks on the store
        finally:
            await s.stop()
    finally:
        backend.outage_end()
