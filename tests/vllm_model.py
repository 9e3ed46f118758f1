"""A tiny random Llama that a real vLLM can serve, made here because no model can be downloaded.

Recipe (everything that decides the files; its hash names the cache folder, so a second run reuses
the model and a changed recipe makes a new one):

- tokenizer: byte-level BPE (HF ``tokenizers``), vocab ``VOCAB``, trained on a fixed list of the
  interpreter's own stdlib sources (text that exists on every machine with that Python), wrapped in
  ``PreTrainedTokenizerFast`` with ``<s>``/``</s>`` and the chat template ``CHAT_TEMPLATE``;
- model: ``LlamaForCausalLM`` with random weights from ``torch.manual_seed(SEED)``: hidden 256,
  2 layers, 4 heads, 2 KV heads (head_dim 64: vLLM's CPU attention needs head_dim >= 64),
  bfloat16 (what vLLM runs on CPU).

Run as a script with the vLLM venv's python (it has torch, transformers and tokenizers; kvgate's own
venv has none of them): ``python tests/vllm_model.py CACHE_ROOT`` prints the model folder.
:func:`ensure_model` does that from the test process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig

VOCAB = 2048
SEED = 1234
HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 512
MAX_POSITIONS = 4096
DTYPE = "bfloat16"  # what vLLM runs on CPU
# Stdlib files the BPE learns from (relative to the stdlib folder): plain English and code.
CORPUS = (
    "textwrap.py",
    "string.py",
    "argparse.py",
    "json/__init__.py",
    "json/decoder.py",
    "functools.py",
    "heapq.py",
    "bisect.py",
    "dataclasses.py",
    "enum.py",
    "pathlib.py",
    "shlex.py",
    "difflib.py",
    "contextlib.py",
    "this.py",
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def recipe() -> dict:
    """Everything the model files depend on (the cache key hashes this)."""
    return {
        "format": 1,
        "vocab": VOCAB,
        "seed": SEED,
        "hidden": HIDDEN,
        "layers": LAYERS,
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "intermediate": INTERMEDIATE,
        "max_positions": MAX_POSITIONS,
        "dtype": DTYPE,
        "corpus": CORPUS,
        "chat_template": CHAT_TEMPLATE,
    }


def recipe_hash(python_version: str) -> str:
    blob = json.dumps({**recipe(), "python": python_version}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _corpus_text() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    texts = []
    for rel in CORPUS:
        with open(os.path.join(root, rel), encoding="utf-8") as fh:
            texts.append(fh.read())
    return texts


def _build_tokenizer(out: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<pad>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def _build_model(out: str, tokenizer) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype=DTYPE,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, DTYPE))
    model.save_pretrained(out, safe_serialization=True)


def build(cache_root: str) -> str:
    """Make the model under ``cache_root`` unless it is there; returns its folder."""
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    final = os.path.join(cache_root, f"tiny-llama-{recipe_hash(version)}")
    if os.path.exists(os.path.join(final, ".complete")):
        return final
    os.makedirs(cache_root, exist_ok=True)
    tmp = f"{final}.tmp{os.getpid()}"
    try:
        tokenizer = _build_tokenizer(tmp)
        _build_model(tmp, tokenizer)
        with open(os.path.join(tmp, "recipe.json"), "w", encoding="utf-8") as fh:
            json.dump({**recipe(), "python": version}, fh, indent=1)
        open(os.path.join(tmp, ".complete"), "w").close()
        shutil.rmtree(final, ignore_errors=True)  # a half-made folder from a killed run
        os.rename(tmp, final)
    except OSError:  # another process finished first: use its copy
        if not os.path.exists(os.path.join(final, ".complete")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def ensure_model(python: str, cache_root: str, timeout: float = 300.0) -> str:
    """Build (or find) the model with the vLLM venv's ``python``; returns the model folder."""
    out = subprocess.run(
        [python, os.path.abspath(__file__), cache_root],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    if out.returncode != 0:
        raise RuntimeError(f"building the tiny model failed:\n{out.stderr[-4000:]}")
    return out.stdout.strip().splitlines()[-1]


if __name__ == "__main__":
    print(build(sys.argv[1]))
