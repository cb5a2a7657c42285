"""Federation links: the gateway config's ``[federation]`` section and etcd ``federation/<cluster>``
overrides, validated like the rest of the policy (a bad value is refused, the last good link stays).
Pure: no IO.

A link names a peer cluster: its Envoy ingress (``ingress``, where forwarded requests go, over mTLS), its
gateways' federation service (``service``, where summaries come from), the identity URI its gateways and
its Envoy present (``identity``: the only caller whose hop and tenant headers this cluster believes, and
the name the federation service's certificate must carry), the round trip (``rtt_ms``) and the egress
budget (``egress_requests_per_s``, ``egress_bytes_per_s``: what this cluster may forward to it), and, with
``[auth]``, whether the tenant it asserts on what it forwards here is believed (``trust_tenants``,
``tenants``, ``default_tenant``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from contracts.config import REQUIRED, Section, all_or_none, hostport
from contracts.errors import ConfigError
from extproc.admission.tenants import TENANT_ID

_CLUSTER = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
MAX_RTT_MS = 10_000.0
"""Longest round trip accepted: past it no prefill is worth forwarding."""


@dataclass(frozen=True, slots=True)
class Link:
    cluster: str
    ingress: str
    service: str
    identity: str
    rtt_ms: float
    egress_requests_per_s: float
    egress_bytes_per_s: float
    #: With ``[auth]``: requests this peer forwards are admitted as the tenant it asserts (``README.md``:
    #: tenants across clusters); off, they carry no credentials and are answered 401.
    trust_tenants: bool = False
    #: The asserted tenants believed (empty: any); another is refused 403 ``tenant_not_trusted``.
    tenants: tuple[str, ...] = ()
    #: The tenant an asserted tenant unknown here (or none asserted) is admitted as (``None``: 403).
    default_tenant: str | None = None


@dataclass(frozen=True, slots=True)
class FederationConfig:
    """``[federation]``: this cluster's name, its federation service and the policy of every link.

    ``refresh_s``: how often summaries are sent; ``ttl_s``: how long a received one counts;
    ``margin_s``: the saving a forward must win by; ``prefill_s_per_token``: prefill time per uncached
    prompt token (the saving's rate); ``min_blocks``: shortest peer lead worth forwarding for;
    ``down_base_s`` / ``down_max_s``: how long a failing peer is skipped (doubling); ``slow_s``: a
    forwarded request with no answer by then counts as a failure; ``forward_first_byte_s``: how long a
    non-streamed forwarded try waits for the peer's answer before the local pick serves the request
    (``0``: the model's ``request_s``; a streamed try is bounded by the model's ``first_byte_s``);
    ``hop_identity``: the identity URI this cluster's gateways and Envoy present to peers."""

    cluster: str
    listen: str = "127.0.0.1:0"
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    refresh_s: float = 0.5
    ttl_s: float = 3.0
    margin_s: float = 0.02
    prefill_s_per_token: float = 0.0002
    min_blocks: int = 4
    down_base_s: float = 1.0
    down_max_s: float = 30.0
    slow_s: float = 10.0
    forward_first_byte_s: float = 60.0
    links: tuple[Link, ...] = field(default_factory=tuple)


def _cluster_name(value: str, where: str) -> str:
    if _CLUSTER.fullmatch(value) is None:
        raise ConfigError(f"{where}: a cluster name of lowercase letters, digits and dashes, got {value!r}")
    return value


def parse_link(raw: object, where: str, name: str | None = None) -> Link:
    """One link table; ``name`` (the etcd key's last segment), when given, must match its ``cluster``
    (which may then be omitted)."""
    s = Section(raw, where)
    cluster = _cluster_name(s.string("cluster", name if name is not None else REQUIRED), f"{where}.cluster")
    if name is not None and cluster != name:
        raise ConfigError(f"{where}.cluster: must equal the key's name {name!r}, got {cluster!r}")
    identity = s.string("identity", REQUIRED)
    if not identity.startswith("spiffe://") or len(identity) <= len("spiffe://"):
        raise ConfigError(f"{where}.identity: a spiffe:// identity URI, got {identity!r}")
    link = Link(
        cluster=cluster,
        ingress=hostport(s.string("ingress", REQUIRED), f"{where}.ingress"),
        service=hostport(s.string("service", REQUIRED), f"{where}.service"),
        identity=identity,
        rtt_ms=s.number("rtt_ms", REQUIRED, minimum=0.0),
        egress_requests_per_s=s.number("egress_requests_per_s", REQUIRED, minimum=0.0),
        egress_bytes_per_s=s.number("egress_bytes_per_s", REQUIRED, minimum=0.0),
        trust_tenants=s.flag("trust_tenants", False),
        tenants=_tenant_ids(s.array("tenants", []), f"{where}.tenants"),
        default_tenant=s.string("default_tenant"),
    )
    s.done()
    if link.rtt_ms > MAX_RTT_MS:
        raise ConfigError(f"{where}.rtt_ms: must be <= {MAX_RTT_MS}, got {link.rtt_ms}")
    if link.default_tenant is not None:
        _tenant_ids([link.default_tenant], f"{where}.default_tenant")
    if (link.tenants or link.default_tenant is not None) and not link.trust_tenants:
        raise ConfigError(f"{where}: tenants and default_tenant need trust_tenants = true")
    return link


def _tenant_ids(raw: list[object], where: str) -> tuple[str, ...]:
    for value in raw:
        if not isinstance(value, str) or TENANT_ID.fullmatch(value) is None:
            raise ConfigError(
                f"{where}: tenant ids of 1-64 [A-Za-z0-9._-] starting alphanumeric, got {value!r}"
            )
    return tuple(str(v) for v in raw)


_D = FederationConfig(cluster="-")


def parse_federation(raw: object, where: str = "federation") -> FederationConfig:
    """Validate a ``[federation]`` table (unknown keys, bad names or addresses, a link to itself, two links
    to one cluster, ``ttl_s`` not above ``refresh_s``: :class:`ConfigError`)."""
    s = Section(raw, where)
    cluster = _cluster_name(s.string("cluster", REQUIRED), f"{where}.cluster")
    links = tuple(parse_link(r, f"{where}.links[{i}]") for i, r in enumerate(s.array("links", [])))
    config = FederationConfig(
        cluster=cluster,
        listen=hostport(s.string("listen", _D.listen), f"{where}.listen"),
        tls_cert=s.string("tls_cert"),
        tls_key=s.string("tls_key"),
        tls_ca=s.string("tls_ca"),
        refresh_s=s.number("refresh_s", _D.refresh_s, minimum=0.01),
        ttl_s=s.number("ttl_s", _D.ttl_s, minimum=0.01),
        margin_s=s.number("margin_s", _D.margin_s, minimum=0.0),
        prefill_s_per_token=s.number("prefill_s_per_token", _D.prefill_s_per_token, minimum=0.0),
        min_blocks=s.integer("min_blocks", _D.min_blocks, minimum=1),
        down_base_s=s.number("down_base_s", _D.down_base_s, minimum=0.01),
        down_max_s=s.number("down_max_s", _D.down_max_s, minimum=0.01),
        slow_s=s.number("slow_s", _D.slow_s, minimum=0.01),
        forward_first_byte_s=s.number("forward_first_byte_s", _D.forward_first_byte_s, minimum=0.0),
        links=links,
    )
    s.done()
    all_or_none(where, tls_cert=config.tls_cert, tls_key=config.tls_key, tls_ca=config.tls_ca)
    if config.ttl_s <= config.refresh_s:
        raise ConfigError(f"{where}.ttl_s: must be > refresh_s ({config.refresh_s}), got {config.ttl_s}")
    if config.down_base_s > config.down_max_s:
        raise ConfigError(f"{where}.down_base_s: must be <= down_max_s ({config.down_max_s})")
    names = [link.cluster for link in links]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}.links: two links to one cluster")
    if cluster in names:
        raise ConfigError(f"{where}.links: a link to this cluster itself ({cluster!r})")
    return config


class LinkTable:
    """The links in force: the file's, overlaid by etcd ``federation/<cluster>`` values.

    :meth:`put` validates one etcd value; a bad one is refused (the error is returned, to be logged) and
    the link in force stays. :meth:`delete` drops the override (the file's link, if any, is back).
    """

    def __init__(self, config: FederationConfig) -> None:
        self.cluster = config.cluster
        self._file: dict[str, Link] = {link.cluster: link for link in config.links}
        self._etcd: dict[str, Link] = {}
        self.version = 0

    def put(self, name: str, value: bytes) -> str | None:
        """Apply etcd ``federation/<name>`` = ``value`` (JSON); the refusal's reason, or ``None``."""
        where = f"federation/{name}"
        try:
            raw = json.loads(value)
            link = parse_link(raw, where, name)
        except (ValueError, ConfigError) as exc:
            return str(exc) if isinstance(exc, ConfigError) else f"{where}: not JSON"
        if link.cluster == self.cluster:
            return f"{where}: a link to this cluster itself"
        if self._etcd.get(name) != link:
            self._etcd[name] = link
            self.version += 1
        return None

    def delete(self, name: str) -> None:
        if self._etcd.pop(name, None) is not None:
            self.version += 1

    def links(self) -> Mapping[str, Link]:
        merged = dict(self._file)
        merged.update(self._etcd)
        return merged

    def get(self, cluster: str) -> Link | None:
        return self._etcd.get(cluster) or self._file.get(cluster)

    def by_identity(self, identity: str) -> Link | None:
        """The link whose peer presents ``identity``."""
        for link in self.links().values():
            if link.identity == identity:
                return link
        return None
