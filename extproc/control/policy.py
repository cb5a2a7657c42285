"""The run-time policy: what etcd (or a local file) may change in a running gateway, and its schema.

Pure: no IO except the policy file helpers at the end. A policy is a set of paths, one JSON value each,
laid over the gateway's embedded defaults (its own config's scheduling and index settings)::

    weights/<scorer>                      a scorer's weight in every profile (finite, >= 0; 0 turns it
                                          off; a profile that does not use the scorer gets it added)
    profiles/<profile>/weights/<scorer>   the same for one profile (wins over weights/<scorer>)
    plugins/<plugin>/<param>              one param of a plugin instance, checked by its params class
    index/block_size                      tokens per KV block (int >= 1)
    index/speculative_ttl_s               seconds a routing decision counts for an event-fed endpoint
    models/<name>                         route {"labels": {k: v}, "profile": "default"}: the model's
                                          endpoints must carry all labels; profile picks the scheduling
                                          profile (absent or null: the first one); "disaggregation":
                                          {"mode", "min_uncached_tokens", "prefill_profile",
                                          "prefill_timeout_s"} how it is served (:mod:`extproc.disagg`);
                                          or a virtual model {"cascade": {"steps", "gate", "threshold",
                                          "stat", "k", "timeout_s"}} (:mod:`extproc.cascade`; alone)
    flow/..., objectives/<name>           flow control: saturation limits, band bounds, the waiting
                                          room, fairness, named objectives (:mod:`extproc.flow.policy`;
                                          its defaults: the gateway config's [flow], [objectives.<name>])

In etcd a path lives at ``<prefix>policy/<path>``, except ``models/<name>`` at ``<prefix>models/<name>``
and ``objectives/<name>`` at ``<prefix>objectives/<name>`` (:func:`contracts.etcd.policy_key`). A file
holds the same paths as a tree (``flow`` and ``objectives``: :func:`extproc.flow.policy.flow_paths`)::

    [weights]
    prefix = 3.0
    [plugins.load-threshold]
    max_waiting = 16
    [index]
    block_size = 16
    [models."SmolLM2-135M-Instruct"]
    labels = { pool = "a" }
    [flow.saturation]
    max_waiting = 8
    [objectives.interactive]
    priority = 1

Every value is validated (type, range, known scorer/plugin/param/profile) together with all the other
stored values, as one set (:meth:`PolicyStore.replace`), so the policy in force does not depend on the
order the values came in. A value refused on its own (not JSON, an unknown path, its own type or range
check) is logged and its last good value stays (none: the default) while the others apply; values that
conflict (a check across values, e.g. kv-tier's ``peer <= local``) refuse the whole set: the last good
policy stays, the keys are logged, and the whole set is tried again at the next change.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import tempfile
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from contracts.config import read_tree
from contracts.errors import ConfigError
from contracts.etcd import decode_value, encode_value
from engines.endpoint import Endpoint
from extproc.cascade.plan import CascadePolicy
from extproc.cascade.spec import CascadeSpec, parse_cascade
from extproc.disagg.plan import PdPolicy, PdRoute
from extproc.disagg.policy import PdSpec, parse_pd
from extproc.flow.policy import KNOWN_PATHS as FLOW_PATHS
from extproc.flow.policy import (
    FlowPolicy,
    apply_flow,
    check_flow_path,
    flow_paths,
    flow_values,
    is_flow_path,
    number,
)
from extproc.routing.router import Route, RoutingPolicy
from extproc.scheduling.registry import (
    DEFAULT_SCHEDULING,
    PLUGIN_TYPES,
    PluginRef,
    ProfileSpec,
    SchedulingConfig,
    build_profile,
    parse_params,
)

if TYPE_CHECKING:
    from extproc.config import GatewayConfig

log = logging.getLogger(__name__)

KNOWN_PATHS = (
    "weights/<scorer>, profiles/<profile>/weights/<scorer>, plugins/<plugin>/<param>, "
    f"index/block_size, index/speculative_ttl_s, models/<name>, {FLOW_PATHS}"
)
_INDEX_KEYS = ("block_size", "speculative_ttl_s")


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """Where a model's requests may go: endpoints carrying every label in ``labels``, scheduled with
    profile ``profile`` (``None``: the first profile); ``disaggregation``: how it is served (``None``:
    aggregated); ``cascade``: the model is virtual, answered by the steps of this cascade."""

    labels: tuple[tuple[str, str], ...] = ()
    profile: str | None = None
    disaggregation: PdSpec | None = None
    cascade: CascadeSpec | None = None

    def matches(self, endpoint: Endpoint) -> bool:
        return set(self.labels) <= set(endpoint.labels)

    def to_json(self) -> dict[str, object]:
        if self.cascade is not None:
            return {"cascade": self.cascade.to_json()}
        doc: dict[str, object] = {"labels": dict(self.labels), "profile": self.profile}
        if self.disaggregation is not None:
            doc["disaggregation"] = self.disaggregation.to_json()
        return doc


@dataclass(frozen=True, slots=True)
class Policy:
    """The policy in force: the scheduling config (weights and params applied), the index block size
    (tokens), the speculative TTL (s), the model routes and the flow-control policy."""

    scheduling: SchedulingConfig
    block_size: int = 16
    speculative_ttl_s: float = 10.0
    routes: Mapping[str, ModelRoute] = field(default_factory=lambda: types.MappingProxyType({}))
    flow: FlowPolicy = field(default_factory=FlowPolicy)

    def weight(self, scorer: str, profile: str | None = None) -> float:
        """The weight of ``scorer`` in ``profile`` (``None``: the first); 0 when the profile lacks it."""
        spec = self.scheduling.profiles[0] if profile is None else _profile(self.scheduling, profile)
        for ref in spec.plugins:
            if ref.ref == scorer:
                return 1.0 if ref.weight is None else ref.weight
        return 0.0


def _profile(config: SchedulingConfig, name: str) -> ProfileSpec:
    for spec in config.profiles:
        if spec.name == name:
            return spec
    raise ConfigError(f"no profile named {name!r}; profiles: {', '.join(p.name for p in config.profiles)}")


def _kind(config: SchedulingConfig, plugin: str) -> str:
    return PLUGIN_TYPES[config.plugin(plugin).type].kind


def _scorer(config: SchedulingConfig, name: str, where: str) -> str:
    scorers = [s.name for s in config.plugins if PLUGIN_TYPES[s.type].kind == "scorer"]
    if name not in scorers:
        raise ConfigError(f"{where}: no scorer named {name!r}; scorers: {', '.join(scorers)}")
    return name


def _fields(plugin_type: str) -> list[str]:
    params_cls = PLUGIN_TYPES[plugin_type].params
    return [] if params_cls is None else [f.name for f in dataclasses.fields(params_cls)]


def _params_fields(config: SchedulingConfig, plugin: str, where: str) -> list[str]:
    try:
        spec = config.plugin(plugin)
    except KeyError:
        names = ", ".join(s.name for s in config.plugins)
        raise ConfigError(f"{where}: no plugin named {plugin!r}; plugins: {names}") from None
    if PLUGIN_TYPES[spec.type].params is None:
        raise ConfigError(f"{where}: plugin {plugin!r} ({spec.type}) takes no params")
    return _fields(spec.type)


def classify(path: str, config: SchedulingConfig) -> tuple[str, tuple[str, ...]]:
    """``(kind, names)`` of a policy path: ``weight (scorer)``, ``profile-weight (profile, scorer)``,
    ``param (plugin, param)``, ``index (key)``, ``model (name)`` or ``flow (path)`` (``flow/...`` and
    ``objectives/<name>``, :func:`~extproc.flow.policy.check_flow_path`); unknown names are a
    ConfigError."""
    where = f"policy {path}"
    if is_flow_path(path):
        check_flow_path(path)
        return "flow", (path,)
    parts = path.split("/")
    if len(parts) == 2 and parts[0] == "weights":
        return "weight", (_scorer(config, parts[1], where),)
    if len(parts) == 4 and parts[0] == "profiles" and parts[2] == "weights":
        try:
            _profile(config, parts[1])
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        return "profile-weight", (parts[1], _scorer(config, parts[3], where))
    if len(parts) == 3 and parts[0] == "plugins":
        params = _params_fields(config, parts[1], where)
        if parts[2] not in params:
            known = ", ".join(params)
            raise ConfigError(f"{where}: plugin {parts[1]!r} has no param {parts[2]!r}; params: {known}")
        return "param", (parts[1], parts[2])
    if len(parts) == 2 and parts[0] == "index" and parts[1] in _INDEX_KEYS:
        return "index", (parts[1],)
    if parts[0] == "models" and len(parts) >= 2 and all(parts[1:]):
        return "model", (path[len("models/") :],)
    raise ConfigError(f"unknown policy path {path!r}; known: {KNOWN_PATHS}")


def _route(value: object, where: str, config: SchedulingConfig, name: str) -> ModelRoute:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected an object {{labels, profile}}, got {type(value).__name__}")
    unknown = sorted(set(value) - {"labels", "profile", "disaggregation", "cascade"})
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; allowed: labels, profile, disaggregation, cascade"
        )
    if "cascade" in value:  # a virtual model: no endpoints of its own, so nothing else applies
        others = sorted(set(value) - {"cascade"})
        if others:
            raise ConfigError(f"{where}: a cascade is a virtual model; {', '.join(others)} cannot go with it")
        return ModelRoute(cascade=parse_cascade(value["cascade"], f"{where}.cascade", name))
    labels = value.get("labels", {})
    if not isinstance(labels, Mapping) or not all(
        isinstance(k, str) and k and isinstance(v, str) for k, v in labels.items()
    ):
        raise ConfigError(f"{where}.labels: expected an object of string labels, got {labels!r}")
    profile = value.get("profile")
    if profile is not None:
        if not isinstance(profile, str):
            raise ConfigError(f"{where}.profile: expected a profile name, got {profile!r}")
        try:
            _profile(config, profile)
        except ConfigError as exc:
            raise ConfigError(f"{where}.profile: {exc}") from None
    pd = value.get("disaggregation")
    spec = None if pd is None else parse_pd(pd, f"{where}.disaggregation")
    if spec is not None and spec.prefill_profile is not None:
        try:
            _profile(config, spec.prefill_profile)
        except ConfigError as exc:
            raise ConfigError(f"{where}.disaggregation.prefill_profile: {exc}") from None
    return ModelRoute(tuple(sorted(labels.items())), profile, spec)


def _check_cascades(routes: Mapping[str, ModelRoute]) -> None:
    """A cascade's steps are served models, never another cascade (no nesting, no loops)."""
    for name, route in sorted(routes.items()):
        if route.cascade is None:
            continue
        for step in route.cascade.steps:
            other = routes.get(step)
            if other is not None and other.cascade is not None:
                raise ConfigError(f"policy models/{name}: step {step!r} is itself a cascade (no nesting)")


def _params_dict(params: object | None) -> dict[str, object]:
    if params is None:
        return {}
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}  # type: ignore[arg-type]


def build_policy(base: Policy, overrides: Mapping[str, object]) -> Policy:
    """``base`` with every override applied; the first invalid value raises :class:`ConfigError`."""
    config = base.scheduling
    weights: dict[str, float] = {}
    profile_weights: dict[str, dict[str, float]] = {}
    params: dict[str, dict[str, object]] = {}
    index: dict[str, float] = {}
    routes = dict(base.routes)
    for path, value in sorted(overrides.items()):
        kind, names = classify(path, config)
        where = f"policy {path}"
        if kind == "flow":
            continue  # all at once below, by apply_flow
        if kind == "weight":
            weights[names[0]] = float(number(value, where, 0.0))
        elif kind == "profile-weight":
            profile_weights.setdefault(names[0], {})[names[1]] = float(number(value, where, 0.0))
        elif kind == "param":
            params.setdefault(names[0], {})[names[1]] = value
        elif kind == "index":
            integer = names[0] == "block_size"
            index[names[0]] = number(value, where, 1 if integer else 0.001, integer=integer)
        else:
            routes[names[0]] = _route(value, where, config, names[0])
    _check_cascades(routes)
    plugins = []
    for spec in config.plugins:
        if spec.name in params:
            merged = {**_params_dict(spec.params), **params[spec.name]}
            spec = dataclasses.replace(spec, params=parse_params(spec.type, spec.name, merged))
        plugins.append(spec)
    profiles = []
    for profile in config.profiles:
        wanted = {**weights, **profile_weights.get(profile.name, {})}
        refs = [PluginRef(r.ref, wanted.pop(r.ref)) if r.ref in wanted else r for r in profile.plugins]
        picker = next(i for i, r in enumerate(refs) if _kind(config, r.ref) == "picker")
        refs[picker:picker] = [PluginRef(name, w) for name, w in sorted(wanted.items())]
        profiles.append(ProfileSpec(profile.name, tuple(refs)))
    return Policy(
        SchedulingConfig(tuple(plugins), tuple(profiles)),
        int(index.get("block_size", base.block_size)),
        float(index.get("speculative_ttl_s", base.speculative_ttl_s)),
        types.MappingProxyType(routes),
        apply_flow(base.flow, overrides),
    )


def _build(base: Policy, values: Mapping[str, object]) -> Policy:
    """:func:`build_policy`, with what a hostile value can make the checks raise (a number too large
    for a float, nesting too deep) turned into the :class:`ConfigError` it is."""
    try:
        return build_policy(base, values)
    except (ArithmeticError, RecursionError, ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"a value the policy cannot hold ({type(exc).__name__})") from None


def _named(path: str, exc: Exception) -> str:
    reason = str(exc)
    return reason if path in reason else f"policy {path}: {reason}"


_PARAM_ERROR = re.compile(r"plugin '([^']+)' \([^)]*\) param '([^']+)'")


def _own_check(values: Mapping[str, object], reason: str) -> str | None:
    """The path whose own check (type, range, shape) ``reason`` reports, when it names one of
    ``values``; ``None`` for a check across values (e.g. kv-tier's ``peer <= local``)."""
    match = _PARAM_ERROR.match(reason)
    if match is not None:
        path = f"plugins/{match.group(1)}/{match.group(2)}"
        return path if path in values else None
    for path in values:
        head = f"policy {path}"
        if reason.startswith(head) and reason[len(head) : len(head) + 1] in ("", ":", ".", " "):
            return path
    return None


@dataclass(frozen=True, slots=True)
class Evaluation:
    """What a whole set of stored values makes: the :class:`Policy` (``None``: the set is refused), the
    decoded values it was built from, and the refused paths (path -> reason)."""

    policy: Policy | None
    values: Mapping[str, object]
    refused: Mapping[str, str]


class PolicyStore:
    """The embedded default policy plus the overrides in force.

    :meth:`replace` takes every stored value at once (the control plane after each etcd batch or
    snapshot; the CLI to check a write): a value that cannot be read (not JSON, a path unknown to this
    gateway) is refused on its own; the rest is built as one set, in force when valid, else the last
    good policy stays (whatever order the values came in). :meth:`put` and :meth:`delete` change one
    path (a policy file's editor, tests). Each returns the new :class:`Policy` when it changed, else
    ``None``; a refused value is logged, kept in :attr:`rejected` (path -> reason) and changes nothing.
    """

    def __init__(
        self,
        scheduling: SchedulingConfig = DEFAULT_SCHEDULING,
        block_size: int = 16,
        speculative_ttl_s: float = 10.0,
        routes: Mapping[str, ModelRoute] | None = None,
        flow: FlowPolicy | None = None,
    ) -> None:
        frozen_routes = types.MappingProxyType(dict(routes or {}))
        self.base = Policy(
            scheduling, block_size, speculative_ttl_s, frozen_routes, FlowPolicy() if flow is None else flow
        )
        self._overrides: dict[str, object] = {}
        self._file: dict[str, object] = {}  # the policy file's values (load), under etcd's (replace)
        self._policy = self.base
        self.rejected: dict[str, str] = {}

    @classmethod
    def from_config(cls, config: GatewayConfig) -> PolicyStore:
        """Defaults from a gateway config: its scheduling, its index block size and speculative TTL, and
        its flow policy (``[flow]``, ``[objectives.<name>]``)."""
        return cls(
            config.scheduling, config.index.block_size, config.index.speculative_ttl_s, flow=config.flow
        )

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def overrides(self) -> Mapping[str, object]:
        return dict(self._overrides)

    def evaluate(self, items: Mapping[str, bytes]) -> Evaluation:
        """What ``items`` (every stored value, path -> raw JSON), laid over the policy file's values,
        would put in force; changes nothing."""
        values: dict[str, object] = dict(self._file)
        refused: dict[str, str] = {}
        good = self._overrides  # a value refused on its own: its last good value stays, if it had one

        def refuse(path: str, reason: str) -> None:
            refused[path] = reason
            if path in good and values.get(path, good) != good[path]:
                values[path] = good[path]
            else:
                values.pop(path, None)

        for path, raw in sorted(items.items()):
            try:
                classify(path, self.base.scheduling)
                values[path] = decode_value(path, raw)
            except ConfigError as exc:
                refuse(path, _named(path, exc))
        while True:
            try:
                policy = _build(self.base, values)
            except ConfigError as exc:
                own = _own_check(values, str(exc))
                if own is None:  # a conflict between values: the set as a whole is refused
                    for blamed in self._blame(values) or sorted(values):
                        refused[blamed] = _named(blamed, exc)
                    return Evaluation(None, values, refused)
                refuse(own, refused.get(own, _named(own, exc)))
                continue
            return Evaluation(policy, values, refused)

    def _blame(self, values: Mapping[str, object]) -> list[str]:
        """The paths without which the set would build (for the log; a conflict between values names
        each of them)."""
        if len(values) > 256:
            return []
        blamed = []
        for path in sorted(values):
            try:
                _build(self.base, {p: v for p, v in values.items() if p != path})
            except ConfigError:
                continue
            blamed.append(path)
        return blamed

    def replace(self, items: Mapping[str, bytes]) -> Policy | None:
        """Make ``items`` (every stored value, over the policy file's) the overrides: their policy when
        the set is valid (a value refused on its own replaced by its last good one, or left out), else
        the last good policy stays; refused paths are logged (once per reason) and kept in
        :attr:`rejected`."""
        result = self.evaluate(items)
        for path, reason in sorted(result.refused.items()):
            if self.rejected.get(path) != reason:
                log.warning("%s; refused", reason)
        self.rejected = dict(result.refused)
        if result.policy is None:
            log.warning(
                "policy: the stored values do not make a valid policy together; the last good one stays "
                "(refused: %s)",
                ", ".join(sorted(result.refused)),
            )
            return None
        self._overrides = dict(result.values)
        return self._swap(result.policy)

    def validate(self, path: str, raw: bytes) -> None:
        """Raise :class:`ConfigError` (naming the path and the reason) if ``raw`` at ``path`` would be
        refused now."""
        self._candidate(path, raw)

    def _candidate(self, path: str, raw: bytes) -> tuple[object, Policy]:
        try:
            value = decode_value(path, raw)
            return value, _build(self.base, {**self._overrides, path: value})
        except ConfigError as exc:
            reason = str(exc)
            if path not in reason:
                raise ConfigError(f"policy {path}: {reason}") from exc
            raise

    def put(self, path: str, raw: bytes) -> Policy | None:
        try:
            value, policy = self._candidate(path, raw)
        except ConfigError as exc:
            kept = "the previous value" if path in self._overrides else "the default"
            log.warning("%s; keeping %s", exc, kept)
            self.rejected[path] = str(exc)
            return None
        self.rejected.pop(path, None)
        self._overrides[path] = value
        return self._swap(policy)

    def delete(self, path: str) -> Policy | None:
        self.rejected.pop(path, None)
        if path not in self._overrides:
            return None
        rest = {p: v for p, v in self._overrides.items() if p != path}
        try:
            policy = _build(self.base, rest)
        except ConfigError as exc:  # the remaining overrides do not stand on their own
            log.warning("policy %s: removal refused, keeping its value: %s", path, exc)
            self.rejected[path] = f"removal refused: {exc}"
            return None
        self._overrides = rest
        return self._swap(policy)

    def load(self, items: Mapping[str, bytes]) -> Policy:
        """Replace every override at once (a policy file, under the values :meth:`replace` lays over it);
        all valid or :class:`ConfigError`, no change."""
        values = {path: decode_value(path, raw) for path, raw in items.items()}
        policy = _build(self.base, values)
        self._overrides, self._file, self.rejected = values, dict(values), {}
        self._swap(policy)
        return policy

    def _swap(self, policy: Policy) -> Policy | None:
        if policy == self._policy:
            return None
        self._policy = policy
        return policy

    def get(self, path: str) -> object:
        """The effective value at ``path`` (override or default; a model without route, or without
        flow limits of its own, and an undefined objective: ``None``; a band without bounds of its own:
        the default band's)."""
        kind, names = classify(path, self.base.scheduling)
        policy = self._policy
        if kind == "flow":
            values = flow_values(policy.flow)
            if path.startswith("flow/bands/"):
                return values.get(path, values["flow/bands/default"])
            return values.get(path)
        if kind == "weight":
            return policy.weight(names[0])
        if kind == "profile-weight":
            return policy.weight(names[1], names[0])
        if kind == "param":
            return _params_dict(policy.scheduling.plugin(names[0]).params).get(names[1])
        if kind == "index":
            return policy.block_size if names[0] == "block_size" else policy.speculative_ttl_s
        route = policy.routes.get(names[0])
        return None if route is None else route.to_json()

    def effective(self) -> dict[str, object]:
        """Every path with its effective value, sorted (per-profile weights only with several profiles)."""
        config = self._policy.scheduling
        paths = [f"weights/{s.name}" for s in config.plugins if PLUGIN_TYPES[s.type].kind == "scorer"]
        if len(config.profiles) > 1:
            paths += [f"profiles/{p.name}/{w}" for p in config.profiles for w in list(paths)]
        for spec in config.plugins:
            if PLUGIN_TYPES[spec.type].params is not None:
                paths += [f"plugins/{spec.name}/{k}" for k in _fields(spec.type)]
        paths += [f"index/{k}" for k in _INDEX_KEYS] + [f"models/{m}" for m in self._policy.routes]
        paths += list(flow_values(self._policy.flow))
        return {p: self.get(p) for p in sorted({*paths, *self._overrides})}


# -- the policy file (TOML or JSON): the same paths as a tree ------------------------------------------


def flatten_policy(tree: object, where: str) -> dict[str, object]:
    """The paths of a policy tree; its shape is checked here, its values by the :class:`PolicyStore`."""
    if not isinstance(tree, Mapping):
        raise ConfigError(f"{where}: expected a table")
    depth = {"weights": 1, "profiles": 3, "plugins": 2, "index": 1, "models": 1}
    out: dict[str, object] = {}
    for top, sub in tree.items():
        if top in ("flow", "objectives"):
            out.update(flow_paths(top, sub, f"{where}.{top}"))
            continue
        if top not in depth:
            known = ", ".join([*depth, "flow", "objectives"])
            raise ConfigError(f"{where}: unknown table {top!r}; known: {known}")
        _walk(sub, [top], depth[top], f"{where}.{top}", out)
    return out


def _table(value: object, where: str) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a table, got {type(value).__name__}")
    return value


def _walk(value: object, parts: list[str], depth: int, where: str, out: dict[str, object]) -> None:
    if depth == 0:
        out["/".join(parts)] = value
        return
    for key, sub in _table(value, where).items():
        _walk(sub, [*parts, key], depth - 1, f"{where}.{key}", out)


def policy_tree(values: Mapping[str, object]) -> dict[str, object]:
    """The tree of a set of paths (the inverse of :func:`flatten_policy`; a model or objective name
    stays one key, ``/`` and all)."""
    tree: dict[str, object] = {}
    for path, value in sorted(values.items()):
        parts = path.split("/")
        if parts[0] in ("models", "objectives"):
            parts = [parts[0], path[len(parts[0]) + 1 :]]
        elif parts[:2] == ["flow", "models"]:
            parts = ["flow", "models", path[len("flow/models/") :]]
        node = tree
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            assert isinstance(child, dict)
            node = child
        node[parts[-1]] = value
    return tree


def gateway_policy(config: GatewayConfig) -> PolicyStore:
    """The policy a gateway starts with: its config's scheduling and index settings as the embedded
    default, overridden by its ``[policy] file``. A bad file is a :class:`ConfigError` (the start fails,
    nothing half-applied: the operator sees why)."""
    store = PolicyStore.from_config(config)
    if config.policy_file:
        store.load(load_policy_file(Path(config.policy_file)))
    return store


def load_policy_file(path: Path) -> dict[str, bytes]:
    """The policy paths of a ``.toml`` or ``.json`` file, each value JSON-encoded (as stored in etcd)."""
    tree = read_tree(path, "policy file")
    return {p: encode_value(v) for p, v in flatten_policy(tree, str(path)).items()}


def write_policy_file(path: Path, items: Mapping[str, bytes]) -> None:
    """Write the paths as a tree, atomically (temporary file + rename); TOML drops comments. The file
    keeps its mode (a new one is 0644): the gateway reading it may run as another user."""
    tree = policy_tree({p: decode_value(p, raw) for p, raw in items.items()})
    text = json.dumps(tree, indent=2, sort_keys=True) + "\n" if path.suffix == ".json" else _toml(tree, [])
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mode 0600
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_scalar(value: object, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    raise ConfigError(f"{where}: TOML cannot hold {value!r}; use a .json policy file")


def _toml(tree: Mapping[str, object], parts: list[str]) -> str:
    """TOML for a tree: scalars as ``key = value`` under the table's header, sub-tables after them (a
    table holding only sub-tables gets no header of its own)."""
    tables = [(k, v) for k, v in tree.items() if isinstance(v, Mapping)]
    lines = [
        f"{_toml_key(k)} = {_toml_scalar(v, '/'.join([*parts, k]))}"
        for k, v in tree.items()
        if not isinstance(v, Mapping)
    ]
    if parts and (lines or not tables):
        lines.insert(0, f"[{'.'.join(_toml_key(p) for p in parts)}]")
    text = "\n".join(lines) + "\n" if lines else ""
    for key, value in tables:
        text += ("\n" if text else "") + _toml(value, [*parts, key])
    return text


def routing_policy(policy: Policy, *, max_fallbacks: int | None) -> RoutingPolicy:
    """What the router decides by under ``policy``: its first profile, a :class:`Route` per model route
    (labels + that route's profile), and the block size. ``max_fallbacks``: the gateway-wide cap on
    fallbacks after the pick. :class:`ConfigError` only for a policy :class:`PolicyStore` would refuse."""
    scheduling = policy.scheduling
    routes = {
        model: Route(
            tuple(sorted(route.labels)), build_profile(scheduling, route.profile, max_fallbacks=max_fallbacks)
        )
        for model, route in policy.routes.items()
    }
    profile = build_profile(scheduling, max_fallbacks=max_fallbacks)
    return RoutingPolicy(profile, types.MappingProxyType(routes), policy.block_size)


def cascade_policy(policy: Policy) -> CascadePolicy:
    """The cascades under ``policy``: each virtual model's :class:`~extproc.cascade.spec.CascadeSpec`."""
    cascades = {m: r.cascade for m, r in policy.routes.items() if r.cascade is not None}
    return CascadePolicy(types.MappingProxyType(cascades))


def pd_policy(policy: Policy, *, max_fallbacks: int | None) -> PdPolicy:
    """The disaggregation policy under ``policy``: a :class:`~extproc.disagg.plan.PdRoute` (its prefill
    profile built: the spec's, else the route's) for each model route that is not aggregated."""
    routes = {
        model: PdRoute(
            route.disaggregation,
            build_profile(
                policy.scheduling,
                route.disaggregation.prefill_profile or route.profile,
                max_fallbacks=max_fallbacks,
            ),
            tuple(sorted(route.labels)),
        )
        for model, route in policy.routes.items()
        if route.disaggregation is not None and route.disaggregation.mode != "aggregated"
    }
    return PdPolicy(types.MappingProxyType(routes))
