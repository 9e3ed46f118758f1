"""Errors raised by the worker agent (one module; library errors are translated at the boundary)."""

from __future__ import annotations


class AgentError(Exception):
    """Base class of every worker-agent error."""


class BlockFormatError(AgentError):
    """A serialised block (header or payload) is malformed."""


class ChecksumMismatch(BlockFormatError):
    """A block's payload (or header) does not match its checksum."""

    def __init__(self, key: int | None, expected: int, actual: int, what: str = "payload") -> None:
        self.key = key
        self.expected = expected
        self.actual = actual
        name = "?" if key is None else f"{key:016x}"
        super().__init__(
            f"block {name}: {what} checksum mismatch (expected {expected:#x}, got {actual:#x})"
        )


class CapacityError(AgentError):
    """A block is larger than every tier that could hold it."""


class TransportError(AgentError):
    """A transfer between agents failed."""


class TruncatedFrame(TransportError):
    """The peer closed the connection in the middle of a frame."""


class PeerGone(TransportError):
    """The peer cannot be reached or closed the connection."""


class TransferTimeout(TransportError):
    """A transfer did not complete within its timeout."""


class ProtocolError(TransportError):
    """The peer sent something the protocol does not allow."""


class RemoteError(TransportError):
    """The peer reported an error while handling our request."""
