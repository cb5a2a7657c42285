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
from contracts.federation import (
    CLIENT_SALT_HEADER,
    HOP_HEADER,
    PEER_HEADER,
    PEER_IDENTITY_PREFIX,
    SALTED_HEADER,
)
from extproc.federation.links import LinkTable

FEDERATION_HEADERS = (HOP_HEADER, PEER_HEADER)
"""Headers the processor always removes from the request it sends upstream (it sets its own)."""


@dataclass(frozen=True, slots=True)
class Inbound:
    """``forwarded_by``: the linked cluster that forwarded the request (``None``: a client's request);
    ``tenant``: the tenant that cluster asserts (``None``: none, or not believed); ``salted``: that
    cluster gave the body its tenant's cache salt (kept as is here); ``client_salt``: the client's own salt
    that cluster mixed with the tenant (``None``: none, or not readable); ``hop``: the request carries the hop
    header (only a federation listener lets it through); ``unlinked``: the verified federation identity
    (``spiffe://kvgate.local/federation-...``) that no link in force names (a link removed or changed:
    refused, 401 ``federation_untrusted``)."""

    forwarded_by: str | None = None
    tenant: str | None = None
    salted: bool = False
    client_salt: str | None = None
    hop: bool = False
    unlinked: str | None = None

    @property
    def forwarded(self) -> bool:
        """Forwarded by a linked cluster: its hop, tenant and salted flag count."""
        return self.forwarded_by is not None

    @property
    def final(self) -> bool:
        """Never forwarded again: forwarded by a linked cluster, carrying the hop header, or from a
        federation identity no link names."""
        return self.forwarded or self.hop or self.unlinked is not None

    @property
    def federated(self) -> bool:
        """Came from another cluster (linked or not): a refusal says so (``REFUSED_HEADER``), so the
        forwarding cluster's Envoy falls back to its local pick."""
        return self.forwarded or self.unlinked is not None


CLIENT = Inbound()


def inbound(headers: Mapping[str, str], links: LinkTable) -> Inbound:
    """Classify a request by its headers (lower-case names). A request from a linked identity counts as
    forwarded whether or not it carries the hop header; a hop header without that identity is believed
    for nothing but this: the request is not forwarded again."""
    peer = headers.get(PEER_HEADER)
    link = links.by_identity(peer) if peer else None
    if link is None:
        hop = HOP_HEADER in headers
        if peer and peer.startswith(PEER_IDENTITY_PREFIX):
            return Inbound(hop=hop, unlinked=peer)
        return Inbound(hop=True) if hop else CLIENT
    tenant = headers.get(TENANT_HEADER) or None
    return Inbound(
        forwarded_by=link.cluster,
        tenant=tenant,
        salted=headers.get(SALTED_HEADER) == "1",
        client_salt=_client_salt(headers.get(CLIENT_SALT_HEADER)),
    )


def _client_salt(value: str | None) -> str | None:
    """The client salt a forwarding cluster sent (hex of its UTF-8); ``None``: none, or not hex UTF-8 (the
    body's salt then matches no tenant salt unless the client had none)."""
    if not value:
        return None
    try:
        return bytes.fromhex(value).decode()
    except ValueError:  # (UnicodeDecodeError is one)
        return None
