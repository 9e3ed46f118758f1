"""The simulated engine and its ASGI app under virtual time (no real sleeping anywhere)."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.sim import (
    LoopClock,
    PromptBlocks,
    SimConfig,
    SimEngine,
    SimFaults,
    SimulatedDisconnect,
    build_sim_app,
    expected_text,
    render_chat_prompt,
    run_virtual,
)
from policies.hashing import model_seed

MS = 0.001


def prompt_of(n_tokens: int, start: int = 0, block_size: int = 16) -> PromptBlocks:
    ids = list(range(start, start + n_tokens))
    return PromptBlocks.from_tokens(ids, block_size, model_seed("tiny"))


def engine_with(**kw) -> SimEngine:
    base = dict(prefill_s_per_token=1 * MS, decode_s_per_token=2 * MS)
    base.update(kw)
    return SimEngine(SimConfig(**base), LoopClock())


# -- virtual time itself -----------------------------------------------------------------------


def test_virtual_loop_jumps_time_and_orders_by_deadline():
    async def main():
        loop = asyncio.get_running_loop()
        order = []

        async def at(delay, tag):
            await asyncio.sleep(delay)
            order.append((tag, loop.time()))

        await asyncio.gather(at(3600, "late"), at(5, "early"), at(60, "mid"))
        return order

    assert run_virtual(main()) == [("early", 5.0), ("mid", 60.0), ("late", 3600.0)]


# -- timing and admission ----------------------------------------------------------------------


def test_ttft_is_prefill_of_uncached_tokens_then_decode_per_token():
    async def main():
        eng = engine_with()
        job = await eng.complete(prompt_of(100), 5)
        return job

    job = run_virtual(main())
    assert job.ttft == pytest.approx(100 * MS)  # 100 uncached tokens at 1 ms
    assert job.finished_at == pytest.approx(100 * MS + 4 * 2 * MS)  # then 4 more tokens at 2 ms
    assert job.cached_tokens == 0 and job.produced == 5


def test_cached_prefix_shortens_ttft():
    async def main():
        eng = engine_with()
        first = await eng.complete(prompt_of(100), 1)
        second = await eng.complete(prompt_of(100), 1)
        return eng, first, second

    eng, first, second = run_virtual(main())
    assert second.cached_tokens == 96  # 6 full blocks of 16
    assert second.ttft == pytest.approx(4 * MS)
    assert first.ttft == pytest.approx(100 * MS)
    assert (eng.stats.prefix_queries, eng.stats.prefix_hits) == (200, 96)
    assert eng.stats.prompt_tokens == 200 and eng.stats.generation_tokens == 2


def test_max_running_one_makes_the_second_request_wait_fifo():
    async def main():
        eng = engine_with(max_running=1)
        a = asyncio.create_task(eng.complete(prompt_of(100, 0), 1))
        b = asyncio.create_task(eng.complete(prompt_of(50, 1000), 1))
        c = asyncio.create_task(eng.complete(prompt_of(10, 2000), 1))
        await asyncio.sleep(1 * MS)  # virtual: a is prefilling, b and c queue
        seen = (eng.running, eng.waiting)
        jobs = await asyncio.gather(a, b, c)
        return eng, seen, jobs

    eng, seen, (a, b, c) = run_virtual(main())
    assert seen == (1, 2)
    assert a.finished_at == pytest.approx(100 * MS)
    assert b.admitted_at == pytest.approx(a.finished_at)
    assert b.ttft == pytest.approx(150 * MS)  # 100 ms queueing + 50 ms prefill
    assert c.admitted_at == pytest.approx(150 * MS) and c.finished_at == pytest.approx(160 * MS)
    assert (eng.running, eng.waiting, eng.stats.requests_served) == (0, 0, 3)


def test_cancelled_waiter_leaves_the_queue_and_slots_are_not_leaked():
    async def main():
        eng = engine_with(max_running=1)
        a = asyncio.create_task(eng.complete(prompt_of(100), 1))
        b = asyncio.create_task(eng.complete(prompt_of(100, 500), 1))
        await asyncio.sleep(10 * MS)
        assert eng.waiting == 1
        b.cancel()
        await asyncio.gather(b, return_exceptions=True)
        waiting_after_cancel = eng.waiting
        await a
        c = await eng.complete(prompt_of(10, 900), 1)  # admitted at once
        return eng, waiting_after_cancel, c

    eng, waiting, c = run_virtual(main())
    assert waiting == 0
    assert c.admitted_at == c.queued_at
    assert eng.running == 0 and eng.stats.requests_served == 2


def test_cancel_while_running_aborts_and_frees_blocks():
    async def main():
        eng = engine_with(max_running=1, cache_blocks=100)
        a = asyncio.create_task(eng.complete(prompt_of(64), 10))
        await asyncio.sleep(69 * MS)  # prefill done at 64 ms, tokens at 64, 66, 68
        usage = eng.kv_usage
        a.cancel()
        await asyncio.gather(a, return_exceptions=True)
        return eng, usage

    eng, usage = run_virtual(main())
    assert usage == pytest.approx(5 / 100)  # 64 prompt + 3 generated tokens -> 5 blocks
    assert eng.kv_usage == 0.0 and eng.running == 0
    assert eng.stats.requests_aborted == 1 and eng.stats.requests_served == 0


def test_zero_costs_never_sleep():
    async def main():
        loop = asyncio.get_running_loop()
        eng = engine_with(prefill_s_per_token=0, decode_s_per_token=0)
        job = await eng.complete(prompt_of(1000), 50)
        return loop.time(), job

    now, job = run_virtual(main())
    assert now == 0.0 and job.ttft == 0.0 and job.produced == 50


def test_error_rate_is_seeded_and_counted():
    def draws(seed):
        eng = SimEngine(SimConfig(faults=SimFaults(error_rate=0.3), seed=seed))
        return eng, [eng.draw_error() for _ in range(200)]

    eng, a = draws(1)
    assert a == draws(1)[1] and a != draws(2)[1]
    assert 30 < sum(a) < 90
    assert eng.stats.requests_failed == sum(a) and eng.stats.requests_received == 200
    eng.reset()
    assert [eng.draw_error() for _ in range(200)] == a  # reset reseeds


def test_reset_empties_the_cache_and_the_tokenizer_memo():
    """So a benchmark that resets between targets gives each the same tokenizing work."""
    async def main():
        eng = engine_with()
        await eng.complete(eng.prompt_from_segments(["<|im_start|>system\n" + "be brief. " * 40 + "<|im_end|>\n"]), 1)
        return eng

    eng = run_virtual(main())
    before = eng.state()
    assert before["tokenizer_memoised_tokens"] > 0 and before["cache_blocks_used"] > 0
    eng.reset()
    after = eng.state()
    assert after["tokenizer_memoised_tokens"] == 0 and after["cache_blocks_used"] == 0


def test_metrics_text_matches_counters():
    from prometheus_client.parser import text_string_to_metric_families

    async def main():
        eng = engine_with()
        await eng.complete(prompt_of(40), 3)
        await eng.complete(prompt_of(40), 3)
        return eng

    eng = run_virtual(main())
    samples = {
        s.name: s
        for fam in text_string_to_metric_families(eng.metrics_text().decode())
        for s in fam.samples
    }
    assert samples["vllm:prefix_cache_queries_total"].value == 80
    assert samples["vllm:prefix_cache_hits_total"].value == 32
    assert samples["vllm:prompt_tokens_total"].value == 80
    assert samples["vllm:generation_tokens_total"].value == 6
    assert samples["vllm:num_requests_running"].value == 0
    assert samples["vllm:kv_cache_usage_perc"].labels == {"model_name": "tiny"}


# -- the ASGI app under virtual time -----------------------------------------------------------


class Conn:
    """A fake ASGI connection: one request body, then a disconnect when told."""

    def __init__(self, path: str, body: dict | None = None, method: str = "POST") -> None:
        self.scope = {"type": "http", "method": method, "path": path, "headers": []}
        self.body = json.dumps(body or {}).encode()
        self.sent: list[tuple[float, dict]] = []
        self.gone = asyncio.Event()
        self._read = False

    async def receive(self) -> dict:
        if not self._read:
            self._read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, msg: dict) -> None:
        self.sent.append((asyncio.get_running_loop().time(), msg))

    def bodies(self) -> list[tuple[float, bytes]]:
        return [(t, m["body"]) for t, m in self.sent if m["type"] == "http.response.body"]


CHAT = [{"role": "user", "content": "tell me something " * 30}]


def test_stream_chunks_arrive_at_model_times():
    async def main():
        app = build_sim_app(SimConfig(prefill_s_per_token=1 * MS, decode_s_per_token=2 * MS))
        conn = Conn("/v1/chat/completions", {"messages": CHAT, "stream": True, "max_tokens": 3})
        await app(conn.scope, conn.receive, conn.send)
        return app, conn

    app, conn = run_virtual(main())
    n_prompt = app.engine.stats.prompt_tokens
    times = [t for t, body in conn.bodies()]
    ttft = n_prompt * MS
    assert conn.sent[0][0] == 0.0 and conn.sent[0][1]["status"] == 200  # headers at once
    assert times == pytest.approx([ttft, ttft + 2 * MS, ttft + 4 * MS])
    text = b"".join(b for _, b in conn.bodies())
    assert text.endswith(b"data: [DONE]\n\n") and text.count(b"data: ") == 6
    contents = [
        json.loads(line[6:])["choices"][0]["delta"].get("content", "")
        for line in text.split(b"\n\n")
        if line.startswith(b"data: {")
    ]
    assert "".join(contents) == expected_text(render_chat_prompt(CHAT), 3)


def test_disconnect_while_queued_or_running_frees_the_replica():
    async def main():
        app = build_sim_app(SimConfig(max_running=1, prefill_s_per_token=1 * MS))
        one = Conn("/v1/chat/completions", {"messages": CHAT, "stream": True})
        two = Conn("/v1/chat/completions", {"messages": CHAT})
        t1 = asyncio.create_task(app(one.scope, one.receive, one.send))
        t2 = asyncio.create_task(app(two.scope, two.receive, two.send))
        await asyncio.sleep(5 * MS)
        before = (app.engine.running, app.engine.waiting)
        two.gone.set()  # the queued client leaves
        one.gone.set()  # the running client leaves
        await asyncio.gather(t1, t2)
        return app, before, two

    app, before, two = run_virtual(main())
    assert before == (1, 1)
    assert (app.engine.running, app.engine.waiting) == (0, 0)
    assert app.engine.stats.requests_aborted == 1 and app.engine.stats.requests_served == 0
    assert two.sent == []  # never answered


def test_hang_fault_answers_nothing_until_disconnect():
    async def main():
        app = build_sim_app(SimConfig(faults=SimFaults(hang=True)))
        conn = Conn("/v1/chat/completions", {"messages": CHAT})
        task = asyncio.create_task(app(conn.scope, conn.receive, conn.send))
        await asyncio.sleep(3600)  # an hour of virtual time
        silent = conn.sent == [] and not task.done()
        conn.gone.set()
        await task
        return silent

    assert run_virtual(main()) is True


def test_stall_fault_sends_n_chunks_then_nothing():
    async def main():
        faults = SimFaults(stall_after_chunks=2)
        app = build_sim_app(SimConfig(faults=faults, prefill_s_per_token=0, decode_s_per_token=0))
        conn = Conn("/v1/chat/completions", {"messages": CHAT, "stream": True})
        task = asyncio.create_task(app(conn.scope, conn.receive, conn.send))
        await asyncio.sleep(3600)
        stalled = not task.done()
        conn.gone.set()
        await task
        return app, conn, stalled

    app, conn, stalled = run_virtual(main())
    assert stalled
    body = b"".join(b for _, b in conn.bodies())
    assert body.count(b"data: ") == 2 and b"[DONE]" not in body
    assert all(m.get("more_body") for _, m in conn.sent if m["type"] == "http.response.body")
    assert app.engine.running == 0


def test_close_fault_raises_after_n_chunks():
    async def main():
        app = build_sim_app(SimConfig(faults=SimFaults(close_after_chunks=3)))
        conn = Conn("/v1/chat/completions", {"messages": CHAT, "stream": True})
        with pytest.raises(SimulatedDisconnect):
            await app(conn.scope, conn.receive, conn.send)
        return app, conn

    app, conn = run_virtual(main())
    body = b"".join(b for _, b in conn.bodies())
    assert body.count(b"data: ") == 3
    assert app.engine.running == 0 and app.engine.stats.requests_aborted == 1
