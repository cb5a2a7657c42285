"""Token budgets per tenant: a token bucket each, reserved at admission and settled afterwards.

At admission the ext_proc knows the prompt's exact token count (it tokenized the prompt to route it)
but not the output's: it reserves ``prompt + max_tokens`` (or a configured default when the request
sets no limit) and settles to the real ``prompt + completion`` once the engine's ``usage`` is known,
refunding the difference (or charging it: the level may go below zero, a debt later requests wait
out). A request that never produced output (refused, engine error, or one that never reached an engine:
its client left while it was held or before it was sent, or the gateway answered it) is refunded in full.
Amounts are never negative: a negative reservation is taken as 0, so nothing raises a bucket past its
capacity or lowers the counters other replicas are sent.

Pure: no clock reads, ``now`` (seconds, monotonic) is a parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from extproc.admission.tenants import Tenant, TokenLimit


class TokenBucket:
    """``capacity`` tokens, refilled continuously at ``rate`` tokens per second.

    :meth:`take` admits only when the whole amount is available; :meth:`adjust` settles afterwards
    and may leave the level negative (debt), never above ``capacity``. :meth:`resize` takes a changed
    limit, keeping what was spent.
    """

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        if rate <= 0 or capacity <= 0:
            raise ValueError("rate and capacity must be > 0")
        self.rate = rate
        self.capacity = capacity
        self.level = capacity
        self._t = now

    def _refill(self, now: float) -> None:
        if now > self._t:
            self.level = min(self.capacity, self.level + (now - self._t) * self.rate)
            self._t = now

    def take(self, amount: float, now: float) -> float:
        """Take ``amount`` tokens (a negative amount is 0: taking never adds): 0.0 when admitted, else the
        seconds until it would be."""
        self._refill(now)
        amount = max(0.0, amount)
        if amount <= self.level:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate

    def adjust(self, delta: float, now: float) -> None:
        """Give back (``delta`` > 0) or charge (``delta`` < 0) tokens after the fact."""
        self._refill(now)
        self.level = min(self.capacity, self.level + delta)

    def resize(self, rate: float, capacity: float, now: float) -> None:
        """A changed limit: what was spent (``capacity - level``, refilled to ``now`` at the old rate)
        stays spent, so the level becomes ``new capacity - spent`` (negative: a debt, waited out at the
        new rate). A limit change never refills a bucket, nor adds a debt."""
        if rate <= 0 or capacity <= 0:
            raise ValueError("rate and capacity must be > 0")
        self._refill(now)
        spent = self.capacity - self.level
        self.rate, self.capacity = rate, capacity
        self.level = capacity - spent


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a reservation was refused: ``retry_after_s`` (whole seconds, >= 1), or ``None`` when the
    request alone exceeds the bucket and can never be admitted."""

    needed: int
    capacity: int
    retry_after_s: int | None


class TokenBudgets:
    """One bucket per tenant with a token limit (kept by tenant id); a changed limit resizes it, keeping what
    was spent (:meth:`TokenBucket.resize`), so a limit change never hands out a fresh budget.

    :attr:`charged` counts, per tenant id, the tokens this object's own reservations and settlements
    took from the buckets (reservations minus refunds, plus charges after the fact): what other replicas
    are told (:mod:`extproc.admission.shared`). Their spending comes in through :meth:`charge`, which
    :attr:`charged` does not count.
    """

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[TokenLimit, TokenBucket]] = {}
        #: Cumulative tokens charged by this replica's own requests, per tenant id (limited tenants only).
        self.charged: dict[str, int] = {}

    def _bucket(self, tenant: Tenant, now: float) -> TokenBucket | None:
        limit = tenant.tokens
        if limit is None:
            return None
        held = self._buckets.get(tenant.id)
        if held is None:
            held = (limit, TokenBucket(limit.per_s, limit.burst, now))
            self._buckets[tenant.id] = held
        elif held[0] != limit:
            held[1].resize(limit.per_s, limit.burst, now)
            held = (limit, held[1])
            self._buckets[tenant.id] = held
        return held[1]

    def reserve(self, tenant: Tenant, tokens: int, now: float) -> Refusal | None:
        """Reserve ``tokens`` (a negative count is 0) from the tenant's bucket; ``None`` when admitted (or
        unlimited). ``tenant`` must be the one in force (its limit replaces the bucket's)."""
        bucket = self._bucket(tenant, now)
        if bucket is None:
            return None
        tokens = max(0, tokens)
        if tokens > bucket.capacity:
            return Refusal(tokens, int(bucket.capacity), None)
        wait = bucket.take(tokens, now)
        if wait == 0.0:
            self.charged[tenant.id] = self.charged.get(tenant.id, 0) + tokens
            return None
        return Refusal(tokens, int(bucket.capacity), max(1, math.ceil(wait)))

    def _live(self, tenant: Tenant, now: float) -> TokenBucket | None:
        """The tenant's bucket in use, whatever limit it was made for (a request admitted before a limit
        change settles into the bucket of the new limit, never replacing it with a fresh full one);
        made from ``tenant`` only if it has none."""
        held = self._buckets.get(tenant.id)
        return held[1] if held is not None else self._bucket(tenant, now)

    def settle(self, tenant: Tenant, reserved: int, actual: int, now: float) -> None:
        """The request really used ``actual`` tokens of the ``reserved``: refund or charge the rest (negative
        counts are 0)."""
        bucket = self._live(tenant, now)
        if bucket is not None:
            reserved, actual = max(0, reserved), max(0, actual)
            bucket.adjust(reserved - actual, now)
            self.charged[tenant.id] = self.charged.get(tenant.id, 0) + actual - reserved

    def charge(self, tenant: Tenant, tokens: int, now: float) -> None:
        """Take ``tokens`` spent elsewhere (another replica) from the tenant's bucket, into debt if need
        be; negative ``tokens`` give back what was refunded there. Not counted in :attr:`charged`."""
        bucket = self._live(tenant, now)
        if bucket is not None:
            bucket.adjust(-tokens, now)

    def level(self, tenant: Tenant, now: float) -> float | None:
        """Tokens available to the tenant now (negative: in debt); ``None`` when unlimited."""
        bucket = self._bucket(tenant, now)
        if bucket is None:
            return None
        bucket.adjust(0, now)
        return bucket.level
