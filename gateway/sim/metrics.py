"""The simulated replica's /metrics page: Prometheus text with vLLM's metric names, as
prometheus_client writes it (load gauges, prefix-cache counters, and the cache size as the labels
of ``vllm:cache_config_info``), and ``kvgate:kv_pull_info`` when it pulls KV from peers (the
gateway's ``migrate=auto`` uses pulls only towards replicas that say so)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import SimEngine


def metrics_text(engine: SimEngine) -> bytes:
    """Prometheus text exposition with vLLM's metric names (as prometheus_client writes it)."""
    label = '{model_name="' + _escape_label(engine.config.model) + '"}'
    s = engine.stats
    rows = (
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", engine.running),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", engine.waiting),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", engine.kv_usage),
        ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.", s.prefix_queries),
        ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_hits),
        ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", s.prompt_tokens),
        ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", s.generation_tokens),
    )  # fmt: skip
    out = []
    for name, kind, doc, value in rows:
        out.append(
            f"# HELP {name} {doc}\n# TYPE {name} {kind}\n{name}{label} {float(value)!r}\n"
        )
    cfg = engine.config  # as vLLM reports its cache: the config as labels of a constant gauge
    out.append(
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="{cfg.block_size}",enable_prefix_caching='
        f'"{cfg.cache_blocks > 0}",engine="0",num_gpu_blocks="{cfg.cache_blocks}"}} 1.0\n'
    )
    if cfg.kv_bandwidth_gbps > 0 and cfg.kv_block_bytes > 0:  # it pulls KV from peers
        out.append(
            "# HELP kvgate:kv_pull_info KV pulls from a peer (kv_transfer_params.kvgate_pull_from)\n"
            "# TYPE kvgate:kv_pull_info gauge\n"
            f'kvgate:kv_pull_info{{kv_bytes_per_token="{cfg.kv_block_bytes / cfg.block_size:g}",'
            f'link_gbps="{cfg.kv_bandwidth_gbps:g}"}} 1.0\n'
        )
    return "".join(out).encode()


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
