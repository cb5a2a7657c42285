"""Who forwarded a request, and which of its federation headers count (``README.md``: trust). Pure.

The receiving Envoy's federation listener writes :data:`~contracts.federation.PEER_HEADER` from the
verified client certificate (overwriting anything a client sent); the public listener strips it and
:data:`~contracts.federation.HOP_HEADER`. Still, the processor believes the hop and tenant headers only
when the peer header names a linked cluster's identity: any other value, or none, makes them a client's
forgery, which is ignored (and removed before the request goes upstream).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from contracts.epp import TENANT_HEADER
from contracts.federation import HOP_HEADER, PEER_HEADER, SALTED_HEADER
from extproc.federation.links import LinkTable

FEDERATION_HEADERS = (HOP_HEADER, PEER_HEADER)
"""Headers the processor always removes from the request it sends upstream (it sets its own)."""


@dataclass(frozen=True, slots=True)
class Inbound:
    """``forwarded_by``: the linked cluster that forwarded the request (``None``: a client's request);
    ``tenant``: the tenant that cluster asserts (``None``: none, or not believed); ``salted``: that
    cluster gave the body its tenant's cache salt (kept as is here)."""

    forwarded_by: str | None = None
    tenant: str | None = None
    salted: bool = False

    @property
    def forwarded(self) -> bool:
        """A forwarded request is never forwarded again."""
        return self.forwarded_by is not None


CLIENT = Inbound()


def inbound(headers: Mapping[str, str], links: LinkTable) -> Inbound:
    """Classify a request by its headers (lower-case names). A request from a linked identity counts as
    forwarded whether or not it carries the hop header; a hop header without that identity is ignored."""
    peer = headers.get(PEER_HEADER)
    link = links.by_identity(peer) if peer else None
    if link is None:
        return CLIENT
    tenant = headers.get(TENANT_HEADER) or None
    return Inbound(forwarded_by=link.cluster, tenant=tenant, salted=headers.get(SALTED_HEADER) == "1")
