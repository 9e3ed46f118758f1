"""Bytes per engine token, learnt from usage: the unit, and a real gateway in front of a sim."""

from __future__ import annotations

import httpx
import pytest

from gateway.features import CHAT, parse_request
from gateway.tokenrate import TokenRates
from tests.topology import running_topology


def test_the_rate_starts_at_four_then_follows_what_engines_report() -> None:
    rates = TokenRates(alpha=0.1)
    assert rates.get("m") == 4
    rates.observe("m", 700, 100)
    assert rates.get("m") == pytest.approx(7.0)  # the first sample is the rate
    rates.observe("m", 500, 100)
    assert rates.get("m") == pytest.approx(6.0)  # a running mean while samples are few
    for _ in range(200):
        rates.observe("m", 300, 100)
    assert rates.get("m") == pytest.approx(3.0, abs=0.01)  # then an EWMA: it follows
    rates.observe("m", 10**6, 1)  # absurd reports are clamped
    assert rates.get("m") < 3.0 + 0.1 * 32
    rates.observe("m", 0, 10)
    rates.observe("m", 10, 0)  # nothing to learn from
    assert rates.get("other") == 4 and set(rates.snapshot()) == {"m"}
    with pytest.raises(ValueError):
        TokenRates(alpha=0)


def test_features_count_tokens_at_the_models_rate() -> None:
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"w" * 2000 + b'"}]}'
    plain = parse_request(CHAT, body, {}).features
    slow = parse_request(CHAT, body, {}, bytes_per_token={"tiny": 8.0}.get).features
    assert plain.prompt_bytes == slow.prompt_bytes > 2000
    assert plain.prompt_tokens == plain.prompt_bytes // 4
    assert slow.prompt_tokens == plain.prompt_bytes // 8 and slow.tokens_per_hash == 32
    assert slow.prefix_hashes == plain.prefix_hashes  # the hashes do not depend on the rate


async def test_predicted_cached_tokens_match_the_engines_count_once_calibrated() -> None:
    """The simulator's words are ~6 bytes per token: at 4 the prediction would be 1.5x off."""
    doc = "a shared document about key value caches " * 60
    body = {"model": "tiny", "max_tokens": 2,
            "messages": [{"role": "system", "content": doc}, {"role": "user", "content": "hi"}]}
    async with running_topology(1) as topo:
        async with httpx.AsyncClient(timeout=10) as c:
            for _ in range(3):
                r = await c.post(topo.base_url + "/v1/chat/completions", json=body)
                assert r.status_code == 200
            rate = topo.gateway.state.proxy.token_rates.get("tiny")
    usage = r.json()["usage"]
    predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
    actual = usage["prompt_tokens_details"]["cached_tokens"]
    assert actual > 300 and abs(predicted - actual) <= 0.1 * actual, (predicted, actual)
    assert rate > 5
