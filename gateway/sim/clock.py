"""Clocks for the simulator: the engine reads time and sleeps only through a :class:`Clock`.

* :class:`LoopClock` (the default) reads the running event loop's clock and sleeps with
  ``asyncio.sleep``: real time under a normal loop.
* :class:`VirtualTimeLoop` is an event loop whose clock is virtual: whenever every task is blocked
  (the loop would wait in ``select`` with a timeout), it jumps straight to the next timer instead of
  waiting.  Run code under it with :func:`run_virtual`; a ``LoopClock`` (or plain
  ``asyncio.sleep``) then takes no real time, and the order of events is exactly the order of
  their virtual deadlines, so tests never sleep to order events.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class LoopClock:
    """The running loop's clock (``time.monotonic`` under a normal loop)."""

    __slots__ = ()

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class _VirtualSelector(selectors.BaseSelector):
    """Delegates to a real selector, but turns a timed wait with no ready I/O into a time jump."""

    def __init__(self, loop: VirtualTimeLoop, deadlock_after: float) -> None:
        self._loop = loop
        self._real = selectors.DefaultSelector()
        self._deadlock_after = deadlock_after

    def register(self, fileobj, events, data=None):  # type: ignore[no-untyped-def]
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj):  # type: ignore[no-untyped-def]
        return self._real.unregister(fileobj)

    def modify(self, fileobj, events, data=None):  # type: ignore[no-untyped-def]
        return self._real.modify(fileobj, events, data)

    def get_key(self, fileobj):  # type: ignore[no-untyped-def]
        return self._real.get_key(fileobj)

    def get_map(self):  # type: ignore[no-untyped-def]
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout=None):  # type: ignore[no-untyped-def]
        events = self._real.select(0)
        if events or timeout == 0:
            return events
        if timeout is None:  # nothing scheduled: only real I/O (or nothing) can wake us
            events = self._real.select(self._deadlock_after)
            if not events:
                raise RuntimeError("virtual-time loop is deadlocked: no timers and no I/O")
            return events
        self._loop.virtual_time += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is virtual and jumps to the next timer when all are idle."""

    def __init__(self, start: float = 0.0, deadlock_after: float = 10.0) -> None:
        self.virtual_time = start
        super().__init__(selector=_VirtualSelector(self, deadlock_after))

    def time(self) -> float:
        return self.virtual_time


def run_virtual(main: Coroutine[Any, Any, T], *, start: float = 0.0) -> T:
    """Run ``main`` to completion on a fresh :class:`VirtualTimeLoop` and close it."""
    loop = VirtualTimeLoop(start)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
