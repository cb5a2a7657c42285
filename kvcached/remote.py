"""Fetching blocks from another cluster's kvcached (issue 22): only when policy allows, within a budget of
its own, and only after every peer of this cluster missed. Pure: ``now`` is passed in.

Config (``[remote]``, :mod:`kvcached.config`): ``allow`` (default false: never), ``fetch_bytes_per_s``
(the cross-cluster budget: bytes per second this daemon may pull from other clusters; up to one second's
worth banked) and ``[[remote.peers]]`` (``cluster``, ``address``: the remote daemon's QUIC ``host:port``;
it must present a certificate our ``ca`` trusts with a ``kvcached`` identity, as any peer).

Budget: a token bucket of ``fetch_bytes_per_s`` (burst: one second's worth, at least one
``max_block_bytes``). A fetch is tried only while the bucket holds more than zero bytes; while in flight
it holds one largest block of the bucket (:meth:`RemoteFetchPolicy.hold`, given back when it ends), so
misses that arrive together do not all start on the same full bucket; a block that arrives is charged in
full, so the bucket may go negative (debt) and the next fetch waits until it is repaid: over any window
the bytes pulled are at most ``fetch_bytes_per_s x window + burst + one block``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RemotePeer:
    cluster: str
    address: str


class RemoteFetchPolicy:
    """Whether a cross-cluster fetch may start now, and the bytes it pulled (counters for metrics)."""

    def __init__(self, allow: bool, fetch_bytes_per_s: float, burst_bytes: float, now: float) -> None:
        if fetch_bytes_per_s < 0 or burst_bytes <= 0:
            raise ValueError("fetch_bytes_per_s must be >= 0 and burst_bytes > 0")
        self.allow = allow
        self.rate = fetch_bytes_per_s
        self.burst = burst_bytes
        self._tokens = burst_bytes
        self._at = now
        self.refused = 0
        self.bytes = 0

    def _refill(self, now: float) -> None:
        if now > self._at:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now

    def may_fetch(self, now: float) -> bool:
        """True when remote fetches are allowed and the budget is not in debt (else counts a refusal)."""
        self._refill(now)
        if self.allow and self.rate > 0 and self._tokens > 0:
            return True
        self.refused += 1
        return False

    def hold(self, nbytes: int, now: float) -> None:
        """A fetch starts that may pull up to ``nbytes``: taken from the bucket until :meth:`release`."""
        self._refill(now)
        self._tokens -= nbytes

    def release(self, nbytes: int, now: float) -> None:
        """The fetch that held ``nbytes`` ended (what it pulled is :meth:`charge` d separately)."""
        self._refill(now)
        self._tokens = min(self.burst, self._tokens + nbytes)

    def charge(self, nbytes: int, now: float) -> None:
        """A block of ``nbytes`` came from another cluster."""
        self._refill(now)
        self._tokens -= nbytes
        self.bytes += nbytes
