"""The one interface every block transport implements.

``peer`` is whatever addresses a remote agent for that transport ("host:port" for TCP, a rank
for torch.distributed).  ``fetch`` returns the blocks the peer holds among ``keys``, in request
order (``prefix=True``: stopping at the first one it lacks); ``push`` hands blocks to the peer's
store and returns how many it did not already hold.  Blocks arrive verified (checksum per block)
and byte-identical; errors are ``errors.TransportError`` subclasses (or ``ChecksumMismatch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ..blockfmt import Block


class BlockTransport(Protocol):
    async def fetch(
        self, peer: Any, keys: Sequence[int], *, prefix: bool = False
    ) -> list[Block]: ...

    async def push(self, peer: Any, blocks: Sequence[Block]) -> int: ...

    async def close(self) -> None: ...
