"""Shared fixtures: a real ``redis-server`` for the shared-state tests, and a store per backend."""

from __future__ import annotations

import uuid

import pytest

from gateway.state import MemoryStore
from gateway.state.redis_server import LocalRedis, find_redis_server


class RedisFixture:
    """A running redis-server on a free loopback port; ``stop``/``start`` for outage tests."""

    def __init__(self, server: LocalRedis) -> None:
        self.server = server

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        self.server.start()


@pytest.fixture(scope="session")
def redis_server():
    if find_redis_server() is None:
        pytest.skip("redis-server is not installed (make test installs it)")
    server = LocalRedis()
    server.start()
    fixture = RedisFixture(server)
    try:
        yield fixture
    finally:
        server.stop()


@pytest.fixture
def redis_fixture(redis_server):
    """The session's redis-server, emptied first, restarted afterwards if a test left it stopped."""
    redis_server.server.flushall()
    yield redis_server
    redis_server.start()


def unique_namespace() -> str:
    return "t" + uuid.uuid4().hex[:10]


class Backend:
    """Builds stores of one kind that share state, and takes that state away for a while."""

    def __init__(self, kind: str, redis: RedisFixture | None) -> None:
        self.kind = kind
        self.redis = redis
        self.namespace = unique_namespace()
        self._memory = MemoryStore()
        self._stores: list = []

    def store(self, **kwargs):
        if self.kind == "memory":
            if "maxlen" in kwargs:
                self._memory.maxlen = kwargs["maxlen"]
            return self._memory  # op_timeout_s and the like do not apply in-process
        from gateway.state.redis_store import RedisStore

        store = RedisStore(self.redis.url, namespace=self.namespace, **kwargs)
        self._stores.append(store)
        return store

    def outage_start(self) -> None:
        if self.kind == "memory":
            self._memory.set_available(False)
        else:
            self.redis.stop()

    def outage_end(self) -> None:
        if self.kind == "memory":
            self._memory.set_available(True)
        else:
            self.redis.start()

    async def close(self) -> None:
        for store in self._stores:
            await store.close()


@pytest.fixture(params=["memory", "redis"])
async def backend(request):
    redis = request.getfixturevalue("redis_fixture") if request.param == "redis" else None
    b = Backend(request.param, redis)
    try:
        yield b
    finally:
        await b.close()
        if redis is not None:
            from gateway.state.redis_store import RedisStore

            cleaner = RedisStore(redis.url, namespace=b.namespace)
            try:
                await cleaner.delete_namespace()
            except Exception:  # noqa: BLE001 - best effort cleanup
                pass
            await cleaner.close()
