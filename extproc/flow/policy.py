"""Flow-control policy: saturation limits, band bounds, the waiting room and the objectives, validated.

Pure. The policy store (:mod:`extproc.control.policy`) lays these paths over the file defaults; each
value is checked here and a bad one is refused whole (:class:`~contracts.errors.ConfigError`)::

    flow/saturation            {max_waiting, max_in_flight, max_kv_usage}: every (model, role); a key
                               absent or null is not checked; all absent: never saturated
    flow/models/<model>        the same for one model, with optional "roles": {role: {...}} per role
    flow/bands/default         {max_requests, max_bytes, max_wait_s, headroom}: each priority band's
                               bounds; headroom (-1 <= h < 1, default 0) is the share of every
                               saturation limit the band leaves free for higher bands (negative: the
                               band may go past the limits, for engines that preempt lower priorities)
    flow/bands/<priority>      the same for one band (an integer; negative: sheddable)
    flow/max_queued            requests queued per model over all bands (default 4096): an arrival past
                               it evicts the newest request of a lower sheddable band, else gets 429
    flow/max_queued_bytes      the same bound on queued body bytes (default 1 GiB)
    flow/sheddable_max_wait_s  the longest a sheddable (priority < 0) request waits (default 1 s)
                               (this, max_wait_s and waiting_room_s: at most MAX_WAIT_S, 595 s)
    flow/waiting_room_s        how long a request waits when its model has no endpoint (0: 503 at once;
                               its band's max_wait_s bounds it too)
    flow/fairness              "tokens" (prompt + output tokens) or "requests": what a flow's share counts
    flow/retry_after_s         the Retry-After of a 429 from flow control (integer seconds >= 1)
    flow/engine_priority       {order, scale} or null (default): write each routed request's priority
                               into the body's "priority" field for engines that schedule by it: those
                               whose endpoint record declares a priority_order, and with "order" set,
                               every other endpoint too as if it declared that order ("low_first": vLLM,
                               value -priority x scale; "high_first": SGLang's default, priority x
                               scale); the client's own "priority" is replaced or removed
    flow/burst                 {max_per_minute}: each burst endpoint's budget (extproc/burst; default
                               0: nothing is sent to a burst endpoint)
    objectives/<name>          {priority, ttft_ms, tpot_ms}: a named objective (etcd family objectives/)

A policy file and the gateway config (its embedded default) hold the same paths as tables
(:func:`flow_paths`; model names may contain ``/`` and stay one key)::

    [flow]
    waiting_room_s = 5
    [flow.saturation]
    max_waiting = 8
    [flow.models."org/llama-3".roles.prefill]
    max_in_flight = 4
    [flow.bands.-1]
    max_requests = 64
    [objectives.interactive]
    priority = 1
    ttft_ms = 500
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

from contracts.errors import ConfigError
from engines.priority import PRIORITY_ORDERS

FAIRNESS = ("tokens", "requests")
ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class Saturation:
    """When an endpoint can take no more: ``waiting >= max_waiting`` (the engine's queue at the last
    scrape), ``load >= max_in_flight`` (:attr:`~extproc.fleet.EndpointState.load`: requests at the
    engine, best estimate) or ``kv_usage >= max_kv_usage`` (0..1). ``None``: that signal is not checked."""

    max_waiting: float | None = None
    max_in_flight: float | None = None
    max_kv_usage: float | None = None

    @property
    def checked(self) -> bool:
        """Whether any limit is set (otherwise no endpoint is ever saturated)."""
        return not (self.max_waiting is None and self.max_in_flight is None and self.max_kv_usage is None)


@dataclass(frozen=True, slots=True)
class ModelSaturation:
    """One model's limits (``None``: the default) and its per-role limits."""

    limits: Saturation | None = None
    roles: Mapping[str, Saturation] = field(default_factory=lambda: types.MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class BandLimits:
    """A priority band's queue bounds, per model: at most ``max_requests`` queued requests and
    ``max_bytes`` of queued bodies; a request queued ``max_wait_s`` seconds is shed (429 queue_timeout).
    ``headroom`` (-1 <= h < 1) is the share of each saturation limit the band leaves free for higher
    bands: for its requests an endpoint is saturated at ``(1 - h) x`` each limit (a slot kept for
    interactive work while batch work fills the rest; 0: the full limits; negative: past the limits,
    where engines preempt lower priorities for it, :class:`EnginePriority`)."""

    max_requests: int = 1024
    max_bytes: int = 256 * 1024 * 1024
    max_wait_s: float = 60.0
    headroom: float = 0.0


ENGINE_PRIORITY_ORDERS = PRIORITY_ORDERS


@dataclass(frozen=True, slots=True)
class EnginePriority:
    """How a request's band reaches engines that schedule by priority: the body's ``priority`` field,
    ``-priority x scale`` for ``low_first`` engines (vLLM's ``--scheduling-policy priority``, SGLang's
    ``--schedule-low-priority-values-first``), ``priority x scale`` for ``high_first`` (SGLang's
    default). ``scale`` spreads bands apart (SGLang preempts only past a difference of its
    ``--priority-scheduling-preemption-threshold``, 10 by default).

    An endpoint's own ``priority_order`` (its record, :mod:`engines.priority`) says which it is; ``order``
    is assumed for an endpoint that declares none (``None``, the default: such an endpoint is not told; an
    order assumed wrongly would invert the bands)."""

    order: str | None = None
    scale: int = 1

    def order_for(self, declared: str | None) -> str | None:
        """The order an endpoint declaring ``declared`` is told in (``None``: it is not told)."""
        return declared if declared is not None else self.order

    def value(self, priority: int, order: str | None = None) -> int:
        """The body's ``priority`` for band ``priority`` at an engine of ``order`` (``None``: ``self.order``,
        else ``low_first``)."""
        order = order or self.order or "low_first"
        return priority * self.scale if order == "high_first" else -priority * self.scale

    def to_json(self) -> dict[str, object]:
        return {"order": self.order, "scale": self.scale}


@dataclass(frozen=True, slots=True)
class Objective:
    """A named objective (the Inference Extension's InferenceObjective): ``priority`` orders bands
    (higher first; negative is sheddable), ``ttft_ms`` / ``tpot_ms`` are optional SLO targets."""

    name: str
    priority: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def to_json(self) -> dict[str, object]:
        return {"priority": self.priority, "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms}


@dataclass(frozen=True, slots=True)
class FlowPolicy:
    """Everything flow control decides by; swapped whole when the policy changes."""

    saturation: Saturation = Saturation()
    models: Mapping[str, ModelSaturation] = field(default_factory=lambda: types.MappingProxyType({}))
    bands: BandLimits = BandLimits()
    band_limits: Mapping[int, BandLimits] = field(default_factory=lambda: types.MappingProxyType({}))
    max_queued: int = 4096
    max_queued_bytes: int = 1 << 30
    sheddable_max_wait_s: float = 1.0
    waiting_room_s: float = 0.0
    fairness: str = "tokens"
    retry_after_s: int = 1
    engine_priority: EnginePriority | None = None
    #: Requests a minute each burst endpoint may take (``flow/burst``; :mod:`extproc.burst`).
    burst_per_minute: float = 0.0
    objectives: Mapping[str, Objective] = field(default_factory=lambda: types.MappingProxyType({}))

    def limits(self, priority: int) -> BandLimits:
        """The bounds of ``priority``'s band: its own, else the default; a sheddable band waits at most
        ``sheddable_max_wait_s``."""
        band = self.band_limits.get(priority, self.bands)
        if priority < 0 and band.max_wait_s > self.sheddable_max_wait_s:
            band = replace(band, max_wait_s=self.sheddable_max_wait_s)
        return band

    def headroom(self, priority: int | None) -> float:
        """The share of each saturation limit ``priority``'s band leaves free (``None``: 0, the full
        limits)."""
        return 0.0 if priority is None else self.band_limits.get(priority, self.bands).headroom

    def headroom_at(self, priority: int | None, declared: str | None) -> float:
        """:meth:`headroom` at an endpoint whose record declares ``declared`` (its ``priority_order``): a
        negative headroom (a band going past the limits) holds only where the engine is told the band
        (``flow/engine_priority`` on and :meth:`EnginePriority.order_for` an order), and is 0 elsewhere: an
        engine that does not schedule by priority would queue the band behind the work already there."""
        share = self.headroom(priority)
        if share < 0 and (self.engine_priority is None or self.engine_priority.order_for(declared) is None):
            return 0.0
        return share

    def saturation_for(self, model: str, role: str) -> Saturation:
        """The limits of ``(model, role)``: the model's role's, else the model's, else the default."""
        own = self.models.get(model)
        if own is None:
            return self.saturation
        by_role = own.roles.get(role)
        if by_role is not None:
            return by_role
        return own.limits if own.limits is not None else self.saturation

    @property
    def holds(self) -> bool:
        """Whether flow control can ever hold a request (some limit set, or a waiting room)."""
        return (
            self.saturation.checked
            or any(
                (m.limits is not None and m.limits.checked) or any(r.checked for r in m.roles.values())
                for m in self.models.values()
            )
            or self.waiting_room_s > 0
        )


KNOWN_PATHS = (
    "flow/saturation, flow/models/<model>, flow/bands/default, flow/bands/<priority>, "
    "flow/max_queued, flow/max_queued_bytes, flow/sheddable_max_wait_s, flow/waiting_room_s, "
    "flow/fairness, flow/retry_after_s, flow/engine_priority, flow/burst, objectives/<name>"
)


def is_flow_path(path: str) -> bool:
    """Whether ``path`` belongs to flow control (``flow/...`` or ``objectives/<name>``)."""
    return path.startswith(("flow/", "objectives/"))


_SCALARS = (
    "max_queued",
    "max_queued_bytes",
    "sheddable_max_wait_s",
    "waiting_room_s",
    "fairness",
    "retry_after_s",
    "engine_priority",
    "burst",
)
_FLOW_KEYS = ("saturation", "models", "bands", *_SCALARS)


def check_flow_path(path: str, where: str | None = None) -> None:
    """Raise :class:`ConfigError` unless ``path`` is one of the flow paths (its value is not looked at):
    a model or objective name has no empty ``/``-separated part, a band is ``default`` or an integer in
    canonical form (``-1``, not ``-01`` or ``+1``). ``where`` names it in the error (default
    ``policy <path>``)."""
    head, _, rest = path.partition("/")
    kind, _, name = rest.partition("/")
    if head == "objectives" and rest and all(rest.split("/")):
        return
    if head == "flow" and rest in ("saturation", "bands/default", *_SCALARS):
        return
    if head == "flow" and kind == "models" and name and all(name.split("/")):
        return
    if head == "flow" and kind == "bands" and name:
        _priority(name, f"policy {path}" if where is None else where)
        return
    raise ConfigError(f"unknown policy path {path!r}; flow paths: {KNOWN_PATHS}")


def apply_flow(base: FlowPolicy, overrides: Mapping[str, object]) -> FlowPolicy:
    """``base`` with each flow path of ``overrides`` applied (other paths ignored); the first bad path
    or value raises :class:`ConfigError` naming it."""
    policy = base
    for path, value in sorted(overrides.items()):
        if is_flow_path(path):
            policy = _apply(policy, path, value, f"policy {path}")
    return policy


def flow_paths(top: str, tree: object, where: str) -> dict[str, object]:
    """The flow paths of a file's ``flow`` table (``top`` ``"flow"``: ``saturation``, the scalars, and
    ``models`` / ``bands`` tables of name -> value) or ``objectives`` table (name -> objective); only
    the shape is checked here (:class:`ConfigError` naming the key), the values by :func:`apply_flow`."""
    table = _mapping(tree, where)
    if top == "objectives":
        return {f"objectives/{name}": value for name, value in table.items()}
    out: dict[str, object] = {}
    for key, value in table.items():
        if key in ("models", "bands"):
            out.update({f"flow/{key}/{name}": sub for name, sub in _mapping(value, f"{where}.{key}").items()})
        elif key in _FLOW_KEYS:
            out[f"flow/{key}"] = value
        else:
            raise ConfigError(f"{where}: unknown key {key!r}; known: {', '.join(_FLOW_KEYS)}")
    return out


def parse_flow(flow: object | None, objectives: object | None) -> FlowPolicy:
    """A gateway config's ``[flow]`` and ``[objectives.<name>]`` tables (``None``: absent) as the
    embedded default :class:`FlowPolicy`; a bad key or value is a :class:`ConfigError` naming it
    (``flow.saturation.max_waiting``, ``objectives.interactive.priority``)."""
    paths: dict[str, object] = {}
    if flow is not None:
        paths.update(flow_paths("flow", flow, "flow"))
    if objectives is not None:
        paths.update(flow_paths("objectives", objectives, "objectives"))
    policy = FlowPolicy()
    for path, value in sorted(paths.items()):
        head, _, rest = path.partition("/")
        if rest.startswith("models/"):
            where = f"flow.models.{rest[len('models/') :]}"
        else:
            where = f"{head}.{rest}" if head == "objectives" else path.replace("/", ".")
        policy = _apply(policy, path, value, where)
    return policy


def _mapping(value: object, where: str) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a table, got {type(value).__name__}")
    return value


def _apply(policy: FlowPolicy, path: str, value: object, where: str) -> FlowPolicy:
    check_flow_path(path, where)
    head, _, rest = path.partition("/")
    if head == "objectives":
        objectives = {**policy.objectives, rest: parse_objective(rest, value, where)}
        return replace(policy, objectives=types.MappingProxyType(objectives))
    if rest == "saturation":
        return replace(policy, saturation=parse_saturation(value, where))
    if rest.startswith("models/"):
        model = rest[len("models/") :]
        models = {**policy.models, model: _model_saturation(value, where)}
        return replace(policy, models=types.MappingProxyType(models))
    if rest == "bands/default":
        return replace(policy, bands=parse_band(value, where))
    if rest.startswith("bands/"):
        return replace(
            policy,
            band_limits=types.MappingProxyType(
                {**policy.band_limits, _priority(rest[len("bands/") :], where): parse_band(value, where)}
            ),
        )
    if rest == "max_queued":
        return replace(policy, max_queued=int(number(value, where, 1, integer=True)))
    if rest == "max_queued_bytes":
        return replace(policy, max_queued_bytes=int(number(value, where, 1, integer=True)))
    if rest == "sheddable_max_wait_s":
        return replace(policy, sheddable_max_wait_s=_wait(value, where))
    if rest == "waiting_room_s":
        return replace(policy, waiting_room_s=_wait(value, where))
    if rest == "retry_after_s":
        return replace(policy, retry_after_s=int(number(value, where, 1, integer=True)))
    if rest == "engine_priority":
        return replace(policy, engine_priority=parse_engine_priority(value, where))
    if rest == "burst":
        table = _table(value, where, ("max_per_minute",))
        per_minute = number(table.get("max_per_minute"), f"{where}.max_per_minute", 0.0)
        return replace(policy, burst_per_minute=float(per_minute))
    if value not in FAIRNESS:  # flow/fairness, the last path check_flow_path lets through
        raise ConfigError(f"{where}: expected one of {', '.join(FAIRNESS)}, got {value!r}")
    assert isinstance(value, str)
    return replace(policy, fairness=value)


def _priority(text: str, where: str) -> int:
    """A band's priority from its name: an integer written as ``str(int)`` writes it (so one band has
    one path)."""
    try:
        priority = int(text, 10)
    except ValueError:
        priority = None
    if priority is None or str(priority) != text:
        raise ConfigError(f"{where}: a band is named by its priority, an integer, got {text!r}")
    return priority


def _table(value: object, where: str, allowed: tuple[str, ...]) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected an object with {', '.join(allowed)}, got {value!r}")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    return value


#: The longest a policy may hold a request (``max_wait_s``, ``sheddable_max_wait_s``, ``waiting_room_s``):
#: the ext_proc extends Envoy's message timeout for a held stream by the wait plus ``HOLD_SLACK_S`` (5 s,
#: extproc/processor.py) up to ``HOLD_TIMEOUT_S`` (600 s, extproc/server.py, Envoy's
#: ``max_message_timeout``), so a longer wait would be cut by Envoy (a bodiless 5xx) before its 429.
MAX_WAIT_S = 595.0


def _wait(value: object, where: str) -> float:
    seconds = float(number(value, where, 0.0))
    if seconds > MAX_WAIT_S:
        raise ConfigError(
            f"{where}: at most {MAX_WAIT_S:g} s (a held request's Envoy message timeout ends at 600 s), "
            f"got {value!r}"
        )
    return seconds


def number(value: object, where: str, minimum: float, *, integer: bool = False) -> float:
    """``value`` if it is a finite number (an integer with ``integer``; never a bool) ``>= minimum``,
    else :class:`ConfigError` naming ``where`` (every policy value is checked with it)."""
    kinds = int if integer else int | float
    if not isinstance(value, kinds) or isinstance(value, bool):
        expected = "an integer" if integer else "a number"
        raise ConfigError(f"{where}: expected {expected}, got {type(value).__name__} {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer too large for a float (``1`` then 400 zeros)
        raise ConfigError(f"{where}: must be finite and >= {minimum}, got a number too large") from None
    if not (finite and value >= minimum):
        raise ConfigError(f"{where}: must be finite and >= {minimum}, got {value!r}")
    return value


def _optional(table: Mapping[str, object], key: str, where: str, minimum: float) -> float | None:
    value = table.get(key)
    return None if value is None else float(number(value, f"{where}.{key}", minimum))


def parse_saturation(value: object, where: str) -> Saturation:
    keys = tuple(f.name for f in fields(Saturation))
    table = _table(value, where, keys)
    limits = Saturation(
        max_waiting=_optional(table, "max_waiting", where, 0.0),
        max_in_flight=_optional(table, "max_in_flight", where, 0.0),
        max_kv_usage=_optional(table, "max_kv_usage", where, 0.0),
    )
    if limits.max_kv_usage is not None and limits.max_kv_usage > 1.0:
        raise ConfigError(
            f"{where}.max_kv_usage: a fraction of the KV cache, 0..1, got {limits.max_kv_usage}"
        )
    return limits


def _model_saturation(value: object, where: str) -> ModelSaturation:
    keys = (*(f.name for f in fields(Saturation)), "roles")
    table = _table(value, where, keys)
    roles_raw = table.get("roles")
    if roles_raw is None:
        roles_raw = {}
    if not isinstance(roles_raw, Mapping):
        raise ConfigError(f"{where}.roles: expected an object of role -> limits, got {roles_raw!r}")
    roles: dict[str, Saturation] = {}
    for role, limits in roles_raw.items():
        if role not in ROLES:
            raise ConfigError(f"{where}.roles: unknown role {role!r}; roles: {', '.join(ROLES)}")
        roles[role] = parse_saturation(limits, f"{where}.roles.{role}")
    own = {k: v for k, v in table.items() if k != "roles"}
    return ModelSaturation(parse_saturation(own, where) if own else None, types.MappingProxyType(roles))


def parse_band(value: object, where: str) -> BandLimits:
    keys = tuple(f.name for f in fields(BandLimits))
    table = _table(value, where, keys)
    base = BandLimits()
    return BandLimits(
        max_requests=int(
            number(table.get("max_requests", base.max_requests), f"{where}.max_requests", 1, integer=True)
        ),
        max_bytes=int(number(table.get("max_bytes", base.max_bytes), f"{where}.max_bytes", 1, integer=True)),
        max_wait_s=_wait(table.get("max_wait_s", base.max_wait_s), f"{where}.max_wait_s"),
        headroom=_headroom(table.get("headroom", base.headroom), f"{where}.headroom"),
    )


def _headroom(value: object, where: str) -> float:
    share = float(number(value, where, -1.0))
    if share >= 1.0:
        raise ConfigError(f"{where}: a share of each saturation limit, -1 <= headroom < 1, got {value!r}")
    return share


def parse_engine_priority(value: object, where: str) -> EnginePriority | None:
    """``{order, scale}`` (``None``: off)."""
    if value is None:
        return None
    table = _table(value, where, ("order", "scale"))
    order = table.get("order")
    if order is not None and order not in ENGINE_PRIORITY_ORDERS:
        orders = ", ".join(ENGINE_PRIORITY_ORDERS)
        raise ConfigError(f"{where}.order: expected one of {orders}, got {order!r}")
    assert order is None or isinstance(order, str)
    scale = int(number(table.get("scale", 1), f"{where}.scale", 1, integer=True))
    return EnginePriority(order, scale)


def parse_objective(name: str, value: object, where: str) -> Objective:
    table = _table(value, where, ("priority", "ttft_ms", "tpot_ms"))
    priority = table.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ConfigError(f"{where}.priority: expected an integer, got {priority!r}")
    return Objective(
        name,
        priority,
        _optional(table, "ttft_ms", where, 1.0),
        _optional(table, "tpot_ms", where, 0.001),
    )


def flow_values(policy: FlowPolicy) -> dict[str, object]:
    """Every flow path with its value in ``policy`` (``kvgate policy list``)."""

    def sat(s: Saturation) -> dict[str, object]:
        return {
            "max_waiting": s.max_waiting,
            "max_in_flight": s.max_in_flight,
            "max_kv_usage": s.max_kv_usage,
        }

    def band(b: BandLimits) -> dict[str, object]:
        return {
            "max_requests": b.max_requests,
            "max_bytes": b.max_bytes,
            "max_wait_s": b.max_wait_s,
            "headroom": b.headroom,
        }

    out: dict[str, object] = {
        "flow/saturation": sat(policy.saturation),
        "flow/bands/default": band(policy.bands),
        "flow/max_queued": policy.max_queued,
        "flow/max_queued_bytes": policy.max_queued_bytes,
        "flow/sheddable_max_wait_s": policy.sheddable_max_wait_s,
        "flow/waiting_room_s": policy.waiting_room_s,
        "flow/fairness": policy.fairness,
        "flow/retry_after_s": policy.retry_after_s,
        "flow/engine_priority": None if policy.engine_priority is None else policy.engine_priority.to_json(),
        "flow/burst": {"max_per_minute": policy.burst_per_minute},
    }
    for model, own in policy.models.items():
        value: dict[str, object] = sat(own.limits) if own.limits is not None else {}
        if own.roles:
            value["roles"] = {r: sat(s) for r, s in own.roles.items()}
        out[f"flow/models/{model}"] = value
    for priority, limits in policy.band_limits.items():
        out[f"flow/bands/{priority}"] = band(limits)
    for name, objective in policy.objectives.items():
        out[f"objectives/{name}"] = objective.to_json()
    return out
