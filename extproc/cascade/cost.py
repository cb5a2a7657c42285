"""What a two-step cascade costs against serving everything on the large model: the arithmetic behind the
cascade benchmark's goal (``load/bench/cascade.py``), sans IO. Formulas and their reading: README.md,
"What a cascade can save".

Two cost readings, both in engine-seconds (the simulator's timing model, ``load/sim/timing.py``:
``step = base + d * decoding + p * prefill_tokens``; the small model's every term divided by ``ratio``):

* **per token** (:func:`token_ratio`): each request is charged what its tokens take on a lone engine,
  ``C(P, n) = P*p + base + (n - 1)*(base + d)`` for ``P`` prompt and ``n`` output tokens, as an API bills
  tokens at a per-model price; batching changes nothing;
* **busy time** (:func:`busy_ratio`): what the benchmark measures, the engines' busy seconds. With Poisson
  arrivals at ``lam`` per replica and a request running ``D`` seconds, a replica is busy a share
  ``1 - exp(-lam * D)`` of the time (M/G/inf: busy while at least one request runs), so a fleet of ``m``
  replicas taking ``lam`` requests a second costs ``m * (1 - exp(-lam * D / m)) / lam`` per request. The
  per-step ``base`` is shared by whatever runs in the step: the busier the replica, the less each request
  pays of it.

A policy (:class:`Policy`) says which hard requests skip the small step (``recall``), which easy ones do
too (``false_skip``), and how many output tokens the small step spends on an escalated request before the
gate stops it (``None``: all of them, a buffered ``mean``/``min`` gate; ``k``: a ``first_k`` gate), and
whether a passing answer is replayed (``replay``: the first attempt cut after ``cut_at`` tokens, then the
whole answer again with the prompt cached, so an answered request also pays ``X = (base + (k - 1)*(base +
d))/c``). The gate itself is taken as exact (every hard answer escalated, every easy one passed), as in the
benchmark.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Costs:
    """The cost model's parameters (seconds at time scale 1; ``lam`` requests per second).

    The defaults repeat the simulator's (``load/sim/timing.py``, which extproc may not import) and the
    cascade benchmark's; tests/extproc/cascade/test_cost.py pins them equal."""

    base_s: float = 0.006
    decode_s: float = 0.00015
    prefill_s_per_token: float = 1 / 20_000
    ratio: float = 8.0
    prompt_tokens: float = 339.0
    output_tokens: float = 64.0
    hard_share: float = 0.3
    time_scale: float = 4.0
    lam: float = 3.0
    all_large_replicas: int = 2
    small_replicas: int = 1
    large_replicas: int = 1

    def lone_s(self, *, small: bool, output_tokens: float | None = None) -> float:
        """``C(P, n)``: one request's seconds alone on an engine (time scale applied)."""
        n = self.output_tokens if output_tokens is None else output_tokens
        c = (
            self.prompt_tokens * self.prefill_s_per_token
            + self.base_s
            + max(0.0, n - 1) * (self.base_s + self.decode_s)
        )
        return self.time_scale * c / (self.ratio if small else 1.0)


@dataclass(frozen=True, slots=True)
class Policy:
    """Which requests the small step sees, and what it spends on those it escalates (module docstring)."""

    recall: float = 0.0
    false_skip: float = 0.0
    cut_at: int | None = None
    replay: bool = False

    def __post_init__(self) -> None:
        if self.replay and self.cut_at is None:
            raise ValueError("replay needs cut_at (a first_k gate)")

    def wasted(self, costs: Costs) -> float:
        """Seconds the small step spends on a request it escalates."""
        n = costs.output_tokens if self.cut_at is None else min(costs.output_tokens, self.cut_at)
        return costs.lone_s(small=True, output_tokens=n)

    def answered(self, costs: Costs) -> float:
        """Seconds the small step spends on a request it answers: ``C/c``, plus ``X`` with ``replay``."""
        cs = costs.lone_s(small=True)
        if not self.replay or self.cut_at is None:
            return cs
        k = min(costs.output_tokens, self.cut_at)
        cut = costs.base_s + max(0.0, k - 1) * (costs.base_s + costs.decode_s)
        return cs + costs.time_scale * cut / costs.ratio


#: The policies the README's table names.
PERFECT = Policy(recall=1.0)
BUFFERED = Policy()


def first_k(k: int, *, replay: bool = False) -> Policy:
    return Policy(cut_at=k, replay=replay)


def token_ratio(costs: Costs, policy: Policy) -> float:
    """Per-token cost of the cascade over all-large:
    ``[h*(rho*C_L + (1-rho)*(W + C_L)) + (1-h)*(phi*C_L + (1-phi)*C_S)] / C_L`` (``C_S``: with ``X``
    under ``replay``)."""
    h, rho, phi = costs.hard_share, policy.recall, policy.false_skip
    cl, cs, w = costs.lone_s(small=False), policy.answered(costs), policy.wasted(costs)
    return (h * (rho * cl + (1 - rho) * (w + cl)) + (1 - h) * (phi * cl + (1 - phi) * cs)) / cl


def fleet_busy_per_request(lam: float, run_s: float, replicas: int) -> float:
    """Busy seconds per request of ``replicas`` replicas sharing ``lam`` requests/s that each run
    ``run_s`` seconds: ``m * (1 - exp(-lam * D / m)) / lam`` (``D`` when ``lam`` -> 0)."""
    if lam <= 0:
        return run_s
    return replicas * -math.expm1(-lam * run_s / replicas) / lam


def busy_ratio(costs: Costs, policy: Policy) -> float:
    """Busy-time cost of the cascade over all-large (module docstring), per request served."""
    h, rho, phi, lam = costs.hard_share, policy.recall, policy.false_skip, costs.lam
    cl, cs, w = costs.lone_s(small=False), policy.answered(costs), policy.wasted(costs)
    easy_small, hard_small = lam * (1 - h) * (1 - phi), lam * h * (1 - rho)
    lam_small = easy_small + hard_small
    run_small = (easy_small * cs + hard_small * w) / lam_small if lam_small > 0 else cs
    lam_large = lam * (h + (1 - h) * phi)
    cascade = (
        lam_small * fleet_busy_per_request(lam_small, run_small, costs.small_replicas)
        + lam_large * fleet_busy_per_request(lam_large, cl, costs.large_replicas)
    ) / lam
    return cascade / fleet_busy_per_request(lam, cl, costs.all_large_replicas)


#: The parameters a sweep halves and doubles (``hard_share`` and the replica counts are not swept here:
#: the first bounds the ratio from below by itself, the others are the benchmark's choice of fleet).
SWEPT = ("base_s", "decode_s", "prefill_s_per_token", "ratio", "prompt_tokens", "output_tokens", "lam")


def sweep(costs: Costs, factors: tuple[float, ...] = (0.5, 2.0)) -> Iterator[tuple[str, float, Costs]]:
    """``costs`` with each :data:`SWEPT` parameter, and ``hard_share``, multiplied by each factor
    (``hard_share`` capped at 1)."""
    for name in (*SWEPT, "hard_share"):
        for f in factors:
            value = getattr(costs, name) * f
            if name == "hard_share":
                value = min(1.0, value)
            yield name, f, replace(costs, **{name: value})
