"""Errors raised by the policies package."""


class PolicyError(Exception):
    """Base class for policy errors."""


class PolicyConfigError(PolicyError, ValueError):
    """Unknown policy name or invalid parameter: raised at start-up."""


class NoReplicaError(PolicyError):
    """No healthy replica can serve the request."""

    def __init__(self, model: str, reason: str = "no healthy replica") -> None:
        super().__init__(f"{reason} for model {model!r}")
        self.model = model
        self.reason = reason
