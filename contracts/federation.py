"""The federation contract: what one kvgate cluster's gateways tell another's, and the headers on the
forwarded hop (``extproc/federation/README.md`` has the formulas).

A gateway serves :data:`SUBSCRIBE_METHOD` (gRPC server streaming, mTLS both ways): a peer cluster's
gateway sends one :class:`Hello` naming its cluster and gets a :class:`Report` every refresh interval:
per model a :class:`ModelSummary` (a Bloom filter over the chain digests its fleet holds at depths
``2^j`` blocks), its predicted queue wait, and the TTL after which the receiver must ignore it.

Wire: msgpack via msgspec as the (de)serialisers of a generic gRPC method, as :mod:`contracts.events`
does for index feeds (no protoc pinned to the runtime).

Headers on the forwarded request: :data:`HOP_HEADER` (the forwarding cluster's name: the request was
forwarded once and is never forwarded again) and :data:`PEER_HEADER` (the forwarding gateway's identity
URI, written by the receiving Envoy's federation listener from the verified client certificate; every
client value is stripped first). The tenant (:data:`contracts.epp.TENANT_HEADER`) and the hop are
believed only when :data:`PEER_HEADER` names a linked cluster's identity.
"""

from __future__ import annotations

import math

import msgspec

from contracts.errors import MSGPACK_ERRORS

SUBSCRIBE_METHOD = "/kvgate.federation.v1.Federation/Subscribe"
"""gRPC method (server streaming): request :class:`Hello`, responses :class:`Report`."""

HOP_HEADER = "x-kvgate-hop"
"""Request header on a forwarded request: the name of the cluster that forwarded it."""
PEER_HEADER = "x-kvgate-federation-peer"
"""Request header the federation listener's Envoy sets from the client certificate's URI SAN."""
SALTED_HEADER = "x-kvgate-kv-salted"
"""Request header on a forwarded request (value ``1``): the forwarding cluster replaced the body's
``cache_salt`` with the asserted tenant's (tenant KV isolation); the receiving cluster keeps it as is.
Believed, as the tenant, only from a linked identity."""
CLIENT_SALT_HEADER = "x-kvgate-client-salt"
"""Request header on a forwarded request with :data:`SALTED_HEADER`: the client's own ``cache_salt`` (UTF-8,
hex; absent: none) the forwarding cluster mixed with the asserted tenant, so the receiving cluster checks
that the body's salt is that tenant's (``tenant_salt(tenant, client salt)``) and no other tenant's.
Believed, as the tenant, only from a linked identity."""
REFUSED_HEADER = "x-kvgate-federation-refused"
"""Response header on a forwarded request the receiving cluster refused (401, 403, 429: the hop's trust,
the asserted tenant, its budget or rate there), with the refusal's code: the forwarding cluster's Envoy
retries such an answer on its local pick, so a request never fails because a peer refused it."""
UNTRUSTED = "federation_untrusted"
"""The :data:`REFUSED_HEADER` code (with 401) of a link that does not trust tenants at all: the forwarding
cluster's failed-try log takes it as the peer's failure (skipped a while), unlike a refusal of one tenant."""
FORWARD_STREAMED = "forward_streamed"
"""Key in the decision metadata (:data:`contracts.epp.DECISION_NS`, value ``"1"``) of a request forwarded to
a peer cluster streamed: only then is its time to first byte the peer's answer time (a non-streamed
answer's first byte is its last), which peer health judges ``slow`` on."""
PEER_IDENTITY_PREFIX = "spiffe://kvgate.local/federation-"
"""What every cluster's federation identity starts with (the URI SAN the federation listener requires)."""
FORWARD_HOST = "x-kvgate-forward-host"
"""Request header the processor sets when it forwards: the peer's ingress ``host:port`` (for the
forwarding route's ``Host``/SNI; the destination itself is the ``envoy.lb`` pick)."""


MAX_REPORT_BYTES = 4 * 1024 * 1024
"""Largest report sent or accepted (4 MiB): a real one is a few hundred KiB (at most 65,536 noted digests
at 16 bits each, each model's filter at least 64 bytes), so this bounds what a peer can make the
receiver decode on its event loop."""
MAX_REPORT_MODELS = 4096
"""Most model summaries in one report."""


class FederationWireError(ValueError):
    """A message that does not decode or breaks the contract."""


class Hello(msgspec.Struct, frozen=True):
    """The subscriber's cluster name (for logs and metrics; authentication is the mTLS identity)."""

    cluster: str


class ModelSummary(msgspec.Struct, array_like=True, frozen=True):
    """The prefixes one cluster's fleet holds for ``model``: a Bloom filter of ``bits`` (``len(bits) x 8``
    bits, a power of two) with ``hashes`` probes over ``entries`` chain digests at depths ``2^j`` blocks
    of ``block_size`` tokens. ``queue_wait_s``: the predicted wait before a new request's prefill starts
    at the least-waiting endpoint (seconds); ``endpoints``: routable endpoints of the model."""

    model: str
    block_size: int
    hashes: int
    entries: int
    bits: bytes
    queue_wait_s: float
    endpoints: int


class Report(msgspec.Struct, frozen=True):
    """One refresh: ``cluster`` sent it at wall time ``sent_at`` (seconds since the epoch); the receiver
    drops it ``ttl_s`` after it arrived."""

    cluster: str
    sent_at: float
    ttl_s: float
    models: list[ModelSummary] = msgspec.field(default_factory=list)


_encoder = msgspec.msgpack.Encoder()
_hello = msgspec.msgpack.Decoder(Hello)
_report = msgspec.msgpack.Decoder(Report)


def encode(message: Hello | Report) -> bytes:
    return _encoder.encode(message)


def decode_hello(data: bytes) -> Hello:
    try:
        return _hello.decode(data)
    except MSGPACK_ERRORS as exc:
        raise FederationWireError(f"bad hello: {exc}") from exc


def decode_report(data: bytes) -> Report:
    """A :class:`Report` within :data:`MAX_REPORT_BYTES` and :data:`MAX_REPORT_MODELS` whose values are
    finite and summaries well formed (bit array a power of two, 1-32 probes, positive block size and TTL,
    a queue wait >= 0, endpoints >= 0, one summary per model); else :class:`FederationWireError`."""
    if len(data) > MAX_REPORT_BYTES:
        raise FederationWireError(f"report of {len(data)} bytes, over {MAX_REPORT_BYTES}")
    try:
        report = _report.decode(data)
    except MSGPACK_ERRORS as exc:
        raise FederationWireError(f"bad report: {exc}") from exc
    if not (math.isfinite(report.ttl_s) and report.ttl_s > 0):
        raise FederationWireError("report ttl_s must be finite and > 0")
    if not math.isfinite(report.sent_at):
        raise FederationWireError("report sent_at must be finite")
    if len(report.models) > MAX_REPORT_MODELS:
        raise FederationWireError(f"report of {len(report.models)} models, over {MAX_REPORT_MODELS}")
    seen: set[str] = set()
    for s in report.models:
        size = len(s.bits)
        if (
            size == 0
            or size & (size - 1)
            or not 1 <= s.hashes <= 32
            or s.block_size < 1
            or s.entries < 0
            or s.endpoints < 0
            or not (math.isfinite(s.queue_wait_s) and s.queue_wait_s >= 0)
            or s.model in seen
        ):
            raise FederationWireError(f"bad summary for model {s.model[:64]!r}")
        seen.add(s.model)
    return report
