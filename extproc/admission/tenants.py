"""Tenants: who a caller is billed and limited as, which models they may use, and their limits.

A tenant is the unit of scope and quota. The same schema is read from the gateway config's
``[[tenants]]`` tables and from etcd ``tenants/<id>`` values (parsed by
:func:`extproc.admission.config.parse_tenant`, which validates every value on read; the etcd overlay is
:class:`extproc.admission.shared.TenantDirectory`). Example (TOML)::

    [[tenants]]
    id = "acme"
    models = ["SmolLM2-*", "llama-3.1-8b"]      # fnmatch globs, case-sensitive
    priority = 1                                 # higher = more important; negative: sheddable
    objectives = ["interactive", "batch-*"]      # objective names it may use (globs; default ["*"])
    match = { claims = { tenant = "acme" }, groups = ["acme-engineers"] }
    rate = { requests_per_s = 5, burst = 10 }    # enforced by Envoy local_ratelimit
    tokens = { per_minute = 20000 }              # prompt + completion, enforced by the ext_proc
    kv_isolation = true                          # its own KV cache (default: [auth] kv_isolation)

Matching a verified JWT: a tenant matches when ANY of its rules holds: one of the listed claims has
one of the listed values (a list-valued claim matches when it contains one), or the groups claim
contains one of the listed groups. Tenants are tried in configuration order; the first match wins.
A tenant without ``match`` rules is reachable only through API keys. Pure: no IO.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

#: Tenant ids are used as an HTTP header value, an Envoy rate-limit descriptor and an etcd key.
TENANT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True, slots=True)
class RequestRate:
    """Request-rate limit: ``requests_per_s`` sustained, ``burst`` requests admitted at once."""

    requests_per_s: float
    burst: int


@dataclass(frozen=True, slots=True)
class TokenLimit:
    """Token budget: ``per_minute`` tokens (prompt + completion) sustained; ``burst`` is the bucket
    size in tokens (what an idle tenant may spend at once; defaults to one minute's worth)."""

    per_minute: int
    burst: int

    @property
    def per_s(self) -> float:
        return self.per_minute / 60.0


@dataclass(frozen=True, slots=True)
class TenantMatch:
    """Rules mapping a verified identity to a tenant: ``claims`` (claim name -> accepted values) and
    ``groups`` (accepted members of the configured groups claim). Any single rule matching suffices."""

    claims: tuple[tuple[str, frozenset[str]], ...] = ()
    groups: frozenset[str] = frozenset()

    @property
    def empty(self) -> bool:
        return not self.claims and not self.groups

    def matches(self, claims: Mapping[str, object], groups_claim: str) -> bool:
        for name, accepted in self.claims:
            if _values(claims.get(name)) & accepted:
                return True
        return bool(self.groups) and bool(_values(claims.get(groups_claim)) & self.groups)


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant. ``models``: globs of the model names it may request (after any model rewrite).
    ``priority``: higher is more important, negative is sheddable (flow control's band for requests
    that name no objective). ``rate``/``tokens``: ``None`` means unlimited. ``objectives``: globs of the
    objective names (:mod:`extproc.flow.policy`) its requests may name (empty: none)."""

    id: str
    models: tuple[str, ...]
    match: TenantMatch = field(default_factory=TenantMatch)
    priority: int = 0
    rate: RequestRate | None = None
    tokens: TokenLimit | None = None
    objectives: tuple[str, ...] = ("*",)
    #: Its own KV cache, unshared with other tenants (``None``: ``[auth] kv_isolation`` decides).
    kv_isolation: bool | None = None

    def allows(self, model: str) -> bool:
        """Whether ``model`` is within this tenant's scope."""
        return any(fnmatchcase(model, pattern) for pattern in self.models)

    def allows_objective(self, name: str) -> bool:
        """Whether this tenant's requests may name objective ``name`` (fnmatch globs, case-sensitive)."""
        return any(fnmatchcase(name, pattern) for pattern in self.objectives)


class Tenants:
    """The configured tenants, in order, by id and by identity."""

    def __init__(self, tenants: Sequence[Tenant] = ()) -> None:
        self._ordered = tuple(tenants)
        self._by_id = {t.id: t for t in self._ordered}
        if len(self._by_id) != len(self._ordered):
            raise ValueError("duplicate tenant id")

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self._ordered)

    def __len__(self) -> int:
        return len(self._ordered)

    def get(self, tenant_id: str) -> Tenant | None:
        return self._by_id.get(tenant_id)

    def for_claims(self, claims: Mapping[str, object], groups_claim: str) -> Tenant | None:
        """The first tenant whose ``match`` accepts these verified claims, or ``None``."""
        for tenant in self._ordered:
            if tenant.match.matches(claims, groups_claim):
                return tenant
        return None


def _values(claim: object) -> frozenset[str]:
    """A claim's values as strings: a scalar is one value, a list each of its scalar members."""
    if isinstance(claim, str):
        return frozenset((claim,))
    if isinstance(claim, bool) or claim is None:
        return frozenset()
    if isinstance(claim, int | float):
        return frozenset((_number(claim),))
    if isinstance(claim, list | tuple):
        out = set()
        for item in claim:
            if isinstance(item, str):
                out.add(item)
            elif isinstance(item, int | float) and not isinstance(item, bool):
                out.add(_number(item))
        return frozenset(out)
    return frozenset()


def _number(value: float) -> str:
    # Protobuf Struct (Envoy's metadata) carries every JSON number as a double: 7 arrives as 7.0.
    return str(int(value)) if float(value).is_integer() else str(value)
