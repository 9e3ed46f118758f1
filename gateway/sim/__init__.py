"""Simulated OpenAI-compatible LLM replicas with a prefix cache and a timing model.

Layers: :mod:`.model` (pure cache/timing/output), :mod:`.tokenizer` (pure), :mod:`.engine`
(admission and counters, time through an injected clock), :mod:`.protocol` (OpenAI wire format),
:mod:`.server` (raw ASGI), :mod:`.runner` (many replicas on consecutive ports), :mod:`.kvpull`
(metadata-only KV pulls between replicas, asked for in ``kv_transfer_params``).
"""

from .cli_args import add_sim_arguments, sim_config_from_args
from .clock import Clock, LoopClock, VirtualTimeLoop, run_virtual
from .config import SimConfig, SimFaults
from .engine import Job, SimEngine, SimStats
from .model import PrefixCache, PromptBlocks, expected_text, output_pieces
from .runner import run_sims, sim_specs, sim_specs_for_ports, sim_urls, start_sims
from .server import SimApp, SimulatedDisconnect, build_sim_app
from .tokenizer import render_chat_prompt, tokenize

__all__ = [
    "Clock",
    "Job",
    "LoopClock",
    "PrefixCache",
    "PromptBlocks",
    "SimApp",
    "SimConfig",
    "SimEngine",
    "SimFaults",
    "SimStats",
    "SimulatedDisconnect",
    "VirtualTimeLoop",
    "add_sim_arguments",
    "build_sim_app",
    "expected_text",
    "output_pieces",
    "render_chat_prompt",
    "run_sims",
    "run_virtual",
    "sim_config_from_args",
    "sim_specs",
    "sim_specs_for_ports",
    "sim_urls",
    "start_sims",
    "tokenize",
]
