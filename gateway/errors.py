"""The gateway's one error hierarchy.  Every client-facing error is OpenAI-shaped JSON:
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`` with the right status.
Library errors (httpx, orjson, policies) are translated at the boundary with ``raise X from exc``.
"""

from __future__ import annotations

import orjson


class KvgateError(Exception):
    status = 500
    type = "server_error"
    code: str | None = "internal_error"
    retry_after: int | None = None  # seconds, sent as ``retry-after`` when set

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


class BadRequest(KvgateError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(KvgateError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(KvgateError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(KvgateError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class PayloadTooLarge(KvgateError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(KvgateError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    retry_after = 1


class UpstreamError(KvgateError):
    """The replica failed (connection refused or reset, bad status, broken stream)."""

    status = 502
    type = "upstream_error"
    code = "bad_gateway"


class NoReplicaAvailable(KvgateError):
    status = 503
    type = "service_unavailable"
    code = "no_replica_available"


class UpstreamTimeout(KvgateError):
    status = 504
    type = "upstream_error"
    code = "upstream_timeout"


class ConfigError(KvgateError):
    """Bad configuration: raised at start-up, never on the request path."""
