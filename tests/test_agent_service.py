"""The agent service: real agents (uvicorn, TCP data ports, ZMQ sockets) on loopback."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("zmq")

import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402

from gateway.servers import ServerGroup, ServerSpec, free_port  # noqa: E402
from gateway.state import MemoryStore  # noqa: E402
from policies.hashing import chain_hashes  # noqa: E402
from worker_agent.api import build_app  # noqa: E402
from worker_agent.blockfmt import Block, byte_view  # noqa: E402
from worker_agent.events import BlockRemoved, BlockStored, decode_batch  # noqa: E402
from worker_agent.publisher import END_SEQ  # noqa: E402
from worker_agent.service import AgentConfig, AgentService  # noqa: E402
from worker_agent.shared import ChainTracker  # noqa: E402
from worker_agent.transport.tcp import TcpTransport  # noqa: E402

SHAPE = (2, 2, 16, 2, 64)  # layers, K/V, tokens, kv heads, head dim: 16 KiB in fp16


def chain(seed: int, n: int) -> list[int]:
    return chain_hashes([bytes([seed, i]) for i in range(n)], seed)


def tensors(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g).to(torch.float16) for _ in range(n)]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(byte_view(a), byte_view(b))


def config(name: str, **kw) -> AgentConfig:
    base = dict(
        name=name, port=free_port(), data_port=0, device="cpu", gpu_bytes=1 << 20,
        cpu_bytes=4 << 20, events_endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
    )  # fmt: skip
    return AgentConfig(**{**base, **kw})


class Running:
    """Agents served by uvicorn on loopback, with an HTTP client for each."""

    def __init__(self, *configs: AgentConfig, **service_kw) -> None:
        self.agents = [AgentService(c, **service_kw) for c in configs]
        self.group = ServerGroup(
            [ServerSpec(build_app(a), "127.0.0.1", a.config.port) for a in self.agents]
        )
        self.http: list[httpx.AsyncClient] = []

    async def __aenter__(self) -> Running:
        await self.group.start()  # runs each app's lifespan: the agents start
        self.http = [
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{a.config.port}", timeout=10)
            for a in self.agents
        ]
        return self

    async def __aexit__(self, *exc) -> None:
        for c in self.http:
            await c.aclose()
        await self.group.stop()


def put_chain(agent: AgentService, keys: list[int], values: list[torch.Tensor]) -> None:
    agent.store.put_blocks([Block(k, t) for k, t in zip(keys, values, strict=True)])


async def test_lookup_pull_and_push_between_two_agents():
    keys, values = chain(1, 6), tensors(1, 6)
    async with Running(config("a"), config("b")) as run:
        a, b = run.agents
        ha, hb = run.http
        put_chain(a, keys, values)
        health = (await ha.get("/health")).json()
        assert health["status"] == "ok" and health["data_address"] == a.data_address
        assert (await hb.post("/v1/lookup", json={"hashes": keys})).json() == {
            "tiers": [None] * 6, "prefix_blocks": 0, "held": 0,
        }  # fmt: skip
        probe = keys[:4] + [12345] + keys[4:]  # prefix mode stops at the hash A lacks
        pulled = (await hb.post("/v1/pull", json={"peer": a.data_address, "hashes": probe})).json()
        assert pulled["received"] == 4 and pulled["stored"] == 4
        assert pulled["missing"] == [12345, *keys[4:]]
        assert pulled["bytes"] == 4 * values[0].nbytes
        every = {"peer": a.data_address, "hashes": probe, "prefix": False, "tier": "cpu"}
        pulled = (await hb.post("/v1/pull", json=every)).json()
        assert pulled["received"] == 6 and pulled["stored"] == 2 and pulled["missing"] == [12345]
        look = (await hb.post("/v1/lookup", json={"hashes": [hex(k) for k in keys]})).json()
        assert look["prefix_blocks"] == 6 and look["tiers"] == ["GPU"] * 4 + ["CPU"] * 2
        for k, v in zip(keys, values, strict=True):
            assert same(b.store.get(k), v)  # byte-identical after the trip
        # push: B writes two blocks A lacks into A's store
        more_keys, more = chain(2, 2), tensors(2, 2)
        put_chain(b, more_keys, more)
        pushed = (await hb.post("/v1/push", json={"peer": a.data_address,
                                                   "hashes": [*more_keys, 999]})).json()
        assert pushed["sent"] == 2 and pushed["stored_by_peer"] == 2 and pushed["missing"] == [999]
        looked = (await ha.post("/v1/lookup", json={"hashes": more_keys})).json()
        assert looked["prefix_blocks"] == 2
        assert all(same(a.store.get(k), v) for k, v in zip(more_keys, more, strict=True))
        stats = (await hb.get("/v1/stats")).json()
        assert stats["transfers"]["pulls"] == 2 and stats["transfers"]["pushes"] == 1
        assert stats["transfers"]["blocks_in"] == 10 and stats["blocks"] == 8
        assert stats["transfers"]["bandwidth_Bps"] > 0
        assert stats["tiers"]["GPU"]["blocks"] + stats["tiers"]["CPU"]["blocks"] == 8


async def recv_batch(sub, timeout: float = 5.0):
    topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), timeout)
    return topic, int.from_bytes(seq, "big"), decode_batch(payload)


async def test_events_reach_a_zmq_subscriber_and_the_replay_socket():
    keys, values = chain(3, 3), tensors(3, 3)
    async with Running(config("a", topic="kv@a")) as run:
        (a,) = run.agents
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(a.publisher.endpoint)
        try:
            # PUB/SUB: a subscription takes effect some time after connecting.  Publish probes
            # until one arrives; from then on every batch is delivered, in order.
            probe = 1 << 60
            for _ in range(200):
                a.store.put(probe, torch.zeros(4))
                try:
                    _, last, _ = await recv_batch(sub, timeout=0.05)
                    break
                except asyncio.TimeoutError:
                    a.store.remove(probe)
            else:
                pytest.fail("no event reached the subscriber")
            await a.publisher.flush()
            first = a.publisher.next_seq
            while last < first - 1:  # skip what the probing left in flight
                _, last, _ = await recv_batch(sub)
            put_chain(a, keys, values)  # stored tail-first, announced root-first as one chain
            a.store.move(keys[2], 1)  # GPU -> CPU
            topic, seq, batch = await recv_batch(sub)  # both operations, in one batch
            assert topic == b"kv@a" and seq == first
            assert batch.events == (
                BlockStored(tuple(keys), None, (), 16, "GPU"),
                BlockRemoved((keys[2],), "GPU"),
                BlockStored((keys[2],), keys[1], (), 16, "CPU"),
            )
            a.store.remove(keys[0])
            topic, seq, batch = await recv_batch(sub)
            assert seq == first + 1 and batch.events == (BlockRemoved((keys[0],), "GPU"),)
            # a late subscriber asks the replay socket for everything since seq 0
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(a.publisher.replay_endpoint)
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            seqs = []
            while True:
                empty, seq_b, payload = await asyncio.wait_for(dealer.recv_multipart(), 5)
                assert empty == b""
                if seq_b == END_SEQ:
                    assert payload == b""
                    break
                seqs.append(int.from_bytes(seq_b, "big"))
                decode_batch(payload)
            assert seqs == list(range(first + 2))
        finally:
            ctx.destroy(linger=0)  # closes every socket of the test, even after a failure


async def test_bad_input_answers_4xx_json():
    async with Running(config("a", max_hashes=4)) as run:
        (h,) = run.http
        cases = [
            ("POST", "/v1/lookup", b"{not json", 400),
            ("POST", "/v1/lookup", b"[1, 2]", 400),
            ("POST", "/v1/lookup", b'{"hashes": 5}', 400),
            ("POST", "/v1/lookup", b'{"hashes": [-1]}', 400),
            ("POST", "/v1/lookup", b'{"hashes": [18446744073709551616]}', 400),
            ("POST", "/v1/lookup", b'{"hashes": [true]}', 400),
            ("POST", "/v1/lookup", b'{"hashes": ["0xzz"]}', 400),
            ("POST", "/v1/lookup", b'{"hashes": [1, 2, 3, 4, 5]}', 413),
            ("POST", "/v1/pull", b'{"hashes": [1]}', 400),
            ("POST", "/v1/pull", b'{"peer": "nowhere", "hashes": [1]}', 400),
            ("POST", "/v1/pull", b'{"peer": "127.0.0.1:1", "hashes": [1], "tier": "TAPE"}', 400),
            ("POST", "/v1/pull", b'{"peer": "127.0.0.1:1", "hashes": [1], "prefix": 1}', 400),
            ("POST", "/v1/push", b'{"peer": "127.0.0.1:99999", "hashes": [1]}', 400),
            ("GET", "/v1/lookup", b"", 405),
            ("GET", "/nope", b"", 404),
        ]
        for method, path, body, status in cases:
            resp = await h.request(method, path, content=body)
            assert resp.status_code == status, (path, body, resp.text)
            assert resp.headers["content-type"] == "application/json"
            err = resp.json()["error"]
            assert err["message"] and err["type"] == "invalid_request_error"
        dead = free_port()  # nothing listens there: the peer is unreachable -> 502
        resp = await h.post("/v1/pull", json={"peer": f"127.0.0.1:{dead}", "hashes": [1]})
        assert resp.status_code == 502 and resp.json()["error"]["code"] == "peer_error"
        assert (await h.get("/v1/stats")).json()["transfers"]["failures"] == 1


def test_chain_tracker_publishes_root_anchored_chains_once():
    t = ChainTracker()
    assert t.apply([BlockStored((1, 2), None, medium="GPU")]) == [(1, 2)]
    assert t.apply([BlockStored((3,), 2, medium="GPU")]) == [(1, 2, 3)]
    # a move between tiers makes nothing newly held
    assert t.apply([BlockRemoved((3,), "GPU"), BlockStored((3,), 2, medium="CPU")]) == []
    assert t.apply([BlockStored((9,), 8, medium="GPU")]) == []  # ancestry unknown
    assert t.apply([BlockRemoved((2,), "GPU"), BlockStored((4,), 3, medium="GPU")]) == []
    assert t.chain_to(3) is None and len(t) == 4  # 1, 3, 9, 4 held; 2 gone breaks the chain


async def test_held_prefixes_reach_the_shared_store():
    store = MemoryStore()
    keys, values = chain(4, 4), tensors(4, 4)
    cfg = config("a", replica_id="http://engine-a:8000", events_endpoint=None)
    async with Running(cfg, shared_store=store) as run:
        (a,) = run.agents
        put_chain(a, keys[:2], values[:2])
        a.store.put(keys[2], values[2], parent=keys[1])
        a.store.move(keys[0], 1)  # a tier move: nothing new
        await a.publisher.flush()
        await a.shared.drain()
        entries = await store.read("0-0", 100, 0)
        got = [(ev.replica, ev.hashes, ev.gateway, ev.seq) for _, ev in entries]
        # one batch: the longest chain only (its prefix would say nothing more)
        assert got == [("http://engine-a:8000", tuple(keys[:3]), "agent:a", 1)]
        store.set_available(False)  # an outage: chains wait, then go out with their seqs
        a.store.put(keys[3], values[3], parent=keys[2])
        await a.publisher.flush()
        while a.shared.failures == 0:
            await asyncio.sleep(0)
        store.set_available(True)
        await a.shared.drain()
        last = (await store.read("0-0", 100, 0))[-1][1]
        assert last.hashes == tuple(keys) and last.seq == 2
        stats = (await run.http[0].get("/v1/stats")).json()
        assert stats["shared"]["published"] == 2 and stats["events"]["endpoint"] is None


async def test_held_prefixes_reach_redis(redis_fixture):
    from gateway.state.redis_store import RedisStore

    keys, values = chain(5, 3), tensors(5, 3)
    cfg = config("a", replica_id="r-a", redis_url=redis_fixture.url, namespace="agenttest")
    async with Running(cfg) as run:
        (a,) = run.agents
        put_chain(a, keys, values)
        await a.publisher.flush()
        await a.shared.drain()
    reader = RedisStore(redis_fixture.url, namespace="agenttest")
    try:
        entries = await reader.read("0-0", 100, 0)
        assert [(ev.replica, ev.hashes) for _, ev in entries][-1] == ("r-a", tuple(keys))
    finally:
        await reader.close()


def test_kvgate_agent_process_serves_its_data_port_and_api():
    port, data_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "agent", "--port", str(port), "--data-port",
         str(data_port), "--events", "tcp://127.0.0.1:*", "--device", "cpu", "--gpu-gib", "0.01",
         "--cpu-gib", "0.01"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):  # start-up poll
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
        keys, values = chain(6, 3), tensors(6, 3)

        async def push() -> int:
            client = TcpTransport()
            try:
                blocks = [Block(k, v) for k, v in zip(keys, values, strict=True)]
                return await client.push(f"127.0.0.1:{data_port}", blocks)
            finally:
                await client.close()

        assert asyncio.run(push()) == 3
        look = httpx.post(base + "/v1/lookup", json={"hashes": keys}).json()
        assert look["prefix_blocks"] == 3 and look["tiers"] == ["GPU"] * 3
        assert httpx.get(base + "/v1/stats").json()["events"]["next_seq"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0


def test_agent_rejects_a_shared_store_without_replica_id():
    with pytest.raises(ValueError, match="replica_id"):
        AgentConfig(redis_url="redis://127.0.0.1:1")
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "agent", "--redis-url", "redis://127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2 and "replica_id" in out.stderr

