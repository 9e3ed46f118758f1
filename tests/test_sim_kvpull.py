"""Simulated replicas pulling KV blocks from a peer (``kv_transfer_params``): timing under virtual
time with in-process peers, then real replicas on loopback."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import pytest

from gateway.servers import ServerGroup, free_port
from gateway.sim import SimConfig, build_sim_app, run_virtual, sim_specs_for_ports
from gateway.sim.kvpull import HttpPeerLookup
from gateway.sim.tokenizer import render_chat_segments

MS = 0.001
# 1 ms per prefill token; 8 Gbit/s = 1 GB/s and 1 MB per block: 1 ms per 16-token block, + 2 ms
CFG = SimConfig(
    prefill_s_per_token=MS, decode_s_per_token=MS, kv_bandwidth_gbps=8.0,
    kv_block_bytes=1_000_000, kv_pull_overhead_s=2 * MS,
)  # fmt: skip
CHAT = [{"role": "user", "content": "explain the cache " * 40}]
A_URL, B_URL = "http://sim-a", "http://sim-b"


class Conn:
    """A fake ASGI connection: one request body; ``sent`` holds (virtual time, message)."""

    def __init__(self, path: str, body: dict | bytes, method: str = "POST") -> None:
        self.scope = {"type": "http", "method": method, "path": path, "headers": []}
        self.body = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.sent: list[tuple[float, dict]] = []
        self._read = False

    async def receive(self) -> dict:
        if not self._read:
            self._read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await asyncio.get_running_loop().create_future()  # never disconnects
        return {"type": "http.disconnect"}

    async def send(self, msg: dict) -> None:
        self.sent.append((asyncio.get_running_loop().time(), msg))

    @property
    def status(self) -> int:
        return self.sent[0][1]["status"]

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.sent[0][1]["headers"]}

    def body_bytes(self) -> bytes:
        return b"".join(m["body"] for _, m in self.sent if m["type"] == "http.response.body")

    def json(self) -> dict:
        return json.loads(self.body_bytes())


def cluster(b_config: SimConfig = CFG):
    """Replicas A and B; B asks its peers through their ASGI apps (no sockets: virtual time)."""
    apps = {}
    lookups = {}

    async def lookup(url, hashes):
        if url not in lookups:
            raise httpx.ConnectError(f"no replica at {url}")
        return await lookups[url](url, hashes)

    apps["a"] = build_sim_app(CFG, peer_lookup=lookup)
    apps["b"] = build_sim_app(b_config, peer_lookup=lookup)
    lookups[A_URL] = HttpPeerLookup(transport=httpx.ASGITransport(app=apps["a"]))
    lookups[B_URL] = HttpPeerLookup(transport=httpx.ASGITransport(app=apps["b"]))
    return apps["a"], apps["b"]


async def call(app, body: dict | bytes, path: str = "/v1/chat/completions") -> Conn:
    conn = Conn(path, body)
    await app(conn.scope, conn.receive, conn.send)
    return conn


def chat(**extra) -> dict:
    return {"messages": CHAT, "max_tokens": 2, **extra}


def pull_from(url: str, **more) -> dict:
    return {"kv_transfer_params": {"kvgate_pull_from": url, **more}}


def test_pull_from_a_peer_replaces_prefill_with_transfer_time():
    async def main():
        a, b = cluster()
        warm = await call(a, chat())
        t0 = asyncio.get_running_loop().time()
        got = await call(b, chat(**pull_from(A_URL, kvgate_pull_tokens=999)))
        ttft = got.sent[0][0] - t0  # JSON: the whole answer; one decode step after the first token
        again = await call(b, chat(**pull_from(A_URL)))
        return a, b, warm, got, ttft, again

    a, b, warm, got, ttft, again = run_virtual(main())
    n = warm.json()["usage"]["prompt_tokens"]
    blocks = (n - 1) // 16
    assert got.status == 200 and got.headers["x-sim-pulled-tokens"] == str(16 * blocks)
    assert got.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * blocks
    transfer = 2 * MS + blocks * MS
    assert ttft == pytest.approx(transfer + (n - 16 * blocks) * MS + 1 * MS)
    assert ttft < n * MS / 4  # against a full prefill
    assert b.engine.stats.kv_pulls == 1 and b.engine.stats.kv_pulled_tokens == 16 * blocks
    assert a.engine.stats.kv_lookups == 2  # asked twice, no side effect on A's cache order
    # the second time B holds the prefix itself: nothing to pull
    assert again.headers["x-sim-pulled-tokens"] == "0"
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * blocks
    assert b.engine.stats.kv_pulls == 1 and b.engine.stats.prefix_hits == 16 * blocks


def test_no_pull_when_recomputing_is_cheaper():
    slow = SimConfig(
        prefill_s_per_token=MS, decode_s_per_token=MS, kv_bandwidth_gbps=0.08,  # 100 ms a block
        kv_block_bytes=1_000_000,
    )

    async def main():
        a, b = cluster(slow)
        await call(a, chat())
        t0 = asyncio.get_running_loop().time()
        got = await call(b, chat(**pull_from(A_URL)))
        return b, got, got.sent[0][0] - t0

    b, got, elapsed = run_virtual(main())
    n = got.json()["usage"]["prompt_tokens"]
    assert got.headers["x-sim-pulled-tokens"] == "0"
    assert got.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert elapsed == pytest.approx(n * MS + MS)  # full prefill + one decode
    assert b.engine.stats.kv_pull_skipped == 1 and b.engine.stats.kv_pulls == 0


def test_pull_caps_partial_peer_holdings_and_local_hits():
    longer = CHAT + [{"role": "user", "content": "and more " * 30}]

    async def main():
        a, b = cluster()
        await call(a, chat())
        prompt = b.engine.prompt_from_segments(render_chat_segments(CHAT))
        two = list(prompt.hashes[:2])
        listed = await call(b, chat(**pull_from(A_URL, kvgate_pull_hashes=two)))
        b.engine.cache.clear()
        capped = await call(b, chat(**pull_from(A_URL, kvgate_pull_hashes=3)))
        b.engine.cache.clear()
        b.engine.cache.insert(prompt.hashes[:3])  # B holds 3 blocks; A holds CHAT's prompt
        more = await call(b, {"messages": longer, "max_tokens": 2, **pull_from(A_URL)})
        b.engine.cache.clear()
        wrong = await call(b, chat(**pull_from(A_URL, kvgate_pull_hashes=[7, 8])))
        return b, prompt, listed, capped, more, wrong

    b, prompt, listed, capped, more, wrong = run_virtual(main())
    long_prompt = b.engine.prompt_from_segments(render_chat_segments(longer))
    pairs = zip(prompt.hashes, long_prompt.hashes, strict=False)
    shared = sum(1 for _ in itertools.takewhile(lambda p: p[0] == p[1], pairs))  # A's blocks
    assert shared > 3
    assert listed.headers["x-sim-pulled-tokens"] == str(2 * 16)
    assert capped.headers["x-sim-pulled-tokens"] == str(3 * 16)
    assert capped.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * 16
    assert more.headers["x-sim-pulled-tokens"] == str((shared - 3) * 16)
    assert more.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == shared * 16
    assert wrong.headers["x-sim-pulled-tokens"] == "0"  # not this prompt's hashes: nothing asked
    assert b.engine.stats.kv_pulls == 3


def test_streamed_pull_sends_headers_after_the_pull_and_counts_usage():
    async def main():
        a, b = cluster()
        await call(a, chat())
        body = chat(stream=True, stream_options={"include_usage": True}, **pull_from(A_URL))
        return await call(b, body)

    got = run_virtual(main())
    pulled = int(got.headers["x-sim-pulled-tokens"])
    assert pulled > 0 and got.headers["content-type"].startswith("text/event-stream")
    events = [e for e in got.body_bytes().decode().split("\n\n") if e.startswith("data: {")]
    usage = json.loads(events[-1][6:])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == pulled


def test_unreachable_peer_and_bad_requests():
    async def main():
        a, b = cluster()
        await call(a, chat())
        gone = await call(b, chat(**pull_from("http://nowhere:1")))
        bad = [
            await call(b, chat(kv_transfer_params="x")),
            await call(b, chat(**pull_from("ftp://a"))),
            await call(b, chat(**pull_from(A_URL, kvgate_pull_hashes=[-1]))),
            await call(b, chat(**pull_from(A_URL, kvgate_pull_hashes=True))),
            await call(a, b"{", "/sim/kv/lookup"),
            await call(a, {"hashes": ["x"]}, "/sim/kv/lookup"),
        ]
        ignored = await call(b, chat(kv_transfer_params={"other_connector": 1}))
        return b, gone, bad, ignored

    b, gone, bad, ignored = run_virtual(main())
    assert gone.status == 200 and gone.headers["x-sim-pulled-tokens"] == "0"
    assert b.engine.stats.kv_pull_errors == 1
    for conn in bad:
        assert conn.status == 400 and conn.json()["error"]["message"]
    assert ignored.status == 200 and "x-sim-pulled-tokens" not in ignored.headers
    assert b.engine.stats.kv_pulls == 0


async def test_real_replicas_pull_over_http():
    ports = [free_port(), free_port()]
    cfg = SimConfig(prefill_s_per_token=0.0002, decode_s_per_token=0.0, kv_bandwidth_gbps=100.0)
    group = ServerGroup(sim_specs_for_ports(ports, config=cfg))
    await group.start()
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            body = chat()
            first = (await client.post(urls[0] + "/v1/chat/completions", json=body)).json()
            resp = await client.post(urls[1] + "/v1/chat/completions",
                                     json={**body, **pull_from(urls[0])})
            dead = await client.post(urls[1] + "/v1/chat/completions",
                                     json={**body, "max_tokens": 3,
                                           **pull_from(f"http://127.0.0.1:{free_port()}")})
            state = (await client.get(urls[1] + "/sim/state")).json()
            lookup = await client.post(urls[0] + "/sim/kv/lookup", json={"hashes": [1, 2]})
    finally:
        await group.stop()
    n = first["usage"]["prompt_tokens"]
    pulled = int(resp.headers["x-sim-pulled-tokens"])
    assert pulled == (n - 1) // 16 * 16 > 0
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == pulled
    assert dead.status_code == 200 and dead.headers["x-sim-pulled-tokens"] == "0"
    assert state["kv_pull_errors"] == 1  # the dead peer: served without a pull
    assert state["kv_pulls"] == 1 and state["kv_pulled_tokens"] == pulled
    assert lookup.json() == {
        "blocks": 0, "pending_blocks": 0, "ready_in_s": 0.0, "block_size": 16, "model": "tiny",
        "block_bytes": 2 << 20,
    }  # fmt: skip


def test_waits_for_a_peers_prefill_in_flight_and_shares_its_own_pull():
    long_chat = [{"role": "user", "content": "explain the cache " * 200}]
    body = {"messages": long_chat, "max_tokens": 2}

    async def main():
        a, b = cluster()
        loop = asyncio.get_running_loop()
        on_a = asyncio.create_task(call(a, body))
        await asyncio.sleep(0.3)  # A is 300 ms into its prefill
        prompt = a.engine.prompt_from_segments(render_chat_segments(long_chat))
        seen = a.engine.holdings(prompt.hashes)
        t_b = loop.time()
        on_b = asyncio.create_task(call(b, {**body, **pull_from(A_URL)}))
        await asyncio.sleep(0.01)
        t_c = loop.time()
        on_c = asyncio.create_task(call(b, body))  # no hint: B's own pull is on its way
        _, got_b, got_c = await asyncio.gather(on_a, on_b, on_c)
        return prompt, seen, b, got_b, got_b.sent[0][0] - t_b, got_c, got_c.sent[0][0] - t_c

    prompt, seen, b, got_b, b_time, got_c, c_time = run_virtual(main())
    n = prompt.n_tokens
    k = (n - 1) // 16
    assert seen[0] == 0 and seen[1] == len(prompt.hashes)  # nothing yet, all of it pending
    assert seen[2] == pytest.approx(n * MS - 0.3)
    assert got_b.headers["x-sim-pulled-tokens"] == str(16 * k)
    transfer = 2 * MS + k * MS
    wait = (n * MS - 0.3)  # A's prefill ends
    assert b_time == pytest.approx(wait + transfer + (n - 16 * k) * MS + MS)
    assert b_time < n * MS  # recomputing would have taken longer
    # C, 10 ms after B and without a hint, waits for the rest of B's pull instead of recomputing
    assert got_c.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * k
    assert c_time == pytest.approx(wait + transfer - 0.01 + (n - 16 * k) * MS + MS)
    assert b.engine.stats.kv_pulls == 1 and len(b.engine.inflight) == 0


def test_inflight_keeps_the_earliest_arrival_and_its_owner():
    from gateway.sim.kvpull import Inflight

    fl = Inflight()
    first, second = object(), object()
    fl.add([1, 2, 3], 5.0, first, pulled=False)
    fl.add([2, 3, 4], 3.0, second, pulled=True)  # 2 and 3 arrive sooner by the pull
    fl.add([1], 9.0, second, pulled=True)  # later than what is on its way: ignored
    assert fl.run([1, 2, 3, 4, 5], 0) == (4, 5.0)
    assert fl.run([1, 2, 3, 4], 1, pulled_only=True) == (3, 3.0)
    assert fl.run([1, 2], 0, pulled_only=True) == (0, 0.0)
    fl.done([1, 2, 3, 4], second)  # only its own entries go
    assert fl.run([1, 2, 3], 0) == (1, 5.0) and len(fl) == 1


def test_requests_wait_for_a_pull_being_decided_and_not_for_one_given_up():
    async def main():
        a, _ = cluster()
        http = HttpPeerLookup(transport=httpx.ASGITransport(app=a))

        async def slow_lookup(url, hashes):  # 5 ms to ask the peer
            await asyncio.sleep(0.005)
            if url != A_URL:
                raise httpx.ConnectError("gone")
            return await http(url, hashes)

        b = build_sim_app(CFG, peer_lookup=slow_lookup)
        await call(a, chat())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        hinted = asyncio.create_task(call(b, chat(**pull_from(A_URL))))
        await asyncio.sleep(0.001)
        plain = asyncio.create_task(call(b, chat()))  # arrives while the pull is being decided
        got_hinted, got_plain = await asyncio.gather(hinted, plain)
        times = (got_hinted.sent[0][0] - t0, got_plain.sent[0][0] - t0 - 0.001)
        b.engine.cache.clear()
        t1 = loop.time()
        failing = asyncio.create_task(call(b, chat(**pull_from("http://gone"))))
        await asyncio.sleep(0.001)
        other = await call(b, chat())  # the announced pull fails: it recomputes, it does not hang
        await failing
        return b, got_hinted, got_plain, times, other, other.sent[0][0] - t1 - 0.001

    b, got_hinted, got_plain, (t_hinted, t_plain), other, t_other = run_virtual(main())
    n = got_hinted.json()["usage"]["prompt_tokens"]
    k = (n - 1) // 16
    rest = (n - 16 * k) * MS + MS  # the uncached tail and one decode step
    assert got_hinted.headers["x-sim-pulled-tokens"] == str(16 * k)
    assert t_hinted == pytest.approx(0.005 + 2 * MS + k * MS + rest)
    assert got_plain.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * k
    assert t_plain == pytest.approx(t_hinted - 0.001)  # waited for the pull, then the same tail
    assert b.engine.stats.kv_pulls == 1 and len(b.engine.inflight) == 0
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert t_other == pytest.approx(0.004 + n * MS + MS)  # waited for the failed lookup only
    assert b.engine.stats.kv_pull_errors == 1
