"""The errors of the disaggregation room.

HandoffFailed    a prefill sub-request gave nothing the decode side can use (an engine error, a
                 body without transfer params, a timeout); the request is then served aggregated on
                 its decode endpoint, so this never reaches a client
"""

from __future__ import annotations


class HandoffFailed(Exception):
    """The prefill half of a disaggregated request failed; ``reason`` is a short metric label (``status``,
    ``timeout``, ``unreachable``, ``bad_response``)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
