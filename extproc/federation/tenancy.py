"""Tenants across clusters: whom a request forwarded by a linked cluster is admitted as (``README.md``:
tenants across clusters). Pure.

The forwarding (home) cluster authenticated the client, admitted it against its own policy and sends the
request on without the client's credentials, asserting the tenant (:data:`contracts.epp.TENANT_HEADER`).
Here (the peer) the assertion counts only on a request whose mTLS identity is a linked cluster's
(:func:`extproc.federation.trust.inbound`), and only when that link says ``trust_tenants``:

* the link does not trust tenants: 401 ``federation_untrusted`` (the request has no credentials);
* the asserted tenant is outside the link's ``tenants`` allow-list (when set): 403 ``tenant_not_trusted``;
* the asserted tenant is one of this cluster's tenants: admitted as that tenant, under this cluster's
  policy for it (models, budget, rate, priority, KV isolation);
* no tenant asserted, or one unknown here: the link's ``default_tenant`` when set (and known here), else
  403 ``no_tenant``.
"""

from __future__ import annotations

from contracts.federation import UNTRUSTED
from extproc.admission.gate import Principal
from extproc.admission.tenants import Tenants
from extproc.errors import Forbidden, Unauthorized
from extproc.federation.links import Link
from extproc.federation.trust import Inbound

VIA = "federation"
""":attr:`Principal.via` of a tenant asserted by a linked cluster (``who`` is that cluster's name)."""


def asserted_principal(came: Inbound, link: Link | None, tenants: Tenants) -> Principal:
    """The principal of a request ``came`` from the linked cluster of ``link`` (``None``: the link was
    removed meanwhile), under this cluster's ``tenants``; raises 401/403 as above."""
    cluster = came.forwarded_by or "-"
    if link is None or not link.trust_tenants:
        raise Unauthorized(
            f"This cluster does not admit tenants asserted by cluster '{cluster}'.",
            code=UNTRUSTED,
        )
    asked = came.tenant
    if asked is not None and link.tenants and asked not in link.tenants:
        raise Forbidden(
            f"This cluster does not admit that tenant from cluster '{cluster}'.", code="tenant_not_trusted"
        )
    tenant = tenants.get(asked) if asked is not None else None
    if tenant is None and link.default_tenant is not None:
        tenant = tenants.get(link.default_tenant)
    if tenant is None:
        raise Forbidden("No tenant is configured here for the asserted tenant.", code="no_tenant")
    return Principal(tenant, VIA, cluster)
