"""A cascade's declaration: the ``cascade`` object of a virtual model's route (etcd ``models/<name>``, or
``[models."<name>"]`` of the policy file). Pure: parsing and validation only.

    {"cascade": {"steps": ["small-model", "large-model"], "gate": "logprob", "threshold": -0.4,
                 "stat": "mean", "timeout_s": 30}}

``steps``: 2 to :data:`MAX_STEPS` distinct served model names, cheapest first; every step but the last is
gated. ``gate``: ``logprob`` (the only gate). ``threshold``: a log-probability in nats (finite, <= 0); a
step's answer passes when its statistic is at least this. ``stat``: ``mean``, ``min`` or ``first_k`` (then
``k``, an integer >= 1, is required; elsewhere it is refused). ``timeout_s``: the bound on each gated
step's sub-request (past it the request escalates), in (0, :data:`MAX_TIMEOUT_S`], and the gated steps'
bounds together too (Envoy's message timeout is extended once, for every gated step). ``preroute``
(optional, an object, see :mod:`extproc.cascade.prior`): requests the gateway predicts the gate would
escalate go straight to the last step. ``replay`` (optional, a boolean, ``false`` by default; ``stat``
``first_k`` only): a streaming client's request that passes the gate on its first ``k`` tokens is sent
to the same step again, with the same ``seed``, through Envoy, so its tokens stream from the engine
instead of arriving in one piece at the end (README.md, "What it costs a streaming client").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from contracts.config import Section, state_options
from contracts.errors import ConfigError
from extproc.cascade.prior import PrerouteSpec, VerdictRule, parse_preroute

GATES = ("logprob",)
STATS = ("mean", "min", "first_k")
MAX_STEPS = 4
DEFAULT_TIMEOUT_S = 30.0
#: The longest ``timeout_s``: Envoy's message timeout is extended to ``timeout_s + 5`` s while a step runs
#: (``extproc.processor.HOLD_SLACK_S``), and the bundled Envoy caps an extension at 600 s (its
#: ``max_message_timeout``, ``extproc.server.HOLD_TIMEOUT_S``).
MAX_TIMEOUT_S = 595.0
_KEYS = ("steps", "gate", "threshold", "stat", "k", "timeout_s", "preroute", "replay")


@dataclass(frozen=True, slots=True)
class CascadeSpec:
    """A virtual model's cascade (module docstring): ``threshold`` in nats, ``timeout_s`` in seconds."""

    steps: tuple[str, ...]
    threshold: float
    stat: str = "mean"
    k: int | None = None
    gate: str = "logprob"
    timeout_s: float = DEFAULT_TIMEOUT_S
    preroute: PrerouteSpec | None = None
    replay: bool = False

    def __post_init__(self) -> None:
        if not 2 <= len(self.steps) <= MAX_STEPS:
            raise ConfigError(f"steps: expected 2 to {MAX_STEPS} model names, got {len(self.steps)}")
        if len(set(self.steps)) != len(self.steps):
            raise ConfigError(f"steps: a model appears twice in {list(self.steps)}")
        if self.gate not in GATES:
            raise ConfigError(f"gate must be one of {', '.join(GATES)}, got {self.gate!r}")
        if self.stat not in STATS:
            raise ConfigError(f"stat must be one of {', '.join(STATS)}, got {self.stat!r}")
        if not (math.isfinite(self.threshold) and self.threshold <= 0):
            raise ConfigError(f"threshold must be a log-probability (finite, <= 0), got {self.threshold}")
        if self.stat == "first_k" and (self.k is None or self.k < 1):
            raise ConfigError(f"stat first_k needs k, an integer >= 1, got {self.k}")
        if self.stat != "first_k" and self.k is not None:
            raise ConfigError(f"k applies to stat first_k only (stat is {self.stat!r})")
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise ConfigError(
                f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}] (the step's Envoy message timeout,"
                f" timeout_s + 5 s, stays within Envoy's 600 s cap), got {self.timeout_s:g}"
            )
        gated = len(self.steps) - 1
        if gated > 1 and gated * self.timeout_s > MAX_TIMEOUT_S:
            raise ConfigError(
                f"{gated} gated steps x timeout_s must be <= {MAX_TIMEOUT_S:g} s (Envoy's one message timeout"
                f" extension covers every gated step, within its 600 s cap), got {gated} x {self.timeout_s:g}"
            )
        if self.replay and self.stat != "first_k":
            raise ConfigError(f"replay applies to stat first_k only (stat is {self.stat!r})")

    @property
    def rule(self) -> VerdictRule:
        """What the gate's verdicts on the first step mean (what a ``preroute`` learner learns)."""
        return VerdictRule(self.steps[0], self.gate, self.threshold, self.stat, self.k)

    def to_json(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "steps": list(self.steps),
            "gate": self.gate,
            "threshold": self.threshold,
            "stat": self.stat,
            "timeout_s": self.timeout_s,
        }
        if self.k is not None:
            doc["k"] = self.k
        if self.preroute is not None:
            doc["preroute"] = self.preroute.to_json()
        if self.replay:
            doc["replay"] = True
        return doc


def parse_cascade(value: object, where: str, name: str) -> CascadeSpec:
    """The ``cascade`` object of the virtual model ``name``; unknown keys and bad values are a
    :class:`ConfigError` naming ``where``. Whether a step is itself a cascade is checked by the caller
    (it sees every route)."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected an object {{{', '.join(_KEYS)}}}, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(_KEYS)}")
    steps = value.get("steps")
    if not isinstance(steps, list) or not all(isinstance(s, str) and s for s in steps):
        raise ConfigError(f"{where}.steps: expected a list of model names, got {steps!r}")
    if name in steps:
        raise ConfigError(f"{where}.steps: the cascade {name!r} cannot be one of its own steps")
    if "threshold" not in value:
        raise ConfigError(f"{where}.threshold: required (a log-probability, e.g. -0.5)")
    threshold = _number(value["threshold"], f"{where}.threshold")
    gate = value.get("gate", "logprob")
    stat = value.get("stat", "mean")
    k = value.get("k")
    timeout = _number(value.get("timeout_s", DEFAULT_TIMEOUT_S), f"{where}.timeout_s")
    if not isinstance(gate, str):
        raise ConfigError(f"{where}.gate: expected one of {', '.join(GATES)}, got {gate!r}")
    if not isinstance(stat, str):
        raise ConfigError(f"{where}.stat: expected one of {', '.join(STATS)}, got {stat!r}")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool)):
        raise ConfigError(f"{where}.k: expected an integer, got {k!r}")
    raw = value.get("preroute")
    preroute = None if raw is None else parse_preroute(raw, f"{where}.preroute")
    replay = value.get("replay", False)
    if not isinstance(replay, bool):
        raise ConfigError(f"{where}.replay: expected true or false, got {replay!r}")
    try:
        return CascadeSpec(tuple(steps), threshold, stat, k, gate, timeout, preroute, replay)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _number(value: object, where: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class CascadeConfig:
    """``[cascade]`` of the gateway config: where each worker keeps its ``preroute`` learners across
    restarts (``state_dir``, a file per worker: README.md, "Kept across restarts"; ``None``: not kept) and
    how often a changed set is written there (``snapshot_interval_s``, and once more at a graceful
    shutdown)."""

    state_dir: str | None = None
    snapshot_interval_s: float = 30.0


def parse_cascade_config(raw: object, where: str = "cascade") -> CascadeConfig:
    if raw is None:
        return CascadeConfig()
    s = Section(raw, where)
    state_dir, interval = state_options(s, where, CascadeConfig().snapshot_interval_s)
    s.done()
    return CascadeConfig(state_dir, interval)
