"""KV pulls between simulated replicas: a metadata-only worker agent (no tensors move, time passes).

A request may carry, as vLLM passes to its KV connector::

    "kv_transfer_params": {
        "kvgate_pull_from": "http://host:port",      # a peer replica's base URL
        "kvgate_pull_hashes": 12 | [h0, h1, ...]     # optional cap: a count of leading blocks,
    }                                                # or the leading block hashes themselves

(other keys are ignored; the gateway also sends ``kvgate_pull_tokens``, its own estimate).

1. Before admission the replica asks the peer how many leading blocks of this prompt it holds:
   ``POST {peer}/sim/kv/lookup {"hashes": [...]}`` -> ``{"blocks": k, "pending_blocks": p,
   "ready_in_s": w, ...}``: ``k`` held now, ``p >= k`` once the prefills and pulls in flight there
   land, ``w`` seconds from now (no side effect on the peer; an unreachable or failing peer counts
   ``kv_pull_errors`` and means k = p = 0).
2. After admission (``SimEngine.pull``) two moves are priced for the blocks it lacks among the
   ``k`` (now) or the ``p`` (after waiting what is left of ``w``), each capped at the blocks a
   lookup may hit (one prompt token is always computed).  ``worker_agent.migration.PullPlanner``
   prices a move (EWMA-estimated rates; the configured values are the priors, and in the
   simulator the observations equal them)::

       transfer = overhead + blocks * kv_block_bytes / bandwidth
       saved    = blocks * block_size * prefill_s_per_token - transfer - wait

   and the one that saves most is made if it saves anything.  The wait and the transfer hold the
   request's running slot (a synchronous load, the conservative model); the blocks then enter the
   replica's ``PrefixCache`` and count as cached tokens.  While they are on their way they are
   "in flight": another request of this replica that needs them waits for them instead of
   recomputing (the agent knows they are coming; a prefill in flight is not waited for, as vLLM
   does not), and a peer's lookup counts them as pending.
3. ``usage.prompt_tokens_details.cached_tokens`` includes the pulled tokens; the response carries
   ``x-sim-pulled-tokens`` (for a streamed response whose request asked for a pull, the headers
   are sent once the pull is decided).  ``/sim/state`` counts ``kv_pulls``, ``kv_pulled_tokens``,
   ``kv_pull_skipped`` (not worth it), ``kv_pull_errors`` and ``kv_lookups`` (served to peers).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import httpx
import orjson

from worker_agent.migration import PullPlanner

from .config import SimConfig
from .model import PromptBlocks, max_cacheable_blocks
from .protocol import ApiError

_U64 = (1 << 64) - 1
PeerLookup = Callable[[str, Sequence[int]], Awaitable[tuple[int, int, float]]]


@dataclass(frozen=True, slots=True)
class PeerHoldings:
    """What a peer said it holds of a prompt: ``blocks`` now, ``pending`` at ``ready_at``.

    ``token`` owns the "expected" in-flight entries of the ``asked`` hashes (see ``Inflight``)
    until the pull is made or given up (``SimEngine.pull`` / ``SimEngine.release``).
    """

    blocks: int = 0
    pending: int = 0
    ready_at: float = 0.0  # this replica's clock
    token: object = None
    asked: tuple[int, ...] = ()


class Inflight:
    """Blocks being computed (prefill) or pulled on a replica: when each will be in the cache.

    A pull is expected (ready time ``inf``) from the moment a request that carries a hint
    arrives until its pull is decided, so requests that arrive meanwhile wait for the decision
    (``changed``) instead of recomputing what is about to come.
    """

    __slots__ = ("_ready", "_changed")

    def __init__(self) -> None:
        self._ready: dict[int, tuple[float, object, bool]] = {}  # hash -> (ready, owner, pulled)
        self._changed: asyncio.Future | None = None

    def changed(self) -> asyncio.Future:
        """A future done at the next ``add`` or ``done``."""
        if self._changed is None or self._changed.done():
            self._changed = asyncio.get_running_loop().create_future()
        return self._changed

    def _notify(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)

    def add(self, hashes: Sequence[int], ready_at: float, owner: object, pulled: bool) -> None:
        """Record work in flight; a block already on its way keeps the earlier arrival (when
        that work is cancelled the later one is forgotten too: a lookup then says too little)."""
        ready = self._ready
        for h in hashes:
            entry = ready.get(h)
            if entry is None or ready_at < entry[0] or entry[1] is owner:
                ready[h] = (ready_at, owner, pulled)
        self._notify()

    def done(self, hashes: Sequence[int], owner: object) -> None:
        for h in hashes:
            entry = self._ready.get(h)
            if entry is not None and entry[1] is owner:
                del self._ready[h]
        self._notify()

    def run(
        self, hashes: Sequence[int], start: int, *, pulled_only: bool = False
    ) -> tuple[int, float]:
        """(length, latest ready time) of the in-flight run of ``hashes`` from ``start``."""
        n, latest = 0, 0.0
        for h in itertools.islice(hashes, start, None):
            entry = self._ready.get(h)
            if entry is None or (pulled_only and not entry[2]):
                break
            n += 1
            latest = max(latest, entry[0])
        return n, latest

    def __len__(self) -> int:
        return len(self._ready)


@dataclass(frozen=True, slots=True)
class PullHint:
    url: str
    max_blocks: int | None = None
    hashes: tuple[int, ...] | None = None


def _bad(message: str) -> ApiError:
    return ApiError(400, message, param="kv_transfer_params")


def _hash_list(raw: object, what: str) -> list[int]:
    if not isinstance(raw, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= _U64 for h in raw
    ):
        raise _bad(f"'{what}' must be a list of uint64 block hashes")
    return raw


def parse_pull_hint(params: object) -> PullHint | None:
    """The pull request in ``kv_transfer_params``, None when there is none (ApiError if bad)."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise _bad("'kv_transfer_params' must be an object")
    url = params.get("kvgate_pull_from")
    if url is None:
        return None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise _bad("'kvgate_pull_from' must be a peer's base URL (http://host:port)")
    cap = params.get("kvgate_pull_hashes")
    if cap is None:
        return PullHint(url.rstrip("/"))
    if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0:
        return PullHint(url.rstrip("/"), max_blocks=cap)
    return PullHint(url.rstrip("/"), hashes=tuple(_hash_list(cap, "kvgate_pull_hashes")))


def hashes_to_ask(hint: PullHint, prompt: PromptBlocks, block_size: int) -> list[int]:
    """The prompt's leading block hashes worth asking the peer about."""
    limit = max_cacheable_blocks(prompt.n_tokens, block_size)
    ask = list(prompt.hashes[:limit])
    if hint.max_blocks is not None:
        ask = ask[: hint.max_blocks]
    if hint.hashes is not None:
        n = 0
        for mine, theirs in zip(ask, hint.hashes, strict=False):
            if mine != theirs:
                break
            n += 1
        ask = ask[:n]
    return ask


def make_planner(config: SimConfig) -> PullPlanner | None:
    """The pull-vs-recompute estimator of a replica, None when it can never pull."""
    if config.kv_bandwidth_gbps <= 0 or config.prefill_s_per_token <= 0:
        return None
    return PullPlanner(
        config.kv_block_bytes,
        bandwidth_prior=config.kv_bandwidth_gbps * 1e9 / 8,
        prefill_prior=1.0 / config.prefill_s_per_token,
        overhead_s=config.kv_pull_overhead_s,
    )


def lookup_reply(body: bytes, holdings: Callable[[Sequence[int]], tuple[int, int, float]],
                 config: SimConfig) -> bytes:
    """The body of ``POST /sim/kv/lookup`` (ApiError 400 on a bad request)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"invalid JSON body: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    hashes = _hash_list(data.get("hashes"), "hashes")
    blocks, pending, ready_in = holdings(hashes)
    return orjson.dumps(
        {"blocks": blocks, "pending_blocks": pending, "ready_in_s": ready_in,
         "block_size": config.block_size, "model": config.model,
         "block_bytes": config.kv_block_bytes}
    )  # fmt: skip


class HttpPeerLookup:
    """Asks a peer replica's ``/sim/kv/lookup`` over HTTP (one client, made on first use)."""

    def __init__(self, timeout: float = 2.0, transport: httpx.AsyncBaseTransport | None = None):
        self.timeout = timeout
        self._transport = transport
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, url: str, hashes: Sequence[int]) -> tuple[int, int, float]:
        """(blocks held, blocks pending, seconds until they are) at the peer."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout, transport=self._transport)
        body = orjson.dumps({"hashes": list(hashes)})
        resp = await self._client.post(url + "/sim/kv/lookup", content=body)
        resp.raise_for_status()
        data = resp.json()
        blocks, pending = data.get("blocks"), data.get("pending_blocks", data.get("blocks"))
        ready_in = data.get("ready_in_s", 0.0)
        if not (isinstance(blocks, int) and isinstance(pending, int) and 0 <= blocks <= pending):
            raise ValueError(f"bad lookup reply from {url}: {resp.text[:200]}")
        if not isinstance(ready_in, int | float) or ready_in < 0:
            raise ValueError(f"bad lookup reply from {url}: {resp.text[:200]}")
        return blocks, pending, float(ready_in)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


async def peer_holdings(
    lookup: PeerLookup, hint: PullHint, prompt: PromptBlocks, engine
) -> PeerHoldings:
    """What the hinted peer holds of ``prompt`` (nothing, on any failure)."""
    ask = hashes_to_ask(hint, prompt, engine.config.block_size)
    if not ask or engine.planner is None:
        return PeerHoldings()
    token = engine.expect_pull(ask)
    try:
        blocks, pending, ready_in = await lookup(hint.url, ask)
    except (httpx.HTTPError, ValueError, OSError):
        engine.stats.kv_pull_errors += 1
        engine.inflight.done(ask, token)
        return PeerHoldings()
    except BaseException:
        engine.inflight.done(ask, token)
        raise
    n, now = len(ask), engine.clock.now()
    return PeerHoldings(min(n, blocks), min(n, pending), now + ready_in, token, tuple(ask))
