"""The error hierarchy of the ext_proc package.

Every failure a client can cause or observe is a :class:`GatewayError`. Exactly one boundary
(:mod:`extproc.processor`) turns it into an Envoy ImmediateResponse carrying an OpenAI-style JSON
error body; nothing else formats errors for clients.

    GatewayError                 status, OpenAI ``type`` and ``code`` (OpenAI's own ``type`` per status:
                                 ``invalid_request_error`` for a 400, 401 and 404 alike)
    ├── BadRequest               400 invalid_request_error (bad JSON, wrong types, non-UTF-8, ...)
    │   └── ContextLengthExceeded    code context_length_exceeded (the prompt fills the context)
    ├── Unauthorized             401 invalid_request_error (OpenAI's, e.g. code invalid_api_key)
    ├── Forbidden                403 permission_error
    ├── NotFound                 404 invalid_request_error (unknown model: code model_not_found; path)
    ├── PayloadTooLarge          413 invalid_request_error
    ├── TooManyRequests          429 rate_limit_error (flow control, token budget; Retry-After)
    └── Unavailable              503 service_unavailable (no ready endpoint)

Configuration errors are :class:`contracts.errors.ConfigError` (they never reach a client).
"""

from __future__ import annotations

from typing import ClassVar

import orjson


class GatewayError(Exception):
    """A request-level failure with an HTTP status and an OpenAI error type."""

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> bytes:
        """The OpenAI-style JSON error body: ``{"error": {message, type, param, code}}``."""
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.error_type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )


class BadRequest(GatewayError):
    status = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(BadRequest):
    """The prompt leaves no room in the model's context: OpenAI's string code ``context_length_exceeded``
    (vLLM sends the integer 400 instead; :mod:`extproc.routing.length`)."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message, code="context_length_exceeded", param=param)


class Unauthorized(GatewayError):
    """OpenAI answers a bad key 401 with ``type`` ``invalid_request_error`` (code ``invalid_api_key``)."""

    status = 401
    error_type = "invalid_request_error"


class Forbidden(GatewayError):
    status = 403
    error_type = "permission_error"


class NotFound(GatewayError):
    """OpenAI answers an unknown model 404 with ``type`` ``invalid_request_error`` (code
    ``model_not_found``)."""

    status = 404
    error_type = "invalid_request_error"


class PayloadTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"


class TooManyRequests(GatewayError):
    """``retry_after_s``: whole seconds until a retry can succeed (sent as ``Retry-After``)."""

    status = 429
    error_type = "rate_limit_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message, code=code, param=param)
        self.retry_after_s = retry_after_s


class Unavailable(GatewayError):
    status = 503
    error_type = "service_unavailable"
