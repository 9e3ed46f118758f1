"""SessionTable: TTL on an injected clock (no sleeping), refresh on use, LRU bound, reverse index."""

from __future__ import annotations

import pytest

from policies.sessions import SessionTable


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_binding_expires_after_ttl() -> None:
    clock = FakeClock()
    table = SessionTable(ttl_s=10, clock=clock)
    table.bind("s", "r1")
    clock.t += 9.9
    assert table.peek("s") == "r1"
    clock.t += 0.2
    assert table.peek("s") is None
    assert table.get("s") is None
    assert len(table) == 0  # get deleted the expired entry


def test_get_and_bind_refresh_the_ttl_but_peek_does_not() -> None:
    clock = FakeClock()
    table = SessionTable(ttl_s=10, clock=clock)
    table.bind("a", "r1")
    table.bind("b", "r2")
    clock.t += 8
    assert table.get("a") == "r1"  # refreshed to t+18
    assert table.peek("b") == "r2"  # not refreshed: expires at t+10
    clock.t += 8
    assert table.peek("a") == "r1"
    assert table.peek("b") is None
    table.bind("a", "r1")
    clock.t += 9
    assert "a" in table


def test_rebinding_moves_the_session_between_replicas() -> None:
    table = SessionTable(clock=FakeClock())
    table.bind("s", "r1")
    table.bind("s", "r2")
    assert table.peek("s") == "r2"
    assert table.sessions_on("r1") == 0
    assert table.sessions_on("r2") == 1
    assert table.drop_replica("r1") == 0
    assert table.peek("s") == "r2"


def test_size_is_bounded_by_evicting_the_least_recently_used() -> None:
    clock = FakeClock()
    table = SessionTable(max_sessions=3, clock=clock)
    for key in "abc":
        table.bind(key, "r1")
        clock.t += 1
    table.get("a")  # a is now the most recently used
    table.bind("d", "r2")
    assert len(table) == 3
    assert table.peek("b") is None
    assert [table.peek(k) for k in "acd"] == ["r1", "r1", "r2"]
    assert table.stats()["per_replica"] == {"r1": 2, "r2": 1}


def test_drop_replica_unbinds_only_its_sessions() -> None:
    table = SessionTable(clock=FakeClock())
    for i in range(10):
        table.bind(f"s{i}", f"r{i % 3}")
    assert table.drop_replica("r1") == 3
    assert len(table) == 7
    assert all(table.peek(f"s{i}") is None for i in (1, 4, 7))
    assert table.peek("s0") == "r0"
    assert table.drop_replica("r1") == 0


def test_forget_and_expire_sweep() -> None:
    clock = FakeClock()
    table = SessionTable(ttl_s=5, clock=clock)
    table.bind("a", "r1")
    table.bind("b", "r1")
    assert table.forget("a") is True
    assert table.forget("a") is False
    clock.t += 3
    table.bind("c", "r2")
    clock.t += 3  # b expired, c not
    assert table.expire() == 1
    assert len(table) == 1
    assert table.sessions_on("r1") == 0
    assert table.peek("c") == "r2"


def test_bind_purges_expired_heads_lazily() -> None:
    clock = FakeClock()
    table = SessionTable(ttl_s=1, clock=clock)
    for i in range(5):
        table.bind(i, "r1")  # int keys work too
    clock.t += 2
    table.bind("new", "r2")
    assert len(table) == 1


def test_constructor_validates() -> None:
    with pytest.raises(ValueError):
        SessionTable(ttl_s=0)
    with pytest.raises(ValueError):
        SessionTable(max_sessions=0)
