"""Peer health: a peer that fails (unreachable, 5xx, a streamed answer slower than ``slow_s``) is skipped for
``min(down_max_s, down_base_s x 2^(k-1))`` seconds after its ``k``-th failure in a row, then tried
again; one success resets ``k``. Pure: ``now`` is passed in."""

from __future__ import annotations

import enum


class Outcome(enum.Enum):
    OK = "ok"
    STATUS = "status"  # the peer answered 5xx
    UNREACHABLE = "unreachable"  # connect failure, reset, TLS refused
    SLOW = "slow"  # no answer within slow_s
    REFUSED = "refused"  # 401: the peer's link does not trust this cluster's tenants (with [auth])


class PeerHealth:
    def __init__(self, base_s: float, max_s: float) -> None:
        self._base = base_s
        self._max = max_s
        self.failures = 0
        self.down_until = 0.0

    def usable(self, now: float) -> bool:
        return now >= self.down_until

    def observe(self, outcome: Outcome, now: float) -> None:
        if outcome is Outcome.OK:
            self.failures = 0
            self.down_until = 0.0
            return
        self.failures += 1
        self.down_until = now + min(self._max, self._base * 2.0 ** (self.failures - 1))


def outcome_of(
    status: int | None, first_byte_s: float | None, slow_s: float, *, streamed: bool = True
) -> Outcome | None:
    """A forwarded request's outcome from its HTTP status and its time to the response headers; ``None``:
    it says nothing of the peer. ``status`` ``None``: no response at all (unreachable); ``0``: Envoy's
    completion log of a request whose client left first (none). ``slow`` is judged only on a ``streamed``
    request: a non-streamed answer's first byte is its last (the whole generation), never a sign of a
    slow peer."""
    if status is None:
        return Outcome.UNREACHABLE
    if status == 0:
        return None
    if status >= 500:
        return Outcome.STATUS
    if streamed and first_byte_s is not None and first_byte_s > slow_s:
        return Outcome.SLOW
    return Outcome.OK
