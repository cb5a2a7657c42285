"""The endpoint record: one engine replica as agents register it and gateways route to it.

:class:`Endpoint` is what a gateway's ``[[endpoints]]`` table and an agent's etcd ``endpoints/<id>`` value
(:func:`encode_endpoint` / :func:`decode_endpoint`, key schema in :mod:`contracts.etcd`) both describe;
:func:`parse_endpoint` validates either, against the engine kinds and roles of :mod:`engines.kinds`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from urllib.parse import urlsplit

from contracts.config import REQUIRED, Section, canonical_address, choice, hostport
from contracts.errors import ConfigError
from contracts.etcd import ENDPOINTS
from contracts.events import EndpointId
from contracts.versions import DIGEST_VERSION, LEGACY_VERSION, RECORD_VERSION, Skew, describe, skew
from engines.kinds import ENGINE_KINDS, ROLES
from engines.priority import PRIORITY_ORDERS

#: Fields of a record that say how to read it, not what the endpoint is (:mod:`contracts.versions`).
VERSION_FIELDS = ("schema", "digest")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A static description of one engine replica.

    ``address`` is the ``ip:port`` Envoy proxies to; ``metrics_url`` the Prometheus endpoint to scrape
    (``None``: no scraping: the endpoint is trusted healthy and scored on what this gateway routed there,
    or on the load its agent streams). Registered by a node agent (etcd ``endpoints/<id>``), it also
    has: ``node``, the agent's node id; ``feed``, the ``host:port`` of the agent's index event stream
    (:mod:`contracts.events`); ``kv_events``, whether that stream carries this endpoint's KV events (else
    the gateway keeps learning it from its own decisions); ``role`` (``both``, ``prefill`` or
    ``decode``), ``block_size`` (the engine's KV block, tokens) and ``capacity_blocks`` (its KV blocks).
    ``slot_restore``: the agent's ``http(s)`` URL that restores a prefix from the node's kvcached into the
    engine before a request is sent there (llama.cpp; :mod:`extproc.control.restore`), ``None`` when not
    offered. ``bootstrap_port``: an SGLang prefill server's PD bootstrap port, which its decode partner
    connects to (``None``: none; :mod:`extproc.disagg`). ``adapters``: the names in ``models`` that are
    LoRA adapters of the endpoint's base model (the others; vLLM ``--lora-modules``), each routed by name
    like a model; listing one adds it to ``models``. ``priority_order``: the engine schedules by the body's
    ``priority`` field, ``low_first`` (vLLM ``--scheduling-policy priority``) or ``high_first`` (SGLang
    ``--enable-priority-scheduling``; :mod:`engines.priority`), ``None``: it does not (or did not say).
    """

    id: EndpointId
    address: str
    models: frozenset[str]
    engine: str = "vllm"
    metrics_url: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    role: str = "both"
    node: str | None = None
    feed: str | None = None
    kv_events: bool = False
    block_size: int | None = None
    capacity_blocks: int | None = None
    slot_restore: str | None = None
    bootstrap_port: int | None = None
    adapters: frozenset[str] = frozenset()
    priority_order: str | None = None

    @property
    def base_model(self) -> str | None:
        """The model the adapters apply to: the first (sorted) of ``models`` that is not an adapter."""
        bases = self.models - self.adapters
        return min(bases) if bases else None


def parse_endpoint(raw: object, where: str) -> Endpoint:
    """One endpoint (a static ``[[endpoints]]`` table or an etcd ``endpoints/<id>`` value): every
    :class:`Endpoint` field; ``id`` defaults to the address, a JSON ``null`` means absent."""
    if isinstance(raw, Mapping):
        raw = {k: v for k, v in raw.items() if v is not None}
    s = Section(raw, where)
    # As Envoy names the host (EDS, its logs, override_host): one spelling per socket.
    address = canonical_address(hostport(s.string("address", REQUIRED), f"{where}.address"))
    models = s.array("models", REQUIRED)
    if not models or not all(isinstance(m, str) and m for m in models):
        raise ConfigError(f"{where}.models: expected a non-empty list of model names")
    adapters = s.array("adapters", [])
    if not all(isinstance(a, str) and a for a in adapters):
        raise ConfigError(f"{where}.adapters: expected a list of adapter names")
    if set(adapters) >= set(models):
        raise ConfigError(f"{where}.adapters: the base model must be in models and not an adapter")
    engine = choice(s.string("engine", "vllm"), ENGINE_KINDS, f"{where}.engine")
    role = choice(s.string("role", "both"), ROLES, f"{where}.role")
    labels = s.table("labels")
    label_items = tuple(sorted((k, labels.string(k, REQUIRED)) for k in labels.names()))
    labels.done()
    feed = s.string("feed")
    order = s.string("priority_order")
    endpoint = Endpoint(
        id=EndpointId(s.string("id", address)),
        address=address,
        models=frozenset(models) | frozenset(adapters),
        engine=engine,
        metrics_url=s.string("metrics_url"),
        labels=label_items,
        role=role,
        node=s.string("node"),
        feed=None if feed is None else hostport(feed, f"{where}.feed"),
        kv_events=s.flag("kv_events", False),
        block_size=s.integer("block_size", None, minimum=1),
        capacity_blocks=s.integer("capacity_blocks", None, minimum=1),
        slot_restore=_http_url(s.string("slot_restore"), f"{where}.slot_restore"),
        bootstrap_port=s.integer("bootstrap_port", None, minimum=1),
        adapters=frozenset(adapters),
        priority_order=None if order is None else choice(order, PRIORITY_ORDERS, f"{where}.priority_order"),
    )
    if endpoint.bootstrap_port is not None and endpoint.bootstrap_port > 65535:
        raise ConfigError(f"{where}.bootstrap_port: must be a port number, got {endpoint.bootstrap_port}")
    s.done()
    return endpoint


def _http_url(value: str | None, where: str) -> str | None:
    """``value`` if it is an ``http``/``https`` URL with a host (``None`` passes through)."""
    if value is None:
        return None
    try:
        parts = urlsplit(value)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
        parts = urlsplit("")
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise ConfigError(f"{where}: expected an http:// or https:// URL with a host, got {value!r}")
    return value


def encode_endpoint(endpoint: Endpoint) -> bytes:
    """The JSON value of ``endpoints/<node>/<id>`` (sorted keys, compact; ``slot_restore`` only when
    set), with the record version (``schema``) and the digest version its KV events are made under
    (``digest``)."""
    doc: dict[str, object] = {
        "schema": RECORD_VERSION,
        "digest": DIGEST_VERSION,
        "id": endpoint.id,
        "address": endpoint.address,
        "models": sorted(endpoint.models),
        "engine": endpoint.engine,
        "role": endpoint.role,
        "node": endpoint.node,
        "feed": endpoint.feed,
        "kv_events": endpoint.kv_events,
        "metrics_url": endpoint.metrics_url,
        "block_size": endpoint.block_size,
        "capacity_blocks": endpoint.capacity_blocks,
        "labels": dict(endpoint.labels),
    }
    if endpoint.slot_restore is not None:  # absent otherwise: records stay readable by older gateways
        doc["slot_restore"] = endpoint.slot_restore
    if endpoint.bootstrap_port is not None:  # the same
        doc["bootstrap_port"] = endpoint.bootstrap_port
    if endpoint.adapters:  # the same
        doc["adapters"] = sorted(endpoint.adapters)
    if endpoint.priority_order is not None:  # the same
        doc["priority_order"] = endpoint.priority_order
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class Decoded:
    """An ``endpoints/`` record as a reader takes it: the endpoint, and ``skew``: ``None`` when read as
    written, else why its KV data (``kv_events``, ``slot_restore``) was dropped or, with ``refused``,
    why the record was not taken at all (a line to log once)."""

    endpoint: Endpoint | None
    skew: str | None = None
    refused: bool = False


def decode_endpoint(key_name: str, value: bytes) -> Endpoint:
    """Validate an ``endpoints/<key_name>`` value of a version this reader reads as written;
    :class:`ConfigError` names the field and the reason (also for any version skew)."""
    decoded = decode_record(key_name, value)
    if decoded.endpoint is None or decoded.skew is not None:
        raise ConfigError(decoded.skew or f"{ENDPOINTS}/{key_name}: refused")
    return decoded.endpoint


def decode_record(key_name: str, value: bytes) -> Decoded:
    """Read an ``endpoints/<key_name>`` value under the version rule of :mod:`contracts.versions`.

    ``key_name`` is ``<node>/<id>`` (the layout agents write: etcd permissions give each agent its
    ``endpoints/<node>/`` prefix) or ``<id>`` (records of agents older than that layout); the record's
    ``id`` must equal ``<id>`` and, when the key names one, its ``node`` the ``<node>``. ``schema`` N - 1 or
    N: validated strictly. Newer: read leniently (unknown fields ignored) with ``kv_events`` off and no
    ``slot_restore``. Older than N - 1: refused. A ``digest`` version other than this process's: the
    KV data is dropped as for a newer schema. :class:`ConfigError` when it does not validate.
    """
    where = f"{ENDPOINTS}/{key_name}"
    node_in_key, sep, key_id = key_name.rpartition("/")
    if sep and (not node_in_key or "/" in node_in_key or not key_id):
        raise ConfigError(f"{where}: expected endpoints/<node>/<id> or endpoints/<id>")
    try:
        raw = json.loads(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        parse_endpoint(raw, where)  # raises: not a table
        raise ConfigError(f"{where}: expected a JSON object")
    if "id" not in raw:  # not defaulted to the address, as in a config file
        raise ConfigError(f"{where}.id: required")
    schema, digest = raw.get("schema", LEGACY_VERSION), raw.get("digest", LEGACY_VERSION)
    for name, version in (("schema", schema), ("digest", digest)):
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ConfigError(f"{where}.{name}: expected a positive integer, got {version!r}")
    verdict = skew(schema, RECORD_VERSION)
    if verdict is Skew.TOO_OLD:
        return Decoded(None, f"{where}: record schema {schema} {describe(schema, RECORD_VERSION)}", True)
    known = {k: v for k, v in raw.items() if k not in VERSION_FIELDS}
    note = None
    if verdict is Skew.NEWER:
        known = {k: v for k, v in known.items() if k in _FIELDS}
        note = f"{where}: record schema {schema} {describe(schema, RECORD_VERSION)}"
    elif digest != DIGEST_VERSION:
        note = f"{where}: digest version {digest}, this gateway's is {DIGEST_VERSION}: its KV data is ignored"
    endpoint = parse_endpoint(known, where)
    if endpoint.id != key_id:
        raise ConfigError(f"{where}.id: {endpoint.id!r} does not match the key")
    if sep and endpoint.node != node_in_key:
        raise ConfigError(f"{where}.node: {endpoint.node!r} does not match the key")
    if note is not None:
        endpoint = replace(endpoint, kv_events=False, slot_restore=None)
    return Decoded(endpoint, note)


_FIELDS = frozenset(f.name for f in fields(Endpoint))
"""The record fields this version knows (a newer record's others are ignored)."""
