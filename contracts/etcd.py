"""The etcd contract (DESIGN.md contract 3): how to reach etcd, the key schema and the codec of peer values.

Pure: no etcd client is imported here (:mod:`runtime.etcd` is the client side: connection, leased
keys). Key schema, under a configurable prefix (default ``/kvgate/``):

=====================  ============================================================  ==================
key                    value                                                         written by
=====================  ============================================================  ==================
``endpoints/<node>/``  JSON endpoint (:func:`engines.endpoint.encode_endpoint`,      node agents
``<id>``               versioned: :mod:`contracts.versions`), under a lease; older
                       agents wrote ``endpoints/<id>``, which gateways still read
``drain/<id>``         any value (by convention ``{"at": unix_s, "by": who}``);      ``kvgate drain``
                       present = the endpoint takes no new requests
``policy/<path>``      one JSON value per key (:mod:`extproc.control.policy`), e.g.  ``kvgate policy``
                       ``policy/weights/prefix`` = ``3.0``; flow control under
                       ``policy/flow/...`` (:mod:`extproc.flow.policy`), e.g.
                       ``policy/flow/saturation`` = ``{"max_waiting": 8}``
``models/<name>``      JSON route ``{"labels": {..}, "profile": ".."}``              ``kvgate policy``
``objectives/<name>``  JSON objective ``{"priority": 1, "ttft_ms": 500}``            ``kvgate policy``
                       (:mod:`extproc.flow.policy`)
``tenants/<id>``       JSON tenant, the schema of a gateway config ``[[tenants]]``   ``kvgate policy``
                       table (:mod:`extproc.admission.tenants`); ``id`` may be
                       omitted, else must equal ``<id>``
``usage/<tenant>/``    JSON integer: the tokens one ext_proc replica charged the     ext_proc replicas
``<replica>``          tenant's budget since it started (:func:`encode_usage`),
                       under its lease (:mod:`extproc.admission.shared`)
``kvcached/<node>``    a node's tier store (:class:`PeerInfo`, with the digest       kvcached daemons
                       version of its blocks' keys), under a lease
``federation/<c>``     JSON link to peer cluster ``<c>``                               ``kvgate policy``
                       (:mod:`extproc.federation.links`; a bad value is refused,
                       the link in force stays)
``burst/<name>``       JSON hosted burst endpoint naming a credential the gateway   ``kvgate policy``
                       host declares (:mod:`extproc.burst.records`; a bad value is
                       refused, the endpoint in force stays)
=====================  ============================================================  ==================

Only :mod:`etcd3aio` (grpc.aio) talks to etcd in kvgate: one etcd client library per process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from contracts.config import Section, all_or_none, hostport
from contracts.errors import ConfigError
from contracts.versions import (
    DIGEST_VERSION,
    KVCACHED_RECORD_VERSION,
    LEGACY_VERSION,
    Skew,
    describe,
    digest_matches,
    skew,
)

ENDPOINTS, DRAIN, POLICY, MODELS, OBJECTIVES, TENANTS, KVCACHED = (
    "endpoints",
    "drain",
    "policy",
    "models",
    "objectives",
    "tenants",
    "kvcached",
)
"""Key families: the first path segment after the prefix."""

FEDERATION = "federation"
"""Key family of cross-cluster links (``federation/<cluster>``)."""

BURST = "burst"
"""Key family of hosted burst endpoints (``burst/<name>``, :mod:`extproc.burst.records`)."""

USAGE = "usage"
"""Key family of the token counters ext_proc replicas share (``usage/<tenant>/<replica>``)."""


@dataclass(frozen=True, slots=True)
class EtcdSettings:
    """How to reach etcd: client ``host:port`` endpoints, the key prefix (ends with ``/``), optional TLS
    (``tls_ca`` PEM path verifies the servers; ``tls_cert`` + ``tls_key`` are the client certificate,
    both or neither, and need ``tls_ca``; ``tls_server_name`` overrides the name checked against the
    server certificate, needed with several TLS endpoints), and ``timeout_s``, the deadline of one call."""

    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    prefix: str = "/kvgate/"
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    timeout_s: float = 2.0


_DEFAULT = EtcdSettings()


def parse_etcd_settings(raw: object, where: str) -> EtcdSettings:
    """Validate an ``[etcd]`` table (unknown keys, bad addresses, half-set TLS: :class:`ConfigError`)."""
    s = Section(raw, where)
    endpoints = s.array("endpoints", list(_DEFAULT.endpoints))
    if not endpoints or not all(isinstance(e, str) for e in endpoints):
        raise ConfigError(f"{where}.endpoints: expected a non-empty list of host:port strings")
    prefix = s.string("prefix", _DEFAULT.prefix)
    if not prefix.endswith("/"):
        raise ConfigError(f"{where}.prefix: must end with '/', got {prefix!r}")
    settings = EtcdSettings(
        endpoints=tuple(hostport(e, f"{where}.endpoints") for e in endpoints),
        prefix=prefix,
        tls_ca=s.string("tls_ca"),
        tls_cert=s.string("tls_cert"),
        tls_key=s.string("tls_key"),
        tls_server_name=s.string("tls_server_name"),
        timeout_s=s.number("timeout_s", _DEFAULT.timeout_s, minimum=0.001),
    )
    s.done()
    all_or_none(where, tls_cert=settings.tls_cert, tls_key=settings.tls_key)
    if settings.tls_cert and not settings.tls_ca:
        raise ConfigError(f"{where}: a client certificate (tls_cert, tls_key) needs tls_ca")
    if settings.tls_ca == "":
        raise ConfigError(f"{where}.tls_ca: must not be empty")
    return settings


# -- keys ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Change:
    """One key's new value as a watch reports it; ``value`` ``None``: the key was deleted (or expired with
    its lease). ``created``: the key's etcd create revision (0: not known, or a delete)."""

    key: str
    value: bytes | None
    created: int = 0


def family_key(prefix: str, family: str, name: str) -> str:
    """``<prefix><family>/<name>``; ``name`` must be non-empty."""
    if not name:
        raise ConfigError(f"{family}: empty name")
    return f"{prefix}{family}/{name}"


def endpoint_key(prefix: str, endpoint_id: str, node: str | None = None) -> str:
    """``<prefix>endpoints/<node>/<id>`` (what agents write: etcd's RBAC gives each agent identity the
    ``endpoints/<node>/`` prefix, :mod:`kvgate.etcdsec`), or ``<prefix>endpoints/<id>`` without a node
    (the layout of older agents)."""
    if node is None:
        return family_key(prefix, ENDPOINTS, endpoint_id)
    if not node or "/" in node or "/" in endpoint_id:
        raise ConfigError(f"{ENDPOINTS}: bad node {node!r} or endpoint id {endpoint_id!r}")
    return family_key(prefix, ENDPOINTS, f"{node}/{endpoint_id}")


def endpoint_id_of(name: str) -> str:
    """The endpoint id of an ``endpoints/`` key's name (``<node>/<id>`` or ``<id>``)."""
    return name.rpartition("/")[2]


def drain_key(prefix: str, endpoint_id: str) -> str:
    return family_key(prefix, DRAIN, endpoint_id)


def tenant_key(prefix: str, tenant_id: str) -> str:
    """``<prefix>tenants/<id>``."""
    return family_key(prefix, TENANTS, tenant_id)


def usage_key(prefix: str, tenant_id: str, replica: str) -> str:
    """``<prefix>usage/<tenant>/<replica>``; neither part may be empty or contain ``/``."""
    if not tenant_id or not replica or "/" in tenant_id or "/" in replica:
        raise ConfigError(f"{USAGE}: bad tenant {tenant_id!r} or replica {replica!r}")
    return family_key(prefix, USAGE, f"{tenant_id}/{replica}")


def split_usage(name: str) -> tuple[str, str] | None:
    """``(tenant, replica)`` of a ``usage/`` key's name (what :func:`split_key` returns after the family),
    or ``None`` when it is not ``<tenant>/<replica>``."""
    tenant_id, sep, replica = name.partition("/")
    if not sep or not tenant_id or not replica or "/" in replica:
        return None
    return tenant_id, replica


_OWN_FAMILIES = (MODELS, OBJECTIVES)
"""Policy paths whose first segment is a key family of its own (``models/<name>``, ``objectives/<name>``)."""


def policy_key(prefix: str, path: str) -> str:
    """The key of a policy path (:mod:`extproc.control.policy`): ``models/<name>`` and
    ``objectives/<name>`` live in their own families, every other path under ``policy/``."""
    for family in _OWN_FAMILIES:
        if path.startswith(family + "/"):
            return family_key(prefix, family, path[len(family) + 1 :])
    return family_key(prefix, POLICY, path)


def split_key(prefix: str, key: str | bytes) -> tuple[str, str] | None:
    """``(family, name)`` of a key under ``prefix``, or ``None`` if it is not ``<prefix><family>/<name>``."""
    text = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
    if not text.startswith(prefix):
        return None
    family, sep, name = text[len(prefix) :].partition("/")
    if not sep or not family or not name:
        return None
    return family, name


def policy_path(family: str, name: str) -> str | None:
    """The policy path of a ``policy/``, ``models/`` or ``objectives/`` key (``None`` for other families,
    and for ``policy/models/...`` and ``policy/objectives/...``, which would shadow those families)."""
    if family in _OWN_FAMILIES:
        return f"{family}/{name}"
    if family == POLICY and not name.startswith(tuple(f + "/" for f in _OWN_FAMILIES)):
        return name
    return None


# -- policy/<path>, models/<name> and objectives/<name> values -----------------------------------------


def decode_value(path: str, raw: bytes) -> object:
    """The JSON value of the policy key for ``path`` (``policy/<path>``, ``models/<name>`` or
    ``objectives/<name>``)."""
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"policy {path}: not valid JSON: {exc}") from exc
    except RecursionError:  # arrays or objects nested too deep for the parser
        raise ConfigError(f"policy {path}: not valid JSON: nested too deep") from None


def encode_value(value: object) -> bytes:
    """A policy value as stored: compact JSON with sorted keys (so equal values are equal bytes)."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


# -- usage/<tenant>/<replica> (written and read by ext_proc replicas) ---------------------------------


def encode_usage(charged: int) -> bytes:
    """The value of a ``usage/<tenant>/<replica>`` key: the replica's cumulative charge, as JSON."""
    return str(int(charged)).encode()


def decode_usage(value: bytes) -> int:
    """Validate a ``usage/`` value: a JSON integer (any sign: only differences between two values of one
    key are used); :class:`ConfigError` otherwise."""
    try:
        doc = json.loads(value)
    except ValueError as exc:
        raise ConfigError(f"{USAGE}: not valid JSON: {exc}") from exc
    if not isinstance(doc, int) or isinstance(doc, bool):
        raise ConfigError(f"{USAGE}: expected an integer, got {doc!r}")
    return doc


# -- kvcached/<node> (written by kvcached daemons, read by peers and gateways) ---------------------


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """One kvcached daemon as registered: node id, local gRPC API (TCP, mTLS; ``None``: unix only),
    QUIC peer address (``None``: serves no peers) and index feed, each ``host:port``; ``digest``: the
    digest version (:data:`contracts.versions.DIGEST_VERSION`) the daemon keys its blocks and feed by
    (a record without it is version 1). Readers of another digest version neither follow its feed nor
    fetch from it: its digests never name their blocks (:func:`contracts.versions.digest_matches`).
    ``schema``: the record's version (:data:`contracts.versions.KVCACHED_RECORD_VERSION`; without the
    field 1), read under the rule of :mod:`contracts.versions` (:func:`peer_skew`)."""

    node: str
    grpc: str | None
    quic: str | None
    feed: str | None
    digest: int = DIGEST_VERSION
    schema: int = KVCACHED_RECORD_VERSION


def peer_key(prefix: str, node: str) -> str:
    """``<prefix>kvcached/<node>``."""
    return family_key(prefix, KVCACHED, node)


def encode_peer(info: PeerInfo) -> bytes:
    """The JSON value of ``kvcached/<node>`` (sorted keys, compact; ``schema``: this version's)."""
    doc = {
        "node": info.node,
        "grpc": info.grpc,
        "quic": info.quic,
        "feed": info.feed,
        "digest": info.digest,
        "schema": KVCACHED_RECORD_VERSION,
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


_PEER_FIELDS = frozenset({"node", "grpc", "quic", "feed", "digest", "schema"})


def decode_peer(node: str, value: bytes) -> PeerInfo:
    """Validate a ``kvcached/<node>`` value; :class:`ConfigError` names the field and the reason. A
    ``schema`` this reader reads (N - 1, N) is read strictly (an unknown field fails); a newer one
    leniently (its unknown fields ignored), and :func:`peer_skew` then tells the reader not to use it."""
    where = f"{KVCACHED}/{node}"
    try:
        doc = json.loads(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    schema = doc.get("schema", LEGACY_VERSION)
    if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
        raise ConfigError(f"{where}.schema: expected a version >= 1, got {schema!r}")
    unknown = sorted(set(doc) - _PEER_FIELDS)
    if unknown and skew(schema, KVCACHED_RECORD_VERSION) is not Skew.NEWER:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")
    if doc.get("node") != node:
        raise ConfigError(f"{where}.node: {doc.get('node')!r} does not match the key")
    fields: dict[str, str | None] = {}
    for name in ("grpc", "quic", "feed"):
        v = doc.get(name)
        if v is not None and not _is_hostport(v):
            raise ConfigError(f"{where}.{name}: expected host:port or null, got {v!r}")
        fields[name] = v
    digest = doc.get("digest", LEGACY_VERSION)
    if not isinstance(digest, int) or isinstance(digest, bool) or digest < 1:
        raise ConfigError(f"{where}.digest: expected a version >= 1, got {digest!r}")
    return PeerInfo(node, fields["grpc"], fields["quic"], fields["feed"], digest, schema)


def peer_skew(info: PeerInfo) -> tuple[str, int, str] | None:
    """Why a reader of this version must not use a daemon's record (neither follow its feed nor fetch its
    blocks): ``(what, version, outcome)`` for :class:`contracts.versions.SkewLog`, or ``None`` when it
    may. A record schema other than N - 1 or N (newer: its fields may mean something else; older than
    N - 1: refused), or a digest version other than this process's (its digests never name our blocks)."""
    if skew(info.schema, KVCACHED_RECORD_VERSION) is not Skew.OK:
        return "kvcached record", info.schema, describe(info.schema, KVCACHED_RECORD_VERSION)
    if not digest_matches(info.digest):
        return "kvcached digest", info.digest, f"this process's is {DIGEST_VERSION}"
    return None


def _is_hostport(value: object) -> bool:
    if not isinstance(value, str):
        return False
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) <= 65535)
