"""Egress budgets: a token bucket per link for requests and one for bytes (formulas: ``README.md``).
Pure: ``now`` is passed in."""

from __future__ import annotations


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` banked (default: one second's worth, at least 1)."""

    def __init__(self, rate: float, now: float, burst: float | None = None) -> None:
        if rate < 0:
            raise ValueError("rate must be >= 0")
        self.rate = rate
        self.burst = max(1.0, rate) if burst is None else burst
        self._tokens = self.burst if rate > 0 else 0.0
        self._at = now

    def _refill(self, now: float) -> None:
        if now > self._at:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now

    def available(self, now: float) -> float:
        self._refill(now)
        return self._tokens

    def take(self, amount: float, now: float) -> bool:
        """Take ``amount`` tokens if they are all there; a rate of 0 allows nothing."""
        self._refill(now)
        if self.rate <= 0 or amount > self._tokens:
            return False
        self._tokens -= amount
        return True

    def give_back(self, amount: float) -> None:
        self._tokens = min(self.burst, self._tokens + amount)


class EgressBudget:
    """What one link may still carry: requests and bytes, both taken or neither. ``requests`` and
    ``bytes`` count what was used (for metrics)."""

    def __init__(self, requests_per_s: float, bytes_per_s: float, now: float) -> None:
        self._requests = TokenBucket(requests_per_s, now)
        # A body may be larger than one second's budget: bank up to 1 s, but never less than 1 MiB, so a
        # link with a small byte rate still passes a long prompt now and then.
        self._bytes = TokenBucket(bytes_per_s, now, burst=max(bytes_per_s, 1024.0 * 1024.0))
        self.requests = 0
        self.bytes = 0

    def take(self, body_bytes: int, now: float) -> bool:
        if not self._requests.take(1.0, now):
            return False
        if not self._bytes.take(float(body_bytes), now):
            self._requests.give_back(1.0)
            return False
        self.requests += 1
        self.bytes += body_bytes
        return True
