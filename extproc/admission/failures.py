"""Failed authentication, limited per client address: a guessing client is slowed, nobody else is.

Each client address that fails authentication (a 401: missing, unknown or rejected credentials) gets a
token bucket of ``burst`` attempts refilled at ``per_minute / 60`` per second; every failure takes one.
While an address's bucket holds less than one attempt, *every* request from it is answered 429 with
``Retry-After`` before its credentials are looked at, so a correct guess cannot be told from a wrong
one until the wait is over. Successful requests take nothing, and an address that never failed has no
bucket. The address is the one Envoy saw (its ``source.address`` request attribute, the peer or, behind
``trusted_hops`` proxies, the client they name), never a header a client wrote; a request without it
(an ext_proc not behind kvgate's Envoy config) is not limited.

At most ``max_addresses`` buckets are kept, least recently failed evicted first: an attacker rotating
through addresses cannot grow memory, only reset the oldest buckets (the usual price of a bounded
table). Buckets are per ext_proc process: with N ext_procs an address gets up to N times the burst.

Pure: ``now`` (seconds, monotonic) is a parameter.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FailedAuthLimit:
    """``[auth] failed_auth_per_minute`` / ``failed_auth_burst``: the refill rate and depth of each
    address's bucket of failed attempts; ``max_addresses``: buckets kept at most."""

    per_minute: int = 60
    burst: int = 20
    max_addresses: int = 65_536


@dataclass(slots=True)
class _Bucket:
    level: float
    at: float


class FailedAuth:
    """Per-address buckets of failed authentication attempts (module docstring)."""

    def __init__(self, limit: FailedAuthLimit) -> None:
        if limit.per_minute < 1 or limit.burst < 1 or limit.max_addresses < 1:
            raise ValueError("per_minute, burst and max_addresses must be >= 1")
        self.limit = limit
        self._rate = limit.per_minute / 60.0
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def retry_after_s(self, address: str | None, now: float) -> int | None:
        """Whole seconds until ``address`` may try again, or ``None`` when it may try now."""
        bucket = self._refilled(address, now)
        if bucket is None or bucket.level >= 1.0:
            return None
        return max(1, math.ceil((1.0 - bucket.level) / self._rate))

    def failed(self, address: str | None, now: float) -> None:
        """``address`` failed to authenticate: one attempt less (its bucket is made on first failure)."""
        if address is None:
            return
        bucket = self._refilled(address, now)
        if bucket is None:
            bucket = self._buckets[address] = _Bucket(float(self.limit.burst), now)
            if len(self._buckets) > self.limit.max_addresses:
                self._buckets.popitem(last=False)
        self._buckets.move_to_end(address)
        bucket.level -= 1.0

    def _refilled(self, address: str | None, now: float) -> _Bucket | None:
        bucket = None if address is None else self._buckets.get(address)
        if bucket is None:
            return None
        if now > bucket.at:
            bucket.level = min(float(self.limit.burst), bucket.level + (now - bucket.at) * self._rate)
            bucket.at = now
        return bucket
