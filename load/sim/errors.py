"""The simulator's request errors, in the three shapes vLLM 0.33 answers with. No IO.

* a schema failure (wrong type, missing field), from ``validation_exception_handler``: 400, ``type``
  ``"Bad Request"``, ``param`` ``"body.<field>"``, ``message`` ``"1 validation error:\\n  {...}"``
  (:func:`validation_error`);
* a ``VLLMValidationError``, via ``create_error_response``: 400 ``BadRequestError``, its ``str()``
  suffixed ``" (parameter=P, value=V)"`` (:func:`invalid`);
* a plain ``create_error_response(message)``: 400 ``BadRequestError`` without ``param``
  (:func:`refused`), or a :class:`SimError` with another status (404 ``NotFoundError``).

All serialise as ``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP status.
"""

from __future__ import annotations

from http import HTTPStatus

import orjson


class SimError(Exception):
    """A request failure: HTTP ``status``, the client's ``message``, the offending ``param`` and the
    error ``kind`` (vLLM's ``type``; by default derived from the status, e.g. ``BadRequestError``)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or HTTPStatus(status).phrase.replace(" ", "").replace("-", "") + "Error"

    def body(self) -> bytes:
        """vLLM's error JSON; ``code`` is the HTTP status."""
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}
        return orjson.dumps({"error": error})


def invalid(message: str, param: str | None = None, value: object = None) -> SimError:
    """A ``VLLMValidationError``: its ``str()`` appends ``(parameter=..., value=...)``."""
    extras = [f"{k}={v}" for k, v in (("parameter", param), ("value", value)) if v is not None]
    return SimError(400, f"{message} ({', '.join(extras)})" if extras else message, param=param)


def refused(message: str) -> SimError:
    """vLLM's ``create_error_response(message)``: 400 ``BadRequestError`` without ``param``."""
    return SimError(400, message)


def validation_error(loc: str, kind: str, msg: str, value: object, **ctx: object) -> SimError:
    """A pydantic error as vLLM's ``validation_exception_handler`` renders it (``loc`` without
    ``body.``)."""
    error: dict[str, object] = {"type": kind, "loc": f"body.{loc}" if loc else "body", "msg": msg}
    error["input"] = _summary(value)
    if ctx:
        error["ctx"] = ctx
    return SimError(
        400, f"1 validation error:\n  {error}", param=str(error["loc"]), kind=HTTPStatus.BAD_REQUEST.phrase
    )


def _summary(value: object) -> object:
    """vLLM's bounded stand-in for a validation error's ``input``."""
    if isinstance(value, str):
        return value if len(value) <= 200 else value[:200] + "...[truncated]"
    if isinstance(value, list | tuple | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    return str(value)
