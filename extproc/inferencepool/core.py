"""Sans-IO: an InferencePool and its pods (the API's JSON objects) -> the pool's endpoints, and the list +
watch protocol's state (objects by name, the resourceVersion to resume from, what an event means).

No IO, no clock: :mod:`extproc.inferencepool.watch` feeds it what the API server sends.

A pod is an endpoint of the pool when its labels carry every ``spec.selector.matchLabels`` pair, it has
an IP, its ``Ready`` condition is ``True`` and it is not terminating (no ``metadata.deletionTimestamp``):
one endpoint per ``spec.targetPorts[].number``, at ``<podIP>:<port>``, with the id ``<pod>`` (one target
port) or ``<pod>:<port>`` (several), role ``both``, the engine kind of its ``kvgate.io/engine``
annotation (else the pool's, else the config's), the models of its ``kvgate.io/models`` annotation
(comma-separated; else the pool's, else the config's) and ``metrics_url`` ``http://<ip>:<port><path>``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from contracts.config import choice
from contracts.errors import ConfigError
from contracts.events import EndpointId
from engines.endpoint import Endpoint
from engines.kinds import ENGINE_KINDS
from extproc.inferencepool.config import PoolSettings

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
#: What the picker asks of the API, as RBAC says it: (API group, resource) -> verbs, in its namespace
#: (deploy/kubernetes/base/rbac.yaml grants these, read-only).
API_ACCESS = {("", "pods"): ("list", "watch"), (GROUP, PLURAL): ("list", "watch")}
ENGINE_ANNOTATION = "kvgate.io/engine"
MODELS_ANNOTATION = "kvgate.io/models"
GONE = 410
"""The HTTP status (in a watch ``ERROR`` event's Status, or a list's response) of a resourceVersion the API
server no longer has: the client must list again."""

Obj = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What the fleet takes from an InferencePool: its selector, ports and (annotations) defaults."""

    name: str
    match_labels: tuple[tuple[str, str], ...]
    target_ports: tuple[int, ...]
    engine: str | None = None
    models: frozenset[str] | None = None

    @property
    def label_selector(self) -> str:
        """The selector as the API's ``labelSelector`` query parameter."""
        return ",".join(f"{k}={v}" for k, v in self.match_labels)


@dataclass(frozen=True, slots=True)
class PodView:
    """What the fleet takes from a pod."""

    name: str
    ip: str | None
    labels: tuple[tuple[str, str], ...]
    ready: bool
    terminating: bool
    annotations: tuple[tuple[str, str], ...] = ()


def _table(obj: object, where: str) -> Obj:
    if not isinstance(obj, Mapping):
        raise ConfigError(f"{where}: expected an object, got {type(obj).__name__}")
    return obj


def _strings(obj: object, where: str) -> tuple[tuple[str, str], ...]:
    table = _table(obj if obj is not None else {}, where)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in table.items()):
        raise ConfigError(f"{where}: expected string keys and values")
    return tuple(sorted(table.items()))


def _name(obj: Obj, where: str) -> str:
    name = _table(obj.get("metadata"), f"{where}.metadata").get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.metadata.name: required")
    return name


def _models(value: str, where: str) -> frozenset[str]:
    models = frozenset(m.strip() for m in value.split(",") if m.strip())
    if not models:
        raise ConfigError(f"{where}: expected comma-separated model names, got {value!r}")
    return models


def parse_pool(obj: object) -> PoolSpec:
    """An ``InferencePool`` (v1) object; :class:`ConfigError` when it lacks a usable selector or ports."""
    pool = _table(obj, "InferencePool")
    name = _name(pool, "InferencePool")
    where = f"InferencePool {name}"
    spec = _table(pool.get("spec"), f"{where}.spec")
    labels = _strings(_table(spec.get("selector"), f"{where}.spec.selector").get("matchLabels"), where)
    if not labels:
        raise ConfigError(f"{where}.spec.selector.matchLabels: required (a pool selects by labels)")
    ports_raw = spec.get("targetPorts")
    if not isinstance(ports_raw, list) or not ports_raw:
        raise ConfigError(f"{where}.spec.targetPorts: expected a non-empty list")
    ports: list[int] = []
    for i, port in enumerate(ports_raw):
        number = _table(port, f"{where}.spec.targetPorts[{i}]").get("number")
        if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= 65535:
            raise ConfigError(f"{where}.spec.targetPorts[{i}].number: expected a port, got {number!r}")
        if number not in ports:
            ports.append(number)
    annotations = dict(_strings(_table(pool["metadata"], where).get("annotations"), f"{where}.annotations"))
    engine = annotations.get(ENGINE_ANNOTATION)
    if engine is not None:
        engine = choice(engine, ENGINE_KINDS, f"{where} annotation {ENGINE_ANNOTATION}")
    models = annotations.get(MODELS_ANNOTATION)
    return PoolSpec(
        name,
        labels,
        tuple(ports),
        engine,
        None if models is None else _models(models, f"{where} annotation {MODELS_ANNOTATION}"),
    )


def parse_pod(obj: object) -> PodView:
    """A ``Pod`` object (only the fields the fleet reads); :class:`ConfigError` when malformed."""
    pod = _table(obj, "Pod")
    name = _name(pod, "Pod")
    meta = _table(pod["metadata"], f"Pod {name}.metadata")
    status = pod.get("status") or {}
    status = _table(status, f"Pod {name}.status")
    conditions = status.get("conditions") or []
    ready = isinstance(conditions, list) and any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
    )
    ip = status.get("podIP")
    return PodView(
        name=name,
        ip=ip if isinstance(ip, str) and ip else None,
        labels=_strings(meta.get("labels"), f"Pod {name}.metadata.labels"),
        ready=ready,
        terminating=meta.get("deletionTimestamp") is not None,
        annotations=_strings(meta.get("annotations"), f"Pod {name}.metadata.annotations"),
    )


def selected(pool: PoolSpec, pod: PodView) -> bool:
    """The pod carries every label of the pool's selector."""
    return set(pool.match_labels) <= set(pod.labels)


def in_fleet(pool: PoolSpec, pod: PodView) -> bool:
    """The pod serves the pool now: selected, Ready, not terminating, with an IP."""
    return selected(pool, pod) and pod.ready and not pod.terminating and pod.ip is not None


def pod_endpoints(pool: PoolSpec, pod: PodView, settings: PoolSettings) -> list[Endpoint]:
    """The endpoints of one pod in the fleet (:func:`in_fleet`), one per target port; :class:`ConfigError`
    for a bad annotation (the pod stays out of the fleet)."""
    assert pod.ip is not None
    where = f"Pod {pod.name}"
    annotations = dict(pod.annotations)
    engine = annotations.get(ENGINE_ANNOTATION)
    if engine is not None:
        engine = choice(engine, ENGINE_KINDS, f"{where} annotation {ENGINE_ANNOTATION}")
    models_raw = annotations.get(MODELS_ANNOTATION)
    models = (
        _models(models_raw, f"{where} annotation {MODELS_ANNOTATION}")
        if models_raw is not None
        else pool.models or settings.models
    )
    host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
    out = []
    for port in pool.target_ports:
        address = f"{host}:{port}"
        out.append(
            Endpoint(
                id=EndpointId(pod.name if len(pool.target_ports) == 1 else f"{pod.name}:{port}"),
                address=address,
                models=models,
                engine=engine or pool.engine or settings.engine,
                metrics_url=f"http://{address}{settings.metrics_path}" if settings.metrics_path else None,
                labels=(("inference-pool", pool.name),),
                role="both",
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class PoolView:
    """The pool's endpoints by id, and the pods left out for a bad annotation (name -> reason)."""

    endpoints: Mapping[EndpointId, Endpoint]
    refused: Mapping[str, str]


def pool_endpoints(pool: PoolSpec | None, pods: Iterable[PodView], settings: PoolSettings) -> PoolView:
    """Every endpoint of the pool's pods in the fleet (none without a pool)."""
    endpoints: dict[EndpointId, Endpoint] = {}
    refused: dict[str, str] = {}
    if pool is None:
        return PoolView(endpoints, refused)
    for pod in sorted(pods, key=lambda p: p.name):
        if not in_fleet(pool, pod):
            continue
        try:
            for endpoint in pod_endpoints(pool, pod, settings):
                endpoints[endpoint.id] = endpoint
        except ConfigError as exc:
            refused[pod.name] = str(exc)
    return PoolView(endpoints, refused)


# --- the list + watch protocol ------------------------------------------------------------------------


class Outcome(Enum):
    """What a watch event means to the client."""

    CHANGED = "changed"  # an object came, changed or went
    UNCHANGED = "unchanged"  # a bookmark, or an object as it was
    RELIST = "relist"  # 410 Gone: the resourceVersion is too old; list again
    ERROR = "error"  # another error: watch again from the last resourceVersion, after a back-off


class ProtocolError(Exception):
    """The server sent something that is not the watch protocol (the client reconnects)."""


def decode_line(line: bytes) -> Obj:
    """One line of a watch stream: ``{"type": ..., "object": ...}``."""
    try:
        event = json.loads(line)
    except ValueError as exc:
        raise ProtocolError(f"watch event is not JSON: {exc}") from exc
    if not isinstance(event, Mapping) or not isinstance(event.get("object"), Mapping):
        raise ProtocolError("watch event without an object")
    return event


def status_code(obj: Obj) -> int | None:
    """The ``code`` of a ``Status`` object (an ``ERROR`` event's, or an error response's body)."""
    code = obj.get("code")
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def _resource_version(obj: Obj) -> str | None:
    meta = obj.get("metadata")
    rv = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
    return rv if isinstance(rv, str) and rv else None


class Collection:
    """One collection as list + watch sees it: the objects by name and the resourceVersion a watch resumes
    from (that of the list, then of each event and bookmark)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.objects: dict[str, Obj] = {}
        self.resource_version: str | None = None
        #: Why the last ERROR event ended a watch (empty: none yet).
        self.last_error = ""

    def listed(self, body: object) -> bool:
        """A list response replaces every object; returns whether the set of objects changed."""
        doc = _table(body, f"{self.kind} list")
        items = doc.get("items")
        if not isinstance(items, list):
            raise ProtocolError(f"{self.kind} list without items")
        objects: dict[str, Obj] = {}
        for item in items:
            if isinstance(item, Mapping):
                try:
                    objects[_name(item, self.kind)] = item
                except ConfigError:
                    continue
        rv = _resource_version(doc)
        if rv is None:
            raise ProtocolError(f"{self.kind} list without metadata.resourceVersion")
        changed = objects != self.objects
        self.objects, self.resource_version = objects, rv
        return changed

    def event(self, event: Obj) -> Outcome:
        """Apply one watch event (:func:`decode_line`)."""
        kind, obj = event.get("type"), event["object"]
        if kind == "ERROR":
            code = status_code(obj)
            message = obj.get("message")
            self.last_error = f"{code}: {message}" if isinstance(message, str) else str(code)
            if code == GONE:
                self.resource_version = None
                return Outcome.RELIST
            return Outcome.ERROR
        rv = _resource_version(obj)
        if kind == "BOOKMARK":
            if rv is not None:
                self.resource_version = rv
            return Outcome.UNCHANGED
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            raise ProtocolError(f"unknown watch event type {kind!r}")
        try:
            name = _name(obj, self.kind)
        except ConfigError as exc:
            raise ProtocolError(str(exc)) from exc
        if rv is not None:
            self.resource_version = rv
        if kind == "DELETED":
            return Outcome.CHANGED if self.objects.pop(name, None) is not None else Outcome.UNCHANGED
        if self.objects.get(name) == obj:
            return Outcome.UNCHANGED
        self.objects[name] = obj
        return Outcome.CHANGED


class PoolCore:
    """The pool object and its pods as two :class:`Collection` s (the pool's: a list + watch of the one
    object by name) -> the pool's endpoints (:meth:`view`).

    A pool object that does not parse is refused and the last good spec stays (``refused_pool`` says
    why); a pod that does not parse is left out (with its reason in the view's ``refused``).
    ``selector_changed`` tells the IO to watch the pods again with :attr:`spec`'s selector.
    """

    def __init__(self, settings: PoolSettings) -> None:
        self.settings = settings
        self.pool = Collection("InferencePool")
        self.pods = Collection("Pod")
        self.spec: PoolSpec | None = None
        self.refused_pool = ""

    def pool_changed(self) -> bool:
        """Re-read the pool object after its collection changed; returns whether the spec changed."""
        obj = self.pool.objects.get(self.settings.name)
        if obj is None:
            spec = None
        else:
            try:
                spec = parse_pool(obj)
            except ConfigError as exc:
                self.refused_pool = str(exc)
                return False
        self.refused_pool = ""
        if spec == self.spec:
            return False
        self.spec = spec
        return True

    def view(self) -> PoolView:
        """The pool's endpoints now; a pod that does not parse is left out, with its reason in
        ``refused`` as for a bad annotation."""
        pods: list[PodView] = []
        unparsed: dict[str, str] = {}
        for name, obj in self.pods.objects.items():
            try:
                pods.append(parse_pod(obj))
            except ConfigError as exc:
                unparsed[name] = str(exc)
        view = pool_endpoints(self.spec, pods, self.settings)
        if not unparsed or self.spec is None:
            return view
        return PoolView(view.endpoints, {**view.refused, **unparsed})
