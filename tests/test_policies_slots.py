"""``SlotTimeline``: when a new request gets a slot on a replica, from the requests sent there."""

from __future__ import annotations

import pytest

from policies.slots import SlotTimeline


def test_the_ahead_th_earliest_end_frees_the_slot() -> None:
    t = SlotTimeline()
    for token, end in enumerate([0.9, 0.3, 0.5, 0.7]):
        t.start("r0", token, end)
    assert t.wait_s("r0", 0, now=0.0, slot_s=0.1) == 0.0
    assert t.wait_s("r0", 1, now=0.0, slot_s=0.1) == pytest.approx(0.3)
    assert t.wait_s("r0", 3, now=0.1, slot_s=0.1) == pytest.approx(0.6)
    assert t.wait_s("r0", 6, now=0.0, slot_s=0.1) == pytest.approx(0.9 + 2 * 0.1)  # 2 unknown
    assert t.wait_s("r0", 1, now=0.4, slot_s=0.1) == pytest.approx(0.1)  # 0.5 is next; 0.3 late
    assert t.wait_s("r0", 1, now=0.45, slot_s=0.1) == pytest.approx(0.05)
    assert t.wait_s("r0", 1, now=2.0, slot_s=0.5) == pytest.approx(0.5)  # all late: a slot each
    assert t.wait_s("r1", 2, now=0.0, slot_s=0.1) == pytest.approx(0.2)  # nothing recorded


def test_a_request_ends_wherever_it_was_recorded_and_the_size_is_bounded() -> None:
    t = SlotTimeline(per_replica=3)
    t.start("r0", 1, 0.5)
    t.start("r1", 1, 0.8)  # the same request retried elsewhere: recorded once
    assert len(t) == 1 and t.wait_s("r0", 1, 0.0, 0.05) == pytest.approx(0.05)
    t.end(1)
    t.end(1)  # twice: no error
    assert len(t) == 0
    for token in range(10):
        t.start("r0", token, float(token))
    assert len(t) == 3 and t.wait_s("r0", 1, 0.0, 1.0) == pytest.approx(7.0)  # the latest kept
    for token in range(10):
        t.end(token)
    assert len(t) == 0
