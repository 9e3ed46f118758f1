"""PrefixIndex: matching, capacity model, events, learning, and invariants under random operations."""

from __future__ import annotations

import functools
import gc
import random
import tracemalloc

import pytest

from policies.hashing import chain_hashes
from policies.prefix_index import PrefixIndex


@pytest.fixture(params=[False, True], ids=["starts", "by_hash"])
def Index(request: pytest.FixtureRequest) -> type[PrefixIndex]:
    """The index in both storage modes: node starts mapped (the request path's) and every hash
    mapped (after KV events)."""
    return functools.partial(PrefixIndex, by_hash=request.param)  # type: ignore[return-value]


def chain(*parts: str, seed: int = 7) -> tuple[int, ...]:
    return tuple(chain_hashes([p.encode() for p in parts], seed))


def words(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


# ---------------------------------------------------------------- matching


def test_match_is_the_longest_leading_run_per_replica(Index: type[PrefixIndex]) -> None:
    ix = Index()
    a = chain("sys", "a1", "a2", "a3")
    b = chain("sys", "b1")
    ix.insert("r1", a)
    ix.insert("r2", b)
    assert ix.match(a) == {"r1": 4, "r2": 1}
    assert ix.match(b) == {"r1": 1, "r2": 2}
    assert ix.match(a[:2]) == {"r1": 2, "r2": 1}
    assert ix.match(chain("sys", "a1", "zz", "a3")) == {"r1": 2, "r2": 1}
    assert ix.match(chain("other")) == {}
    assert ix.match(()) == {}


def test_match_a_longer_request_than_what_is_stored(Index: type[PrefixIndex]) -> None:
    ix = Index()
    ix.insert("r1", chain("s", "t1"))
    assert ix.match(chain("s", "t1", "t2", "t3")) == {"r1": 2}


def test_hash_order_matters_not_just_membership(Index: type[PrefixIndex]) -> None:
    ix = Index()
    a = chain("x", "y", "z")
    ix.insert("r1", a)
    # The same hashes, but not starting at the root: no match.
    assert ix.match(a[1:]) == {}


def test_insert_reports_new_blocks_and_turns_extend_one_node(Index: type[PrefixIndex]) -> None:
    ix = Index()
    turns = [chain(*words("t", n)) for n in (4, 6, 9)]
    assert ix.insert("r1", turns[0]) == 4
    assert ix.insert("r1", turns[1]) == 2
    assert ix.insert("r1", turns[2]) == 3
    assert ix.insert("r1", turns[2]) == 0
    assert ix.stats()["nodes"] == 1
    assert ix.blocks("r1") == 9
    assert ix.match(turns[2]) == {"r1": 9}
    assert ix.audit() == []


def test_a_second_replica_can_hold_part_of_a_node(Index: type[PrefixIndex]) -> None:
    ix = Index()
    long = chain(*words("w", 10))
    ix.insert("r1", long)
    ix.insert("r2", long[:3])
    assert ix.match(long) == {"r1": 10, "r2": 3}
    assert ix.stats()["total_blocks"] == 10
    assert ix.blocks("r2") == 3
    assert ix.audit() == []


# ---------------------------------------------------------------- capacity model


def test_capacity_forgets_least_recently_used_and_deepest_first(Index: type[PrefixIndex]) -> None:
    ix = Index(default_capacity=10)
    old = chain(*words("old", 6))
    new = chain(*words("new", 6))
    ix.insert("r1", old, now=1)
    ix.insert("r1", new, now=2)
    assert ix.blocks("r1") == 10
    # The older chain lost its two deepest blocks; its head is still usable.
    assert ix.match(old) == {"r1": 4}
    assert ix.match(new) == {"r1": 6}
    assert ix.audit() == []


def test_using_a_chain_protects_it_from_eviction(Index: type[PrefixIndex]) -> None:
    ix = Index(default_capacity=12)
    a, b, c = (chain(*words(p, 5)) for p in "abc")
    ix.insert("r1", a, now=1)
    ix.insert("r1", b, now=2)
    ix.insert("r1", a, now=3)  # a is now the most recently used
    ix.insert("r1", c, now=4)
    assert ix.match(a) == {"r1": 5}
    assert ix.match(b) == {"r1": 2}
    assert ix.match(c) == {"r1": 5}


def test_shared_prefix_outlives_its_branches(Index: type[PrefixIndex]) -> None:
    ix = Index(default_capacity=8)
    shared = words("sys", 4)
    ix.insert("r1", chain(*shared, "a1", "a2"), now=1)
    ix.insert("r1", chain(*shared, "b1", "b2"), now=2)  # 8 blocks: full
    ix.insert("r1", chain(*shared, "c1", "c2"), now=3)  # evicts branch a, not the shared part
    assert ix.match(chain(*shared, "a1", "a2")) == {"r1": 4}
    assert ix.match(chain(*shared, "c1", "c2")) == {"r1": 6}
    assert ix.blocks("r1") <= 8


def test_one_chain_longer_than_capacity_keeps_its_head(Index: type[PrefixIndex]) -> None:
    ix = Index(default_capacity=5)
    c = chain(*words("w", 9))
    ix.insert("r1", c)
    assert ix.match(c) == {"r1": 5}
    assert ix.stats()["total_blocks"] == 5


def test_capacity_is_per_replica(Index: type[PrefixIndex]) -> None:
    ix = Index(default_capacity=100)
    ix.set_capacity("small", 3)
    c = chain(*words("w", 6))
    ix.insert("small", c)
    ix.insert("big", c)
    assert ix.match(c) == {"small": 3, "big": 6}
    ix.set_capacity("big", 2)
    assert ix.match(c) == {"small": 3, "big": 2}
    with pytest.raises(ValueError):
        ix.set_capacity("big", 0)


def test_max_total_blocks_bounds_memory_by_evicting_the_oldest(Index: type[PrefixIndex]) -> None:
    ix = Index(default_capacity=100, max_total_blocks=10)
    a = chain(*words("a", 6))
    b = chain(*words("b", 6))
    ix.insert("r1", a, now=1)
    ix.insert("r2", b, now=2)
    assert ix.stats()["total_blocks"] <= 10
    assert ix.match(a) == {}  # r1's node was the oldest: dropped whole
    assert ix.match(b) == {"r2": 6}
    assert ix.audit() == []


def test_expire_forgets_holdings_not_used_since(Index: type[PrefixIndex]) -> None:
    ix = Index()
    a, b = chain("a"), chain("b")
    ix.insert("r1", a, now=10)
    ix.insert("r1", b, now=20)
    ix.insert("r2", a, now=30)
    assert ix.expire(older_than=25) == 2
    assert ix.match(a) == {"r2": 1}
    assert ix.match(b) == {}
    assert ix.audit() == []


# ---------------------------------------------------------------- removal, events


def test_remove_forgets_the_block_and_what_follows_it_on_that_replica(Index: type[PrefixIndex]) -> None:
    ix = Index()
    c = chain(*words("w", 8))
    ix.insert("r1", c)
    ix.insert("r2", c)
    assert ix.remove("r1", [c[5]]) == 3
    assert ix.match(c) == {"r1": 5, "r2": 8}
    assert ix.remove("r1", [c[6], c[2], 12345]) == 3
    assert ix.match(c) == {"r1": 2, "r2": 8}
    assert ix.remove("nobody", [c[0]]) == 0
    assert ix.audit() == []


def test_truncate_keeps_only_the_leading_blocks(Index: type[PrefixIndex]) -> None:
    ix = Index()
    c = chain(*words("w", 8))
    ix.insert("r1", c)
    assert ix.truncate("r1", c, 3) == 5
    assert ix.match(c) == {"r1": 3}
    assert ix.truncate("r1", c, 10) == 0


def test_drop_replica_forgets_it_and_frees_unshared_blocks(Index: type[PrefixIndex]) -> None:
    ix = Index()
    shared = chain("s1", "s2")
    ix.insert("r1", chain("s1", "s2", "a"))
    ix.insert("r2", shared)
    assert ix.drop_replica("r1") == 3
    assert ix.match(chain("s1", "s2", "a")) == {"r2": 2}
    assert ix.stats()["total_blocks"] == 2
    assert "r1" not in ix.stats()["blocks"]
    assert ix.audit() == []


def test_apply_events_stored_with_parent_removed_and_cleared(Index: type[PrefixIndex]) -> None:
    ix = Index()
    base = chain("s", "a")
    ix.apply_events("r1", stored=[(None, base)])
    full = chain("s", "a", "b", "c")
    ix.apply_events("r2", stored=[(base[-1], full[2:])])  # r2 gets the parent's prefix too
    assert ix.match(full) == {"r1": 2, "r2": 4}
    ix.apply_events("r2", stored=[(999, [1, 2])])  # unknown parent: ignored, counted
    assert ix.stats()["orphan_events"] == 1
    ix.apply_events("r2", removed=[full[3]])
    assert ix.match(full) == {"r1": 2, "r2": 3}
    ix.apply_events("r1", cleared=True, stored=[(None, chain("x"))])
    assert ix.match(full) == {"r2": 3}
    assert ix.match(chain("x")) == {"r1": 1}
    assert ix.audit() == []


# ---------------------------------------------------------------- learned capacity


def test_observe_shrinks_on_a_clear_shortfall_and_grows_back_on_hits(Index: type[PrefixIndex]) -> None:
    ix = Index(default_capacity=1000, min_capacity=10, shrink=0.5, grow=0.5)
    for k in range(10):
        ix.insert("r1", chain(*words(f"c{k}-", 40)))
    assert ix.blocks("r1") == 400
    ix.observe("r1", predicted_tokens=640, actual_tokens=64)
    assert ix.capacity("r1") == 200
    assert ix.blocks("r1") == 200
    ix.observe("r1", predicted_tokens=640, actual_tokens=500)  # within miss_ratio: no change
    assert ix.capacity("r1") == 200
    ix.observe("r1", predicted_tokens=640, actual_tokens=640)
    assert ix.capacity("r1") == 300
    for _ in range(10):
        ix.observe("r1", predicted_tokens=640, actual_tokens=700)
    assert ix.capacity("r1") == 1000  # never above the configured capacity
    for _ in range(30):
        ix.observe("r1", predicted_tokens=640, actual_tokens=0)
    assert ix.capacity("r1") == 10  # never below min_capacity
    assert ix.blocks("r1") <= 10
    ix.observe("unknown", 100, 0)
    assert "unknown" not in ix.stats()["blocks"]


# ---------------------------------------------------------------- robustness


def test_non_chain_input_does_not_corrupt_the_index(Index: type[PrefixIndex]) -> None:
    ix = Index()
    ix.insert("r1", [1, 2, 3])
    ix.insert("r1", [5, 2, 3, 4])  # 2 and 3 already stored at other depths
    ix.insert("r2", [7, 8, 7, 9])  # a repeated hash inside one chain
    ix.insert("r2", [1, 2, 3, 1])
    assert ix.audit() == []
    assert ix.match([1, 2, 3]) == {"r1": 3, "r2": 3}
    assert ix.match([5]) == {"r1": 1}


def test_events_switch_to_every_hash_mapped_and_keep_what_was_recorded() -> None:
    ix = PrefixIndex()
    a, b = chain(*words("a", 40)), chain(*words("a", 20), *words("b", 30))
    ix.insert("r1", a)
    ix.insert("r2", b)
    ix.insert("r3", [1, 2, 3])
    ix.insert("r3", [5, 2, 3, 4])  # not a chain: 2 and 3 stored twice until every hash is mapped
    before = ix.stats()
    assert (before["by_hash"], before["mapped"], before["total_blocks"]) == (False, 5, 77)
    assert ix.remove("r2", [b[25]]) == 25  # the block and the rest of its node
    after = ix.stats()
    assert after["by_hash"] and after["mapped"] == after["total_blocks"] == 77 - 25 - 3
    assert ix.match(a) == {"r1": 40, "r2": 20}
    assert ix.match(b) == {"r1": 20, "r2": 25}
    assert ix.match([5, 2, 3, 4]) == {"r3": 1}  # the deeper copies of 2 and 3 went
    assert ix.match([1, 2, 3]) == {"r3": 3}
    assert ix.audit() == []


def test_constructor_validates(Index: type[PrefixIndex]) -> None:
    with pytest.raises(ValueError):
        Index(default_capacity=0)
    with pytest.raises(ValueError):
        Index(miss_ratio=0)


@pytest.mark.parametrize("seed", range(8))
def test_random_operations_keep_counts_consistent_and_capacity_respected(
    seed: int, Index: type[PrefixIndex]
) -> None:
    """Without ``by_hash`` the first 200 steps are request-path operations only (events would
    make the index map every hash); the events that follow switch it over mid-run."""
    rng = random.Random(seed)
    ix = Index(default_capacity=40, max_total_blocks=120, min_capacity=5)
    starts = not ix.stats()["by_hash"]
    replicas = [f"r{i}" for i in range(4)]
    stems = [words(f"s{k}-", rng.randint(1, 6)) for k in range(5)]
    chains: list[tuple[int, ...]] = []
    for step in range(400):
        rid = rng.choice(replicas)
        op = rng.random()
        if starts and step < 200 and (0.55 <= op < 0.65 or op >= 0.96):
            op = 0.0  # an insert instead of an event
        if op < 0.55 or not chains:
            c = chain(*rng.choice(stems), *words(f"x{rng.randint(0, 30)}-", rng.randint(0, 20)))
            chains.append(c)
            ix.insert(rid, c, now=step)
        elif op < 0.65:
            c = rng.choice(chains)
            ix.remove(rid, rng.sample(c, min(len(c), 2)))
        elif op < 0.72:
            c = rng.choice(chains)
            ix.truncate(rid, c, rng.randint(0, len(c)))
        elif op < 0.77:
            ix.drop_replica(rid)
        elif op < 0.84:
            ix.set_capacity(rid, rng.randint(5, 60))
        elif op < 0.92:
            ix.observe(rid, rng.randint(1, 2000), rng.randint(0, 2000))
        elif op < 0.96:
            ix.expire(older_than=step - rng.randint(5, 100))
        else:
            c = rng.choice(chains)
            cut = rng.randint(1, len(c))
            ix.apply_events(rid, stored=[(c[cut - 1], c[cut:])], removed=[rng.choice(c)], now=step)
        problems = ix.audit()
        assert problems == [], (step, problems)
        stats = ix.stats()
        assert stats["blocks"] == ix.recount()
        for r, n in stats["blocks"].items():
            assert n <= ix.capacity(r) <= 60
        assert stats["total_blocks"] <= 120
        if starts and step < 200:
            assert stats["mapped"] == stats["nodes"] and not stats["by_hash"]


def test_match_never_claims_a_block_the_replica_was_not_given(Index: type[PrefixIndex]) -> None:
    rng = random.Random(3)
    ix = Index(default_capacity=25)
    given: dict[str, set[int]] = {"r0": set(), "r1": set(), "r2": set()}
    stems = [words(f"s{k}-", 3) for k in range(3)]
    chains = []
    for step in range(300):
        rid = rng.choice(sorted(given))
        c = chain(*rng.choice(stems), *words(f"x{rng.randint(0, 15)}-", rng.randint(0, 8)))
        chains.append(c)
        ix.insert(rid, c, now=step)
        given[rid].update(c)
        probe = rng.choice(chains)
        for r, n in ix.match(probe).items():
            assert set(probe[:n]) <= given[r]


def test_without_pressure_match_equals_a_brute_force_reference(Index: type[PrefixIndex]) -> None:
    rng = random.Random(4)
    ix = Index(default_capacity=10**6)
    given: dict[str, set[int]] = {f"r{i}": set() for i in range(4)}
    stems = [words(f"s{k}-", rng.randint(1, 4)) for k in range(4)]
    chains = []
    for _ in range(200):
        rid = rng.choice(sorted(given))
        c = chain(*rng.choice(stems), *words(f"x{rng.randint(0, 20)}-", rng.randint(0, 6)))
        chains.append(c)
        ix.insert(rid, c)
        given[rid].update(c)
    for probe in chains:
        expected = {}
        for r, blocks in given.items():
            n = 0
            while n < len(probe) and probe[n] in blocks:
                n += 1
            if n:
                expected[r] = n
        assert ix.match(probe) == expected


def test_stats_approx_bytes_tracks_measured_memory(Index: type[PrefixIndex]) -> None:
    rng = random.Random(5)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    ix = Index(default_capacity=10**6)
    for _ in range(200):
        c = tuple(rng.getrandbits(64) for _ in range(rng.choice((16, 64, 256))))
        for r in rng.sample(["a", "b", "c", "d"], rng.randint(1, 3)):
            ix.insert(r, c)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    approx = ix.stats()["approx_bytes"]
    assert 0.6 * used < approx < 1.5 * used
    assert used / ix.stats()["total_blocks"] < 200  # bytes per block
