"""The ASGI lifespan protocol, run by :class:`gateway.httpserver.FastServer` around serving."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("kvgate.http")

ASGI = {"version": "3.0", "spec_version": "2.3"}


class Lifespan:
    """The ASGI lifespan protocol; an app that does not speak it is run without one."""

    def __init__(self, app, state: dict) -> None:
        self.app = app
        self.state = state
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.startup_done: asyncio.Future | None = None
        self.shutdown_done: asyncio.Future | None = None
        self.task: asyncio.Task | None = None
        self.supported = True

    async def startup(self) -> None:
        loop = asyncio.get_running_loop()
        self.startup_done = loop.create_future()
        self.shutdown_done = loop.create_future()
        self.task = loop.create_task(self._main())
        await self.inbox.put({"type": "lifespan.startup"})
        failure = await self.startup_done
        if failure is not None:
            raise RuntimeError(f"application startup failed: {failure}")

    async def shutdown(self) -> None:
        if self.task is None or self.task.done():
            return
        await self.inbox.put({"type": "lifespan.shutdown"})
        await asyncio.wait([self.task, self.shutdown_done], return_when=asyncio.FIRST_COMPLETED)

    async def _main(self) -> None:
        scope = {"type": "lifespan", "asgi": ASGI, "state": self.state}
        try:
            await self.app(scope, self.inbox.get, self._send)
        except BaseException as exc:  # noqa: BLE001
            if not self.startup_done.done():  # the app does not do lifespan, or startup raised
                if isinstance(exc, asyncio.CancelledError):
                    raise
                # No lifespan.startup.failed first: the app does not speak lifespan (uvicorn's
                # "auto" mode reads it the same way).  Starlette reports a failed startup first.
                self.supported = False
                log.info("ASGI lifespan unsupported by the app (%r): serving without it", exc)
                self.startup_done.set_result(None)
            elif not self.shutdown_done.done():
                self.shutdown_done.set_result(repr(exc))

    async def _send(self, message: dict) -> None:
        kind = message["type"]
        if kind == "lifespan.startup.complete":
            self.startup_done.set_result(None)
        elif kind == "lifespan.startup.failed":
            self.startup_done.set_result(message.get("message", "") or "startup failed")
        elif kind in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
            if not self.shutdown_done.done():
                self.shutdown_done.set_result(message.get("message"))

