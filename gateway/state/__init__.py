"""Shared state between gateways (DESIGN.md section 4): sessions, prefix index and load.

* :mod:`.store` -- the ``Store`` contract and the embedded :class:`MemoryStore`;
  :mod:`.redis_store` -- :class:`RedisStore` (redis.asyncio + hiredis).
* :mod:`.events` -- the index-change events and their stream encoding.
* :mod:`.sync` -- :class:`StateSync`: outbox + flusher, stream tailer with catch-up, load
  heartbeat, failure handling; :mod:`.backoff` -- the pure retry strategy it uses.
* :mod:`.solo` -- :class:`SoloSync`, the same surface for a gateway whose embedded store nobody
  else can read: no sync at all.
* :mod:`.policy` -- :class:`SharedPolicy`, the delegating wrapper that feeds the outbox.
"""

from __future__ import annotations

from .backoff import Backoff, StoreLink
from .events import Event
from .metrics import StateMetrics
from .policy import SharedPolicy
from .settings import SyncSettings
from .solo import SoloSync
from .store import MemoryStore, Store, StoreUnavailable, StreamInfo
from .sync import StateSync

__all__ = [
    "Backoff",
    "Event",
    "MemoryStore",
    "SharedPolicy",
    "SoloSync",
    "StateMetrics",
    "StateSync",
    "Store",
    "StoreLink",
    "StoreUnavailable",
    "StreamInfo",
    "SyncSettings",
    "check_store_url",
    "make_store",
]


def check_store_url(url: str) -> None:
    """Raise ``ValueError`` unless ``url`` is empty or a redis:// / rediss:// / unix:// URL."""
    if url and not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"store url must start with redis://, rediss:// or unix://: {url!r}")


def make_store(url: str = "", **kwargs) -> Store:
    """The embedded store for an empty ``url``, else a ``RedisStore`` on it."""
    check_store_url(url)
    if not url:
        return MemoryStore()
    from .redis_store import RedisStore

    return RedisStore(url, **kwargs)
