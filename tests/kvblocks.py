"""Block helpers shared by the worker-agent tests (import after ``pytest.importorskip("torch")``)."""

from __future__ import annotations

import random

import torch

from worker_agent.blockfmt import byte_view

SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block tokens, kv heads, head dim


def random_block(rng: random.Random, dtype=torch.float16, shape=SHAPE) -> torch.Tensor:
    """A block of arbitrary bit patterns (NaNs included) of ``dtype`` and ``shape``."""
    n = 1
    for d in shape:
        n *= d
    raw = torch.tensor(bytearray(rng.randbytes(n * dtype.itemsize)), dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (bitwise: NaN payloads count)."""
    return (
        a.dtype == b.dtype
        and tuple(a.shape) == tuple(b.shape)
        and torch.equal(byte_view(a.cpu()), byte_view(b.cpu()))
    )


def flip_byte(path, offset: int) -> None:
    """Corrupt one byte of a file in place."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0x40]))
