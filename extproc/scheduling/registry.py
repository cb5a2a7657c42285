"""Plugin types by name, the scheduling config, and the built-in default profile.

Config shape (plain dicts from YAML/JSON/etcd, parsed here at the edge; unknown keys are errors)::

    plugins:                                   # plugin instances
      - {type: load-threshold, name: lt, params: {max_waiting: 16}}   # name defaults to type
    profiles:
      - name: default
        plugins:                               # filters run in the order listed
          - {ref: lt}
          - {ref: prefix, weight: 3}           # weights on scorers only: finite, >= 0, default 1.0
          - {ref: max-score}                   # exactly one picker per profile

Each plugin's params are a frozen dataclass; they are checked key by key against its fields (unknown key,
wrong type, out of range: :class:`~contracts.errors.ConfigError` naming the plugin and the key).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from contracts.errors import ConfigError
from extproc.scheduling.filters import (
    BalanceFilter,
    BalanceParams,
    HealthyFilter,
    LoadThresholdFilter,
    LoadThresholdParams,
    ModelFilter,
    SLOFilter,
    SubsetFilter,
)
from extproc.scheduling.interface import Filter, Picker, Scorer
from extproc.scheduling.lora import LoraParams, LoraScorer
from extproc.scheduling.picker import MaxScoreParams, MaxScorePicker
from extproc.scheduling.power import (
    MarginalEnergyParams,
    MarginalEnergyScorer,
    PowerCapFilter,
    PowerCapParams,
    PowerParams,
    PowerScorer,
)
from extproc.scheduling.profile import Profile
from extproc.scheduling.scorers import (
    CacheSpreadScorer,
    InFlightScorer,
    KVUtilizationScorer,
    LoadParams,
    PredictedTTFTScorer,
    PrefixParams,
    PrefixScorer,
    QueueScorer,
    TierParams,
    TierScorer,
)

PluginKind = Literal["filter", "scorer", "picker"]


@dataclass(frozen=True, slots=True)
class PluginType:
    """A registered plugin type: its kind, its constructor ``factory(name)`` or ``factory(name, params)``,
    and its params dataclass (``None``: it takes no params)."""

    kind: PluginKind
    factory: Callable[..., object]
    params: type[Any] | None = None


PLUGIN_TYPES: Mapping[str, PluginType] = types.MappingProxyType(
    {
        "model": PluginType("filter", ModelFilter),
        "healthy": PluginType("filter", HealthyFilter),
        "subset": PluginType("filter", SubsetFilter),
        "load-threshold": PluginType("filter", LoadThresholdFilter, LoadThresholdParams),
        "balance": PluginType("filter", BalanceFilter, BalanceParams),
        "slo": PluginType("filter", SLOFilter),
        "power-cap": PluginType("filter", PowerCapFilter, PowerCapParams),
        "prefix": PluginType("scorer", PrefixScorer, PrefixParams),
        "queue": PluginType("scorer", QueueScorer, LoadParams),
        "kv-utilization": PluginType("scorer", KVUtilizationScorer),
        "in-flight": PluginType("scorer", InFlightScorer, LoadParams),
        "cache-spread": PluginType("scorer", CacheSpreadScorer),
        "kv-tier": PluginType("scorer", TierScorer, TierParams),
        "ttft": PluginType("scorer", PredictedTTFTScorer),
        "power": PluginType("scorer", PowerScorer, PowerParams),
        "marginal-energy": PluginType("scorer", MarginalEnergyScorer, MarginalEnergyParams),
        "lora": PluginType("scorer", LoraScorer, LoraParams),
        "max-score": PluginType("picker", MaxScorePicker, MaxScoreParams),
    }
)
"""Every plugin type, by the name used in config ``type``."""


@dataclass(frozen=True, slots=True)
class PluginSpec:
    """One configured plugin instance: ``params`` is its parsed params dataclass (``None``: none)."""

    type: str
    name: str
    params: object | None = None


@dataclass(frozen=True, slots=True)
class PluginRef:
    """A profile's use of a plugin; ``weight`` only for scorers (``None``: 1.0)."""

    ref: str
    weight: float | None = None


@dataclass(frozen=True, slots=True)
class ProfileSpec:
    name: str
    plugins: tuple[PluginRef, ...]


@dataclass(frozen=True, slots=True)
class SchedulingConfig:
    """Plugin instances and the profiles composing them; checked for consistency on construction."""

    plugins: tuple[PluginSpec, ...]
    profiles: tuple[ProfileSpec, ...]

    def __post_init__(self) -> None:
        kinds: dict[str, PluginKind] = {}
        for spec in self.plugins:
            plugin_type = PLUGIN_TYPES.get(spec.type)
            if plugin_type is None:
                raise ConfigError(f"plugin {spec.name!r}: unknown type {spec.type!r}; known: {_known()}")
            if spec.name in kinds:
                raise ConfigError(f"plugin name {spec.name!r} is used twice")
            kinds[spec.name] = plugin_type.kind
        if not self.profiles:
            raise ConfigError("scheduling config needs at least one profile")
        seen_profiles: set[str] = set()
        for profile in self.profiles:
            where = f"profile {profile.name!r}"
            if profile.name in seen_profiles:
                raise ConfigError(f"{where}: name used twice")
            seen_profiles.add(profile.name)
            refs = [r.ref for r in profile.plugins]
            for ref in profile.plugins:
                kind = kinds.get(ref.ref)
                if kind is None:
                    raise ConfigError(f"{where}: ref {ref.ref!r} names no configured plugin")
                if refs.count(ref.ref) > 1:
                    raise ConfigError(f"{where}: plugin {ref.ref!r} is referenced twice")
                if ref.weight is not None:
                    if kind != "scorer":
                        raise ConfigError(f"{where}: {ref.ref!r} is a {kind}; only scorers take a weight")
                    if not 0 <= ref.weight < math.inf:
                        raise ConfigError(f"{where}: weight of {ref.ref!r} must be finite and >= 0")
            pickers = [r.ref for r in profile.plugins if kinds[r.ref] == "picker"]
            if len(pickers) != 1:
                raise ConfigError(f"{where}: needs exactly one picker, has {len(pickers)}")

    def plugin(self, name: str) -> PluginSpec:
        for spec in self.plugins:
            if spec.name == name:
                return spec
        raise KeyError(name)


_PLUGIN_KEYS = frozenset({"type", "name", "params"})


def _known() -> str:
    return ", ".join(sorted(PLUGIN_TYPES))


def _mapping(
    value: object, where: str, allowed: frozenset[str], required: frozenset[str] = frozenset()
) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    for key in value:
        if key not in allowed:
            raise ConfigError(f"{where}: unknown key {key!r}; allowed: {', '.join(sorted(allowed))}")
    for key in required:
        if key not in value:
            raise ConfigError(f"{where}: missing key {key!r}")
    return cast(Mapping[str, object], value)


def _list(value: object, where: str) -> list[object]:
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
    return list(value)


def _str(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _coerce(value: object, hint: object, where: str) -> object:
    """``value`` checked against a params field type: bool, int, float (int accepted), str, or X | None."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, where)
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{where}: must be finite, got {value!r}")
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    expected = getattr(hint, "__name__", str(hint))
    raise ConfigError(f"{where}: expected {expected}, got {type(value).__name__} {value!r}")


def parse_params(plugin_type: str, name: str, raw: object) -> object | None:
    """The params dataclass of plugin ``name`` of type ``plugin_type`` from a plain mapping (or ``None``)."""
    where = f"plugin {name!r} ({plugin_type})"
    params_cls = PLUGIN_TYPES[plugin_type].params
    fields = {} if params_cls is None else {f.name: f for f in dataclasses.fields(params_cls)}
    given = _mapping({} if raw is None else raw, f"{where} params", frozenset(fields))
    if params_cls is None:
        return None
    hints = typing.get_type_hints(params_cls)
    values = {key: _coerce(value, hints[key], f"{where} param {key!r}") for key, value in given.items()}
    try:
        params: object = params_cls(**values)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    return params


def parse_scheduling(raw: object) -> SchedulingConfig:
    """Parse and check a scheduling config given as plain data (the shape in this module's docstring)."""
    top = _mapping(raw, "scheduling", frozenset({"plugins", "profiles"}), frozenset({"plugins", "profiles"}))
    plugins: list[PluginSpec] = []
    for i, item in enumerate(_list(top["plugins"], "scheduling.plugins")):
        entry = _mapping(item, f"scheduling.plugins[{i}]", _PLUGIN_KEYS, frozenset({"type"}))
        plugin_type = _str(entry["type"], f"scheduling.plugins[{i}].type")
        name = _str(entry.get("name", plugin_type), f"scheduling.plugins[{i}].name")
        if plugin_type not in PLUGIN_TYPES:
            raise ConfigError(f"plugin {name!r}: unknown type {plugin_type!r}; known: {_known()}")
        plugins.append(PluginSpec(plugin_type, name, parse_params(plugin_type, name, entry.get("params"))))
    profiles: list[ProfileSpec] = []
    for i, item in enumerate(_list(top["profiles"], "scheduling.profiles")):
        where = f"scheduling.profiles[{i}]"
        entry = _mapping(item, where, frozenset({"name", "plugins"}), frozenset({"name", "plugins"}))
        refs: list[PluginRef] = []
        for j, ref_item in enumerate(_list(entry["plugins"], f"{where}.plugins")):
            ref_where = f"{where}.plugins[{j}]"
            ref = _mapping(ref_item, ref_where, frozenset({"ref", "weight"}), frozenset({"ref"}))
            weight = ref.get("weight")
            refs.append(
                PluginRef(
                    _str(ref["ref"], f"{ref_where}.ref"),
                    None if weight is None else cast(float, _coerce(weight, float, f"{ref_where}.weight")),
                )
            )
        profiles.append(ProfileSpec(_str(entry["name"], f"{where}.name"), tuple(refs)))
    return SchedulingConfig(tuple(plugins), tuple(profiles))


def build_profile(
    config: SchedulingConfig, name: str | None = None, *, max_fallbacks: int | None = None
) -> Profile:
    """Instantiate profile ``name`` (default: the first) with fresh plugin instances.

    ``max_fallbacks``: a gateway-wide cap on fallbacks returned after the pick, on top of the picker's own
    (``None``: the picker's alone).
    """
    if name is None:
        spec = config.profiles[0]
    else:
        matches = [p for p in config.profiles if p.name == name]
        if not matches:
            raise ConfigError(f"no profile named {name!r}")
        spec = matches[0]
    filters: list[Filter] = []
    scorers: list[tuple[Scorer, float]] = []
    picker: Picker | None = None
    for ref in spec.plugins:
        plugin_spec = config.plugin(ref.ref)
        plugin_type = PLUGIN_TYPES[plugin_spec.type]
        if plugin_spec.params is None:
            plugin = plugin_type.factory(plugin_spec.name)
        else:
            plugin = plugin_type.factory(plugin_spec.name, plugin_spec.params)
        if plugin_type.kind == "filter":
            filters.append(cast(Filter, plugin))
        elif plugin_type.kind == "scorer":
            scorers.append((cast(Scorer, plugin), 1.0 if ref.weight is None else ref.weight))
        else:
            picker = cast(Picker, plugin)
    if picker is None:  # pragma: no cover - SchedulingConfig checks there is exactly one
        raise ConfigError(f"profile {spec.name!r}: no picker")
    return Profile(spec.name, filters, scorers, picker, max_fallbacks=max_fallbacks)


DEFAULT_SCHEDULING: SchedulingConfig = parse_scheduling(
    {
        "plugins": [{"type": t} for t in PLUGIN_TYPES],
        "profiles": [
            {
                "name": "default",
                "plugins": [
                    {"ref": "model"},
                    {"ref": "healthy"},
                    {"ref": "subset"},
                    {"ref": "slo"},
                    {"ref": "power-cap"},
                    {"ref": "load-threshold"},
                    {"ref": "balance"},
                    {"ref": "prefix", "weight": 3.0},
                    {"ref": "queue", "weight": 2.0},
                    {"ref": "in-flight", "weight": 1.0},
                    {"ref": "cache-spread", "weight": 1.0},
                    {"ref": "kv-tier", "weight": 3.0},
                    {"ref": "lora", "weight": 4.0},
                    {"ref": "max-score"},
                ],
            }
        ],
    }
)
"""The built-in scheduling config: every plugin with default params, one profile ``default``."""
