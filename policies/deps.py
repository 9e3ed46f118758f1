"""Shared state a policy may need, built once by the gateway and passed to every factory.

Several policies (or several instances of one) and, later, a Redis sync layer share the same
``PrefixIndex`` and ``SessionTable``: they are the gateway's local view of the cluster.  The clock
is injected (monotonic seconds) so that tests drive time by hand.  ``PolicyDeps()`` builds fresh
defaults; a factory given ``deps=None`` does exactly that.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .prefix_index import PrefixIndex
from .sessions import SessionTable


@dataclass
class PolicyDeps:
    clock: Callable[[], float] = time.monotonic
    index: PrefixIndex = field(default_factory=PrefixIndex)
    sessions: SessionTable | None = None  # None: a default table on ``clock``

    def __post_init__(self) -> None:
        if self.sessions is None:
            self.sessions = SessionTable(clock=self.clock)


def resolve_deps(deps: object) -> PolicyDeps:
    """``deps`` itself, or fresh defaults when the gateway passed None."""
    if deps is None:
        return PolicyDeps()
    for attr in ("clock", "index", "sessions"):
        if not hasattr(deps, attr):
            raise TypeError(f"policy deps lack {attr!r}; pass a PolicyDeps")
    return deps  # type: ignore[return-value]
