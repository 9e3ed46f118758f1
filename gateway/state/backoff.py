"""Retry timing for the store link, as pure objects: no sleeping, no I/O, the clock is injected.

* :class:`Backoff` -- capped exponential delay with jitter (redis-py's ``backoff.py`` shape):
  ``d(n) = min(cap, base * 2**(n-1))`` after the n-th consecutive failure, then scaled into
  ``[(1 - jitter) * d, d]`` by a random draw the caller passes in, so that many gateways losing
  the same Redis do not reconnect in lock-step.  Defaults: base 50 ms, cap 1 s, jitter 0.5.
* :class:`StoreLink` -- the up/down state of the store as the sync tasks see it: ``failed`` marks
  it down and schedules the next probe with the backoff, ``succeeded`` marks it up and resets the
  count; ``probe_in`` says how long until a probe is due.  It starts *down* with a probe due at
  once: nothing is assumed about the store until it has answered.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    base_s: float = 0.05
    cap_s: float = 1.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if not (0 < self.base_s <= self.cap_s) or not 0.0 <= self.jitter <= 1.0:
            raise ValueError("backoff needs 0 < base_s <= cap_s and 0 <= jitter <= 1")

    def delay(self, failures: int, draw: float = 1.0) -> float:
        """Seconds to wait after ``failures`` consecutive failures (``draw`` in [0, 1))."""
        if failures <= 0:
            return 0.0
        d = min(self.cap_s, self.base_s * 2.0 ** min(failures - 1, 62))
        return d * (1.0 - self.jitter + self.jitter * draw)


class StoreLink:
    def __init__(
        self,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.backoff = backoff or Backoff()
        self._clock = clock
        self._rng = rng
        self.up = False
        self.failures = 0  # consecutive
        self.ever_up = False
        self.down_since: float | None = clock()
        self.next_probe_at = clock()
        self.last_error = ""
        self.transitions = 0  # up <-> down changes

    def failed(self, error: object = "") -> bool:
        """Record a failure; True when this took the link from up to down."""
        now = self._clock()
        was_up = self.up
        self.up = False
        self.failures += 1
        self.last_error = str(error)[:300]
        if was_up:
            self.down_since = now
            self.transitions += 1
        self.next_probe_at = now + self.backoff.delay(self.failures, self._rng())
        return was_up

    def succeeded(self) -> bool:
        """Record a success; True when this took the link from down to up."""
        was_down = not self.up
        self.up = True
        self.ever_up = True
        self.failures = 0
        self.down_since = None
        if was_down:
            self.transitions += 1
        return was_down

    def probe_in(self) -> float:
        """Seconds until the next probe is due (0 when it is due now)."""
        return max(0.0, self.next_probe_at - self._clock())

    def down_for(self) -> float:
        return 0.0 if self.down_since is None else self._clock() - self.down_since
