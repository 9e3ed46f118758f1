"""One contract, two backends: every test here runs on MemoryStore and on a real redis-server."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.state import Event, StoreUnavailable
from gateway.state.events import ZERO_ID, parse_id

H = (2**64 - 1, 1, 12345678901234567890)


def ev(replica: str = "r1", hashes=H, session: str | None = "s1", seq: int = 1) -> Event:
    return Event(replica, tuple(hashes), session, "gw-a", "nonce-a", seq, 1_700_000_000_000)


async def until(cond, timeout: float = 5.0, what: str = "condition"):
    """Poll an async or sync condition until it holds (bounded); returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_publish_then_read_in_order_and_round_trip(backend):
    store = backend.store()
    events = [ev(f"r{i}", H[: i % 4], f"s{i}" if i % 2 else None, i) for i in range(1, 8)]
    await store.publish(events, 60)
    got = await store.read(ZERO_ID, 100, 0)
    assert [e for _, e in got] == events
    ids = [parse_id(i) for i, _ in got]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    rest = await store.read(got[2][0], 100, 0)
    assert [e for _, e in rest] == events[3:]
    assert await store.read(got[-1][0], 100, 0) == []
    assert [e for _, e in await store.read(ZERO_ID, 2, 0)] == events[:2]


async def test_blocked_read_wakes_on_publish(backend):
    writer, reader = backend.store(), backend.store()
    await writer.publish([ev(seq=1)], 60)
    last = (await reader.read(ZERO_ID, 10, 0))[-1][0]
    task = asyncio.create_task(reader.read(last, 10, 5.0))
    await asyncio.sleep(0)  # let the read start blocking
    t0 = time.monotonic()
    await writer.publish([ev("r2", seq=2)], 60)
    got = await asyncio.wait_for(task, 5.0)
    assert [e.replica for _, e in got] == ["r2"]
    assert time.monotonic() - t0 < 1.0


async def test_empty_blocked_read_returns_after_block(backend):
    store = backend.store()
    t0 = time.monotonic()
    assert await store.read(ZERO_ID, 10, 0.1) == []
    assert 0.05 <= time.monotonic() - t0 < 2.0


async def test_info_reports_length_last_id_and_trimming(backend):
    store = backend.store(maxlen=5)
    assert (await store.info()).exists is False
    await store.publish([ev(seq=i) for i in range(1, 4)], 60)
    info = await store.info()
    assert info.exists and info.length == 3 and not info.trimmed
    assert info.last_id == (await store.read(ZERO_ID, 10, 0))[-1][0]
    for i in range(4, 400):
        await store.publish([ev(seq=i)], 60)
    info = await store.info()
    assert info.trimmed and info.length < 399
    first = (await store.read(ZERO_ID, 1, 0))[0]
    assert first[0] == info.first_id and first[1].seq > 1


async def test_sessions_are_bound_refreshed_and_expire(backend):
    store = backend.store()
    await store.publish([ev("r1", session="a"), ev("r2", session="b"), ev("r3", session="a")], 60)
    assert await store.get_session("a") == "r3"
    assert dict([kv async for kv in store.sessions()]) == {"a": "r3", "b": "r2"}
    await store.publish([ev("r9", session="short")], 0.05)
    assert await store.get_session("short") == "r9"
    await until(lambda: _gone(store, "short"), what="session expiry")
    assert await store.get_session("a") == "r3"


async def _gone(store, key):
    return await store.get_session(key) is None


async def test_load_is_per_gateway_and_expires(backend):
    store = backend.store()
    await store.publish_load("gw-a", {"r1": 3, "r2": 0}, 60)
    await store.publish_load("gw-b", {}, 60)
    assert await store.read_load() == {"gw-a": {"r1": 3, "r2": 0}, "gw-b": {}}
    await store.publish_load("gw-a", {"r1": 1}, 60)  # replaces, not merges
    assert (await store.read_load())["gw-a"] == {"r1": 1}
    await store.drop_load("gw-b")
    assert set(await store.read_load()) == {"gw-a"}
    await store.publish_load("gw-dead", {"r1": 7}, 0.05)
    await until(lambda: _no_gateway(store, "gw-dead"), what="load expiry")


async def _no_gateway(store, gw):
    return gw not in await store.read_load()


async def test_unreachable_store_raises_promptly_and_recovers(backend):
    store = backend.store(op_timeout_s=0.3)
    await store.publish([ev(seq=1)], 60)
    backend.outage_start()
    for call in (store.ping(), store.publish([ev(seq=2)], 60), store.read(ZERO_ID, 1, 0.1),
                 store.info(), store.read_load(), store.publish_load("g", {}, 1)):
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await asyncio.wait_for(call, 5.0)
        assert time.monotonic() - t0 < 2.0
    backend.outage_end()
    await until(lambda: _pings(store), what="reconnect")
    await store.publish([ev("after", seq=3)], 60)
    got = [e.replica for _, e in await store.read(ZERO_ID, 10, 0)]
    assert got[-1] == "after"


async def _pings(store) -> bool:
    try:
        await store.ping()
    except StoreUnavailable:
        return False
    return True


async def test_blocked_read_fails_when_the_store_goes_away(backend):
    store = backend.store()
    await store.publish([ev(seq=1)], 60)
    last = (await store.read(ZERO_ID, 10, 0))[-1][0]
    task = asyncio.create_task(store.read(last, 10, 1.0))
    await asyncio.sleep(0)
    backend.outage_start()
    try:
        with pytest.raises(StoreUnavailable):
            await asyncio.wait_for(task, 5.0)
    finally:
        backend.outage_end()
