"""Authentication and admission: who is calling, may they use this model, and is there budget left.

Two credentials reach the ext_proc:

* an OIDC JWT, verified by Envoy's ``jwt_authn`` filter (signature against the issuer's JWKS, issuer,
  audience, expiry). Envoy puts the verified claims into dynamic metadata
  ``envoy.filters.http.jwt_authn/jwt_payload`` and forwards that namespace to the ext_proc: clients
  cannot write dynamic metadata, so claims are never taken from a header. A token that failed leaves
  only its failure reason (``jwt_status``) behind;
* an API key (``Authorization: Bearer sk-kvg-...``), which ``jwt_authn`` lets through as "not a JWT"
  (``allow_missing_or_failed``) and :class:`Gate` looks up by hash.

Anything else is 401. The claims are taken only as ``jwt_authn`` writes them: the namespace holds
nothing but ``jwt_payload`` or ``jwt_status``, the payload is an object, and its ``iss`` and ``aud`` are
the configured issuer and one of the audiences; any other shape is refused (401 ``invalid_identity``),
never read. A client address that keeps failing is answered 429 before its credentials are looked at
(:mod:`extproc.admission.failures`). A verified identity that maps to no tenant is 403, as is a model
outside the tenant's scope; an exhausted token budget is 429 with ``Retry-After``. The request rate is
limited by Envoy (``local_ratelimit``), keyed by the tenant header the processor sets. Pure: ``now`` is
a parameter; the key lookup (one ``stat`` per API-key request) is injected.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Protocol

from extproc.admission.budget import TokenBudgets
from extproc.admission.failures import FailedAuth, FailedAuthLimit
from extproc.admission.keys import ApiKey, KeyFile, looks_like_key
from extproc.admission.tenants import Tenant, Tenants
from extproc.admission.usage import Usage
from extproc.errors import Forbidden, TooManyRequests, Unauthorized
from extproc.routing.request import POOLING_KINDS, Kind, ParsedRequest


class Settle(Enum):
    """How output tokens are charged: ``USAGE`` reads the engine's reported usage from the response
    body (the ext_proc then sees the response body of budgeted tenants); ``RESERVATION`` charges
    what was reserved at admission (``prompt + max_tokens``) and never reads response bodies."""

    USAGE = "usage"
    RESERVATION = "reservation"


@dataclass(frozen=True, slots=True)
class JwtConfig:
    """OIDC bearer tokens, verified by Envoy. ``issuer``: required ``iss``; ``audiences``: accepted
    ``aud`` values; the issuer's keys come from ``jwks_uri`` (fetched and cached by Envoy for
    ``jwks_cache_s`` seconds) or ``jwks_file`` (a local JWKS, for air-gapped sites).
    ``groups_claim``: the claim listing group memberships. ``clock_skew_s``: tolerance on exp/nbf."""

    issuer: str
    audiences: tuple[str, ...]
    jwks_uri: str | None = None
    jwks_file: str | None = None
    jwks_cache_s: float = 300.0
    groups_claim: str = "groups"
    clock_skew_s: int = 60


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """The ``[auth]`` section; its presence turns authentication on (absent: the gateway is open).

    ``api_keys_file``: the hashed key file (:mod:`extproc.admission.keys`). ``default_max_tokens``: output
    tokens reserved for a request that sets no ``max_tokens``. ``settle``: see :class:`Settle`.
    ``failed_auth``: how many failed attempts a client address may make (:mod:`~extproc.admission.failures`).
    ``usage_sync_s``: with ``[etcd]``, how often at most this replica publishes what it charged the token
    budgets, which replicas share (:mod:`extproc.admission.shared`).
    """

    jwt: JwtConfig | None = None
    api_keys_file: str | None = None
    default_max_tokens: int = 1024
    settle: Settle = Settle.USAGE
    failed_auth: FailedAuthLimit = field(default_factory=FailedAuthLimit)
    usage_sync_s: float = 0.25
    #: Each tenant's requests get a cache salt of their own (:mod:`extproc.admission.isolation`), unless the
    #: tenant's own ``kv_isolation`` says otherwise.
    kv_isolation: bool = False


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller. ``via``: ``jwt`` or ``api_key``; ``who``: the JWT ``sub`` or the API
    key's id (public identifiers, safe to log; never the credential)."""

    tenant: Tenant
    via: str
    who: str


@dataclass(slots=True)
class Ticket:
    """An admitted request's token reservation until it is settled. ``bounded``: the request set its
    own output limit, so the engine cannot exceed ``reserved``."""

    tenant: Tenant
    prompt: int
    reserved: int
    bounded: bool
    settled: bool = False
    charged: int | None = None


class KeyLookup(Protocol):
    def lookup(self, key: str) -> ApiKey | None: ...


class Gate:
    """Identifies callers and admits their requests against scope and token budget."""

    def __init__(
        self,
        config: AuthConfig,
        tenants: Tenants,
        keys: KeyLookup | None,
        budgets: TokenBudgets | None = None,
    ) -> None:
        self.config = config
        self.tenants = tenants
        self._keys = keys
        self.budgets = budgets or TokenBudgets()
        self.failures = FailedAuth(config.failed_auth)
        self._groups_claim = config.jwt.groups_claim if config.jwt else "groups"

    def set_tenants(self, tenants: Tenants) -> None:
        """Put a new tenant set in force from the next :meth:`identify` or :meth:`admit` on (a removed
        tenant's callers are refused as unknown, also those identified before; a request admitted before
        settles as admitted). Token buckets are kept by tenant id: a tenant whose limit did not change keeps
        its bucket's level, a changed limit keeps what was spent
        (:meth:`~extproc.admission.budget.TokenBucket.resize`)."""
        self.tenants = tenants

    def identify(
        self,
        authorization: str | None,
        claims: Mapping[str, object] | None,
        jwt_failure: str | None,
        *,
        address: str | None = None,
        now: float = 0.0,
    ) -> Principal:
        """The caller, from Envoy-verified JWT claims or an API key; raises 401/403, or 429 while the
        client ``address`` (as Envoy saw it; ``None``: unknown, not limited) is over its failed attempts."""
        retry_after_s = self.failures.retry_after_s(address, now)
        if retry_after_s is not None:
            raise TooManyRequests(
                f"Too many failed authentication attempts from your address; retry after {retry_after_s}s.",
                code="auth_attempts_exceeded",
                retry_after_s=retry_after_s,
            )
        try:
            return self._identify(authorization, claims, jwt_failure)
        except Unauthorized:
            self.failures.failed(address, now)
            raise

    def _identify(
        self, authorization: str | None, claims: Mapping[str, object] | None, jwt_failure: str | None
    ) -> Principal:
        if claims is not None:
            self._check_claims(claims)
            tenant = self.tenants.for_claims(claims, self._groups_claim)
            if tenant is None:
                raise Forbidden("No tenant is configured for this identity.", code="no_tenant")
            sub = claims.get("sub")
            return Principal(tenant, "jwt", sub if isinstance(sub, str) else "-")
        credential = _bearer(authorization)
        if credential is None:
            raise Unauthorized(
                "Missing credentials: send 'Authorization: Bearer <token or API key>'.",
                code="missing_credentials",
            )
        if looks_like_key(credential):
            record = self._keys.lookup(credential) if self._keys is not None else None
            if record is None:
                raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")
            tenant = self.tenants.get(record.tenant)
            if tenant is None:
                raise Forbidden("The API key's tenant is not configured.", code="no_tenant")
            return Principal(tenant, "api_key", record.id)
        reason = (jwt_failure or "not a valid token")[:120]
        raise Unauthorized(f"The bearer token was rejected: {reason}.", code="invalid_token")

    def _check_claims(self, claims: Mapping[str, object]) -> None:
        """401 unless the claims name the configured issuer and one of its audiences, as a payload
        jwt_authn verified for our provider must (claims of any other shape are never read)."""
        jwt = self.config.jwt
        aud = claims.get("aud")
        audiences = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
        if jwt is None or claims.get("iss") != jwt.issuer or not any(a in jwt.audiences for a in audiences):
            raise Unauthorized("The identity metadata is not a verified token's.", code="invalid_identity")

    def admit(self, principal: Principal, request: ParsedRequest, prompt_tokens: int, now: float) -> Ticket:
        """Check the model scope and reserve ``prompt + max output`` tokens; raises 403/429. The tenant is
        the one in force now (:meth:`set_tenants` may have changed it since :meth:`identify`): its scope and
        limit apply, and a tenant removed meanwhile is refused (403 ``no_tenant``)."""
        tenant = self.tenants.get(principal.tenant.id)
        if tenant is None:
            raise Forbidden("Your tenant is no longer configured.", code="no_tenant")
        if not tenant.allows(request.model):
            raise Forbidden(
                f"Your tenant may not use the model `{request.model[:200]}`.",
                code="model_not_allowed",
                param="model",
            )
        limit = max_output_tokens(request)
        output = limit if limit is not None else self.config.default_max_tokens
        # Never below the prompt: a negative limit (the parser refuses one; this holds without it) must
        # not turn a reservation into a refund.
        reserved = max(0, prompt_tokens) + max(0, output)
        refusal = self.budgets.reserve(tenant, reserved, now)
        if refusal is not None:
            if refusal.retry_after_s is None:
                raise TooManyRequests(
                    f"This request needs up to {refusal.needed} tokens; your tenant's budget holds at "
                    f"most {refusal.capacity}. Lower max_tokens or the prompt.",
                    code="request_too_large",
                )
            raise TooManyRequests(
                f"Token budget exceeded ({tenant.tokens.per_minute if tenant.tokens else 0} tokens per "
                f"minute); retry after {refusal.retry_after_s}s.",
                code="tokens_exceeded",
                retry_after_s=refusal.retry_after_s,
            )
        return Ticket(tenant, prompt_tokens, reserved, bounded=limit is not None)

    def wants_usage(self, ticket: Ticket) -> bool:
        """Whether the response body must be read to settle this ticket."""
        return self.config.settle is Settle.USAGE and ticket.tenant.tokens is not None

    def settle(self, ticket: Ticket, usage: Usage | None, now: float) -> int:
        """Charge what the request used (the reservation when unknown); returns the tokens charged."""
        if ticket.settled:
            return ticket.charged or 0
        actual = ticket.reserved
        if usage is not None:
            actual = (usage.prompt if usage.prompt is not None else ticket.prompt) + usage.completion
            if not usage.exact and ticket.bounded:
                actual = min(actual, ticket.reserved)
        return self._close(ticket, actual, now)

    def cancel(self, ticket: Ticket, now: float) -> None:
        """The request produced nothing (refused downstream, engine error): refund it all."""
        if not ticket.settled:
            self._close(ticket, 0, now)

    def _close(self, ticket: Ticket, actual: int, now: float) -> int:
        ticket.settled, ticket.charged = True, actual
        self.budgets.settle(ticket.tenant, ticket.reserved, actual, now)
        return actual


def max_output_tokens(request: ParsedRequest) -> int | None:
    """The request's own output limit in tokens, the one the engine uses (chat: ``max_completion_tokens``,
    else ``max_tokens``; completions: ``max_tokens`` only, as engines ignore ``max_completion_tokens``
    there; times ``n`` choices; the Responses API's ``max_output_tokens``; 0 for embeddings, score and
    rerank), or ``None`` when it sets none."""
    if request.kind in POOLING_KINDS:
        return 0
    body = request.body
    if request.kind is Kind.RESPONSES:
        found = body.get("max_output_tokens")
        return found if isinstance(found, int) and not isinstance(found, bool) else None
    limit = body.get("max_completion_tokens") if request.kind is Kind.CHAT else None
    if limit is None:
        limit = body.get("max_tokens")
    if not isinstance(limit, int) or isinstance(limit, bool):
        return None
    n = body.get("n")
    choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    return limit * choices


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, credential = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not credential.strip():
        return None
    return credential.strip()


def build_gate(config: AuthConfig | None, tenants: tuple[Tenant, ...]) -> Gate | None:
    """The gate for a gateway config, or ``None`` when authentication is off (no ``[auth]``)."""
    if config is None:
        return None
    keys = KeyFile(Path(config.api_keys_file)) if config.api_keys_file else None
    return Gate(config, Tenants(tenants), keys)
