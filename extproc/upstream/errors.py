"""The errors of the upstream client.

    UpstreamError        a sub-request got no usable answer; ``reason`` is a short metric label
    ├── UpstreamTimeout  no complete answer within the request's bound (``timeout``)
    ├── Unreachable      no connection, or it broke before the answer was read (``unreachable``)
    └── UpstreamStatus   an answer that is not 2xx (``status``; ``status`` holds the code)

Lower-level errors (aiohttp, OS) are translated with ``raise ... from exc``; nothing else escapes.
"""

from __future__ import annotations


class UpstreamError(Exception):
    reason = "error"


class UpstreamTimeout(UpstreamError):
    reason = "timeout"


class Unreachable(UpstreamError):
    reason = "unreachable"


class UpstreamStatus(UpstreamError):
    reason = "status"

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
