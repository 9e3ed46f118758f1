"""When to move KV blocks between replicas instead of recomputing them (pure: no torch, no I/O).

(a) On-demand pull.  A request lands on a replica that lacks ``blocks`` leading blocks of its
prefix which a peer holds.  Moving them costs and saves::

    transfer_s  = overhead_s + blocks * block_bytes / bandwidth
    recompute_s = uncached_tokens / prefill_rate      (uncached_tokens: what the blocks cover)
    pull  iff  transfer_s * margin < recompute_s

``bandwidth`` (bytes/s) and ``prefill_rate`` (tokens/s) are :class:`RateEstimator`\\ s fed by
observations: every finished transfer ``(bytes, seconds)`` and every prefill ``(tokens, seconds)``.
An estimator is a ratio of exponentially weighted sums (EWMA of amounts over EWMA of durations,
``alpha`` per observation): large transfers weigh more than tiny ones, whose time is mostly
overhead.  For transfers the fixed ``overhead_s`` is taken off each observed duration first (but
never more than ``1 - min_busy`` of it, so a too-large configured overhead cannot produce an
infinite rate).  Before its first observation an estimator answers its prior.

(b) Hot-prefix replication (the exo idea: keep hot context on several replicas, so load can spread
without losing hits, and a replica that dies loses no context).

* :class:`HotPrefixes` keeps a decayed hit count per prefix: on a hit at time ``t`` the count
  becomes ``count * 2 ** (-(t - t_last) / half_life_s) + 1``; ``rate(p, now)`` decays it to ``now``.
* :func:`plan_replication`: prefixes whose rate is at least ``min_rate`` are "hot"; hottest
  first, each should live on ``min(k, alive nodes)`` alive nodes.  Missing copies go to alive
  non-holders in rendezvous order of the prefix (independent planners agree, and the copies of
  different prefixes spread), skipping nodes whose block budget is spent; the source is the alive
  holder with the fewest copies assigned so far in this plan (ties: rendezvous order).  A hot
  prefix with no alive holder is reported ``lost``: nothing can copy it.
* Consistency is eventual, per block: every copy carries a :class:`Version` ``(counter, writer)``,
  totally ordered; :class:`BlockVersions` keeps the highest seen per block and ``merge`` is a
  pointwise max (commutative, associative, idempotent: any gossip order converges).  A local
  rewrite of a block ``bump``\\ s its counter past every version seen; a copy is applied only if
  its version is higher than the destination's (a stale copy never overwrites a newer block).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import xxhash

# -- (a) on-demand pull ------------------------------------------------------------------------


class RateEstimator:
    """Amount per second as a ratio of EWMAs (see the module header)."""

    __slots__ = ("alpha", "prior", "overhead_s", "min_busy", "_amount", "_seconds", "samples")

    def __init__(
        self, prior: float, *, alpha: float = 0.2, overhead_s: float = 0.0, min_busy: float = 0.1
    ) -> None:
        if not prior > 0 or not math.isfinite(prior):
            raise ValueError("prior must be a finite rate > 0")
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        if overhead_s < 0 or not 0.0 < min_busy <= 1.0:
            raise ValueError("overhead_s must be >= 0 and min_busy in (0, 1]")
        self.alpha = alpha
        self.prior = prior
        self.overhead_s = overhead_s
        self.min_busy = min_busy
        self._amount = 0.0
        self._seconds = 0.0
        self.samples = 0

    def observe(self, amount: float, seconds: float) -> None:
        """One finished operation; ignored when it carries no information (zero or bad values)."""
        if not (amount > 0 and seconds > 0) or not math.isfinite(amount + seconds):
            return
        busy = max(seconds - self.overhead_s, seconds * self.min_busy)
        if self.samples == 0:
            self._amount, self._seconds = amount, busy
        else:
            keep = 1.0 - self.alpha
            self._amount = keep * self._amount + self.alpha * amount
            self._seconds = keep * self._seconds + self.alpha * busy
        self.samples += 1

    @property
    def rate(self) -> float:
        return self._amount / self._seconds if self.samples else self.prior


@dataclass(frozen=True, slots=True)
class PullDecision:
    pull: bool
    blocks: int
    bytes: int
    transfer_s: float
    recompute_s: float

    @property
    def saved_s(self) -> float:
        """Time the pull saves over recomputing (negative: it would cost more)."""
        return self.recompute_s - self.transfer_s


def pull_decision(
    blocks: int,
    block_bytes: int,
    uncached_tokens: int,
    bandwidth: float,
    prefill_rate: float,
    overhead_s: float = 0.0,
    margin: float = 1.0,
) -> PullDecision:
    """Pull iff ``(overhead_s + bytes / bandwidth) * margin < uncached_tokens / prefill_rate``."""
    if blocks <= 0 or uncached_tokens <= 0:
        return PullDecision(False, 0, 0, 0.0, 0.0)
    nbytes = blocks * block_bytes
    transfer = overhead_s + nbytes / bandwidth
    recompute = uncached_tokens / prefill_rate
    return PullDecision(transfer * margin < recompute, blocks, nbytes, transfer, recompute)


class PullPlanner:
    """:func:`pull_decision` on measured rates; feed it with ``observe_*``."""

    def __init__(
        self,
        block_bytes: int,
        *,
        bandwidth_prior: float,
        prefill_prior: float,
        overhead_s: float = 0.0,
        margin: float = 1.0,
        alpha: float = 0.2,
    ) -> None:
        if block_bytes < 0 or margin <= 0:
            raise ValueError("block_bytes must be >= 0 and margin > 0")
        self.block_bytes = block_bytes
        self.overhead_s = overhead_s
        self.margin = margin
        self.bandwidth = RateEstimator(bandwidth_prior, alpha=alpha, overhead_s=overhead_s)
        self.prefill = RateEstimator(prefill_prior, alpha=alpha)

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        self.bandwidth.observe(nbytes, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill.observe(tokens, seconds)

    def decide(self, blocks: int, uncached_tokens: int) -> PullDecision:
        return pull_decision(
            blocks, self.block_bytes, uncached_tokens, self.bandwidth.rate, self.prefill.rate,
            self.overhead_s, self.margin,
        )  # fmt: skip


# -- (b) hot-prefix replication ----------------------------------------------------------------


class HotPrefixes:
    """Decayed hit counts per prefix (half-life ``half_life_s``); time is passed in."""

    def __init__(self, half_life_s: float = 60.0) -> None:
        if not half_life_s > 0:
            raise ValueError("half_life_s must be > 0")
        self.half_life_s = half_life_s
        self._hits: dict[Hashable, tuple[float, float]] = {}  # prefix -> (count, at)

    def _decayed(self, count: float, at: float, now: float) -> float:
        return count * 2.0 ** (-max(0.0, now - at) / self.half_life_s)

    def hit(self, prefix: Hashable, now: float, n: int = 1) -> float:
        count, at = self._hits.get(prefix, (0.0, now))
        value = self._decayed(count, at, now) + n
        self._hits[prefix] = (value, max(at, now))
        return value

    def rate(self, prefix: Hashable, now: float) -> float:
        entry = self._hits.get(prefix)
        return 0.0 if entry is None else self._decayed(entry[0], entry[1], now)

    def rates(self, now: float) -> dict[Hashable, float]:
        return {p: self._decayed(c, at, now) for p, (c, at) in self._hits.items()}

    def hottest(self, n: int, now: float) -> list[tuple[Hashable, float]]:
        return sorted(self.rates(now).items(), key=lambda kv: kv[1], reverse=True)[:n]

    def prune(self, now: float, below: float) -> int:
        """Forget prefixes whose decayed count fell under ``below``; returns how many."""
        cold = [p for p, (c, at) in self._hits.items() if self._decayed(c, at, now) < below]
        for p in cold:
            del self._hits[p]
        return len(cold)

    def __len__(self) -> int:
        return len(self._hits)

    def __contains__(self, prefix: Hashable) -> bool:
        return prefix in self._hits


def _seed(prefix: Hashable) -> int:
    if isinstance(prefix, int):
        return prefix & 0xFFFFFFFFFFFFFFFF
    return xxhash.xxh3_64_intdigest(repr(prefix).encode())


def rendezvous(prefix: Hashable, nodes: Iterable[str]) -> list[str]:
    """``nodes`` by highest random weight for ``prefix`` (same order on every planner)."""
    seed = _seed(prefix)
    return sorted(nodes, key=lambda n: xxhash.xxh3_64_intdigest(n.encode(), seed), reverse=True)


@dataclass(frozen=True, slots=True)
class Copy:
    prefix: Hashable
    src: str
    dst: str
    blocks: int = 0


@dataclass(frozen=True)
class ReplicationPlan:
    copies: tuple[Copy, ...] = ()
    lost: tuple[Hashable, ...] = ()  # hot prefixes no alive node holds
    short: tuple[Hashable, ...] = ()  # hot prefixes left under target (budgets spent)

    def holders_after(
        self, holders: Mapping[Hashable, Collection[str]]
    ) -> dict[Hashable, set[str]]:
        """``holders`` with every copy of the plan applied."""
        out = {p: set(h) for p, h in holders.items()}
        for c in self.copies:
            out.setdefault(c.prefix, set()).add(c.dst)
        return out


def plan_replication(
    holders: Mapping[Hashable, Collection[str]],
    rates: Mapping[Hashable, float],
    alive: Sequence[str],
    *,
    k: int = 2,
    min_rate: float = 1.0,
    sizes: Mapping[Hashable, int] | None = None,
    budgets: Mapping[str, int] | None = None,
) -> ReplicationPlan:
    """Copies that bring every hot prefix to ``min(k, len(alive))`` alive holders (see header).

    ``sizes``: blocks per prefix (default 1); ``budgets``: blocks each node may still receive
    (default unbounded).
    """
    if k < 1:
        raise ValueError("k must be >= 1")
    live = set(alive)
    target = min(k, len(live))
    left = dict(budgets) if budgets is not None else None
    sent: dict[str, int] = {}
    copies: list[Copy] = []
    lost: list[Hashable] = []
    short: list[Hashable] = []
    hot = [p for p, r in rates.items() if r >= min_rate]
    hot.sort(key=lambda p: (-rates[p], _seed(p)))
    for prefix in hot:
        have = [n for n in holders.get(prefix, ()) if n in live]
        if not have:
            lost.append(prefix)
            continue
        size = (sizes or {}).get(prefix, 1)
        order = rendezvous(prefix, live)
        rank = {n: i for i, n in enumerate(order)}
        sources = list(have)  # a copy planned in this round cannot be a source yet
        need = target - len(have)
        for dst in order:
            if need <= 0:
                break
            if dst in have or (left is not None and left.get(dst, 0) < size):
                continue
            src = min(sources, key=lambda n: (sent.get(n, 0), rank[n]))
            sent[src] = sent.get(src, 0) + 1
            if left is not None:
                left[dst] -= size
            copies.append(Copy(prefix, src, dst, size))
            have.append(dst)
            need -= 1
        if need > 0:
            short.append(prefix)
    return ReplicationPlan(tuple(copies), tuple(lost), tuple(short))


# -- per-block versions ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, order=True)
class Version:
    """A block's version: ``counter`` first, the writer's id breaks ties (a total order)."""

    counter: int
    writer: str = ""


UNVERSIONED = Version(0)  # a block no writer versioned (e.g. put straight into a store): the lowest


@dataclass
class BlockVersions:
    """The highest version seen per block on one node (a grow-only, max-merge map)."""

    node: str
    versions: dict[int, Version] = field(default_factory=dict)

    def get(self, key: int) -> Version | None:
        return self.versions.get(key)

    def bump(self, key: int) -> Version:
        """A local (re)write of ``key``: a version above every one seen for it."""
        cur = self.versions.get(key)
        v = Version((cur.counter if cur else 0) + 1, self.node)
        self.versions[key] = v
        return v

    def offer(self, key: int, version: Version) -> bool:
        """A copy of ``key`` at ``version`` arrived; True (apply it) iff it is newer."""
        cur = self.versions.get(key)
        if cur is not None and cur >= version:
            return False
        self.versions[key] = version
        return True

    def merge(self, other: Mapping[int, Version]) -> list[int]:
        """Adopt every newer version of ``other``; returns the keys that changed."""
        return [k for k, v in other.items() if self.offer(k, v)]

    def stale(self, other: Mapping[int, Version]) -> list[int]:
        """Keys for which ``other`` holds a newer version than this node (to fetch)."""
        return [k for k, v in other.items() if (cur := self.versions.get(k)) is None or cur < v]
