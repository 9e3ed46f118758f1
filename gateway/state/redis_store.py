"""``RedisStore``: the shared-state contract (:mod:`gateway.state.store`) on Redis, via redis.asyncio.

Key layout (``ns`` = the namespace, default ``kvgate``)::

    {ns}:events             stream of index-change events (fields in gateway.state.events),
                            XADD ... MAXLEN ~ maxlen
    {ns}:session:{key}      string: the replica id, PX = the session TTL (refreshed on every publish)
    {ns}:load:{gateway}     hash: replica id -> in-flight count, PX = the load TTL (heartbeat)
    {ns}:gateways           zset: gateway id -> wall-clock expiry (ms); only to enumerate load
                            hashes -- expiry itself is the hash's own TTL, kept by Redis's clock

A publish is one EVALSHA of a small Lua script per batch (XADD of every event, each followed by
the SET of its session): atomic, so the stream order and the session keys agree across gateways,
and one command to pack however large the batch.  (The session keys are not declared in KEYS: fine
on one Redis, not on Redis Cluster.)  The stream is tailed with XREAD BLOCK on
a connection of its own (its socket timeout covers the block); every other command has a short
socket timeout.  redis-py retries a command once, at once (for a pooled connection that a Redis
restart broke); the sync layer owns retry and backoff, and every Redis or socket error leaves this
module as :class:`StoreUnavailable`.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from . import events as codec
from .events import ZERO_ID, Event
from .store import ReadBatch, StoreUnavailable, StreamInfo

_NS = re.compile(r"^[A-Za-z0-9_.:-]+$")
_MARKER = b"~hb"  # load-hash field present even when the gateway has nothing in flight
_ZSET_GRACE_MS = 60_000

# One atomic call per batch: XADD every event, then (re)bind its session.  ARGV: maxlen, session
# TTL (ms), session key prefix, then (blob, session key or "", replica) per event.
_PUBLISH = """
local stream, maxlen, ttl, prefix = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
for i = 4, #ARGV, 3 do
  redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'e', ARGV[i])
  if ARGV[i + 1] ~= '' then
    redis.call('SET', prefix .. ARGV[i + 1], ARGV[i + 2], 'PX', ttl)
  end
end
return (#ARGV - 3) / 3
"""


def _b2s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RedisStore:
    backend = "redis"
    flush_interval_s = 0.01  # a round trip costs ~0.1-0.3 ms of loop CPU: batch (see sync.py)

    def __init__(
        self,
        url: str,
        namespace: str = "kvgate",
        maxlen: int = 100_000,
        op_timeout_s: float = 0.5,
        max_block_s: float = 1.0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if not _NS.match(namespace):
            raise ValueError(f"bad store namespace {namespace!r}")
        if maxlen < 1:
            raise ValueError("maxlen must be >= 1")
        self.url = url
        self.maxlen = maxlen
        self.max_block_s = max_block_s
        self._wall = wall
        self._events = f"{namespace}:events"
        self._session = f"{namespace}:session:"
        self._load = f"{namespace}:load:"
        self._gateways = f"{namespace}:gateways"
        # One immediate retry, so that a pooled connection broken by a Redis restart costs no
        # failure; anything longer is the sync layer's backoff.
        common = dict(socket_connect_timeout=op_timeout_s, retry=Retry(NoBackoff(), 1),
                      health_check_interval=0)
        # from_url raises ValueError on a malformed URL: a configuration error at start-up.
        self._cmd = aioredis.Redis.from_url(url, socket_timeout=op_timeout_s, **common)
        self._publish = self._cmd.register_script(_PUBLISH)  # EVALSHA, loaded again after a restart
        self._tail = aioredis.Redis.from_url(
            url, socket_timeout=max_block_s + op_timeout_s, max_connections=2, **common
        )

    async def _call(self, coro):
        try:
            return await coro
        except (RedisError, OSError, TimeoutError, asyncio.TimeoutError) as exc:
            raise StoreUnavailable(f"redis: {exc!r}") from exc

    async def ping(self) -> None:
        await self._call(self._cmd.ping())

    async def publish(self, events: Sequence[Event], session_ttl_s: float) -> None:
        if not events:
            return
        args: list = [self.maxlen, max(1, int(session_ttl_s * 1000)), self._session]
        for ev in events:
            args += (codec.encode(ev), "" if ev.session is None else ev.session, ev.replica)
        await self._call(self._publish(keys=[self._events], args=args))

    async def read(self, after: str, count: int, block_s: float) -> ReadBatch:
        block = int(min(block_s, self.max_block_s) * 1000)
        kwargs = {"count": count}
        if block > 0:
            kwargs["block"] = block  # 0 would mean "forever" to Redis
        reply = await self._call(self._tail.xread({self._events: after}, **kwargs))
        if not reply:
            return []
        entries = reply[0][1] if isinstance(reply, list) else next(iter(reply.values()))[0]
        out: ReadBatch = []
        for entry_id, fields in entries:
            try:
                ev = codec.decode(fields[b"e"])
            except (KeyError, ValueError, UnicodeDecodeError):
                ev = None
            out.append((_b2s(entry_id), ev))
        return out

    async def info(self) -> StreamInfo:
        try:
            raw = await self._cmd.xinfo_stream(self._events)
        except ResponseError as exc:
            if "no such key" in str(exc).lower():
                return StreamInfo()
            raise StoreUnavailable(f"redis: {exc!r}") from exc
        except (RedisError, OSError, TimeoutError, asyncio.TimeoutError) as exc:
            raise StoreUnavailable(f"redis: {exc!r}") from exc
        first = raw.get("first-entry")
        return StreamInfo(
            exists=True,
            length=int(raw.get("length", 0)),
            first_id=_b2s(first[0]) if first else None,
            last_id=_b2s(raw.get("last-generated-id", ZERO_ID)),
            added=int(raw.get("entries-added", -1)),
        )

    async def sessions(self, batch: int = 1000) -> AsyncIterator[tuple[str, str]]:
        prefix = len(self._session)
        keys: list[bytes] = []
        try:
            async for key in self._cmd.scan_iter(match=self._session + "*", count=batch):
                keys.append(key)
                if len(keys) >= batch:
                    for item in await self._mget(keys, prefix):
                        yield item
                    keys = []
        except (RedisError, OSError, TimeoutError, asyncio.TimeoutError) as exc:
            raise StoreUnavailable(f"redis: {exc!r}") from exc
        for item in await self._mget(keys, prefix):
            yield item

    async def _mget(self, keys: list[bytes], prefix: int) -> list[tuple[str, str]]:
        if not keys:
            return []
        values = await self._call(self._cmd.mget(keys))
        return [(k[prefix:].decode(), v.decode()) for k, v in zip(keys, values, strict=True) if v is not None]

    async def get_session(self, key: str) -> str | None:
        value = await self._call(self._cmd.get(self._session + key))
        return None if value is None else value.decode()

    async def publish_load(self, gateway: str, counts: Mapping[str, int], ttl_s: float) -> None:
        key = self._load + gateway
        ttl_ms = max(1, int(ttl_s * 1000))
        now_ms = int(self._wall() * 1000)
        pipe = self._cmd.pipeline(transaction=True)
        pipe.delete(key)
        pipe.hset(key, mapping={_MARKER: b"1", **{r: int(c) for r, c in counts.items()}})
        pipe.pexpire(key, ttl_ms)
        pipe.zadd(self._gateways, {gateway: now_ms + ttl_ms})
        pipe.zremrangebyscore(self._gateways, "-inf", now_ms - _ZSET_GRACE_MS)
        await self._call(pipe.execute())

    async def read_load(self) -> dict[str, dict[str, int]]:
        members = await self._call(self._cmd.zrange(self._gateways, 0, -1))
        if not members:
            return {}
        pipe = self._cmd.pipeline(transaction=False)
        for gw in members:
            pipe.hgetall(self._load + _b2s(gw))
        hashes = await self._call(pipe.execute())
        out: dict[str, dict[str, int]] = {}
        for gw, fields in zip(members, hashes, strict=True):
            if not fields:
                continue  # expired: the gateway stopped heartbeating
            counts: dict[str, int] = {}
            for k, v in fields.items():
                if k != _MARKER:
                    try:
                        counts[_b2s(k)] = int(v)
                    except ValueError:
                        continue
            out[_b2s(gw)] = counts
        return out

    async def drop_load(self, gateway: str) -> None:
        pipe = self._cmd.pipeline(transaction=True)
        pipe.delete(self._load + gateway)
        pipe.zrem(self._gateways, gateway)
        await self._call(pipe.execute())

    async def close(self) -> None:
        for client in (self._tail, self._cmd):
            try:
                await client.aclose()
            except (RedisError, OSError):  # pragma: no cover - best effort on shutdown
                pass

    async def delete_namespace(self) -> int:
        """Remove every key of this namespace (tests and benchmarks clean up with it)."""
        ns = self._events.rsplit(":", 1)[0]
        n = 0
        async for key in self._cmd.scan_iter(match=ns + ":*", count=1000):
            n += await self._call(self._cmd.delete(key))
        return n
