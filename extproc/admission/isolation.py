"""Tenant KV isolation: a cache salt per tenant, so tenants never share KV blocks. Pure.

A prefix cache shared across tenants leaks through timing: a request that hits another tenant's cached
prompt answers its first token sooner, which tells the sender that someone sent that prefix. vLLM's
``cache_salt`` folds a per-request secret into the first block's hash, so requests with different salts
never share a block; kvgate's chain seed takes the same salt (:func:`contracts.digest.chain_seed`), so
the router's digests follow it and KV-aware routing keeps working within a tenant.

With isolation on for a tenant, the gateway replaces every request's ``cache_salt`` with

    salt(tenant, client) = "kvgate-" + hex(BLAKE2b-128(person="kvgate-kv-iso", tenant id + NUL + client salt))

where ``client`` is the request's own ``cache_salt`` ("" when absent). So a client's own salt still
separates its requests within its tenant, and no client can reach another tenant's salt: the tenant id it
is mixed with comes from its verified credentials, never from the request. The formula has no secret, so a
client of a tenant *without* isolation could send ``tenant_salt("acme", "")`` as its own ``cache_salt`` and
share acme's blocks: with ``[auth]``, a client salt that starts with :data:`PREFIX` is refused (400
``reserved_cache_salt``) unless the gateway replaces it anyway (its tenant is isolated). The result is
39 characters of ``[a-z0-9-]``, within vLLM's rules for the field (1-128 characters, none of
``@ / \\`` or NUL).

Where the engine does not honour ``cache_salt`` (llama.cpp, engines without it) the routing still
follows the salt, but the engine's cache is shared: isolation is the engine's to enforce.
"""

from __future__ import annotations

import hashlib
import re

from extproc.admission.gate import AuthConfig
from extproc.admission.tenants import Tenant

PREFIX = "kvgate-"


def isolates(auth: AuthConfig, tenant: Tenant) -> bool:
    """Whether ``tenant``'s requests get a salt of their own: the tenant's ``kv_isolation``, else the
    ``[auth]`` default."""
    return auth.kv_isolation if tenant.kv_isolation is None else tenant.kv_isolation


def tenant_salt(tenant_id: str, client_salt: str | None) -> str:
    """The cache salt of ``tenant_id``'s request whose own ``cache_salt`` is ``client_salt``."""
    h = hashlib.blake2b(digest_size=16, person=b"kvgate-kv-iso")
    h.update(tenant_id.encode())
    h.update(b"\x00")
    h.update((client_salt or "").encode())
    return PREFIX + h.hexdigest()


_TENANT_SALT = re.compile(re.escape(PREFIX) + "[0-9a-f]{32}")


def is_tenant_salt(salt: str | None) -> bool:
    """Whether ``salt`` has the form of a :func:`tenant_salt` (what a forwarding cluster's flag claims)."""
    return salt is not None and _TENANT_SALT.fullmatch(salt) is not None


def reserved(client_salt: str | None) -> bool:
    """Whether a client's ``cache_salt`` is in the gateway's namespace (:data:`PREFIX`): refused from a
    tenant the gateway does not salt, since it could name an isolated tenant's salt."""
    return client_salt is not None and client_salt.startswith(PREFIX)
