"""What the stream processor asks of federation for one request (sans IO): who sent it, whether it goes to
a peer, and, for a request served here, noting its prefix for this cluster's summary.

The processor (:mod:`extproc.processor`) calls :meth:`Forwarder.inbound` with the peer identity Envoy
reports for the downstream connection (the request attribute :data:`PEER_ATTRIBUTE`, never a header),
:meth:`Forwarder.principal` (with ``[auth]``) for a request a linked cluster forwarded,
:meth:`Forwarder.may_forward` before it tokenizes the prompt (whether to hash its whole window there),
:meth:`Forwarder.worth_hashing` before it hashes a lazy prompt's whole window, :meth:`Forwarder.route`
after its local decision, and :meth:`Forwarder.note` once a request served here is recorded.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from contracts.digest import Digest
from contracts.federation import PEER_HEADER
from extproc.admission.gate import Principal
from extproc.admission.tenants import Tenants
from extproc.errors import GatewayError
from extproc.federation.peers import Federation
from extproc.federation.summary import SummaryBuilder
from extproc.federation.tenancy import asserted_principal
from extproc.federation.trust import Inbound, inbound

log = logging.getLogger(__name__)

PEER_ATTRIBUTE = "connection.uri_san_peer_certificate"
"""The ext_proc request attribute (Envoy's CEL name) with the downstream client certificate's URI SAN:
on the federation listener, the forwarding cluster's verified identity."""


@dataclass(frozen=True, slots=True)
class Forward:
    """Send the request to ``peer``'s ingress ``ingress`` (``ip:port``, first in the destination list,
    the local pick after it as the fallback), with the hop header naming this cluster (``hop``)."""

    peer: str
    ingress: str
    hop: str
    lead: int


class Forwarder:
    """The processor's view of the gateway's :class:`Federation` and :class:`SummaryBuilder`.
    ``decisions`` counts verdict reasons, ``forwards`` forwards per peer and ``admissions`` the tenants
    peers asserted here (for metrics)."""

    def __init__(self, federation: Federation, builder: SummaryBuilder) -> None:
        self.federation = federation
        self.builder = builder
        self.decisions: Counter[str] = Counter()
        self.forwards: Counter[str] = Counter()
        #: With ``[auth]``: requests linked peers forwarded here, by (peer, ``admitted`` or refusal code).
        self.admissions: Counter[tuple[str, str]] = Counter()

    def inbound(self, peer_uri: str | None, headers: Mapping[str, str]) -> Inbound:
        """Who sent the request: a linked cluster only when ``peer_uri`` (from Envoy's attribute) is its
        identity; the hop and tenant headers then count, else only the hop header does (never forwarded
        again). A federation identity no link names is marked ``unlinked`` (the processor refuses it)."""
        if not peer_uri:
            return inbound({k: v for k, v in headers.items() if k != PEER_HEADER}, self.federation.links)
        return inbound({**headers, PEER_HEADER: peer_uri}, self.federation.links)

    def principal(self, came: Inbound, tenants: Tenants) -> Principal:
        """With ``[auth]``: whom a request forwarded by a linked cluster is admitted as (raises 401/403;
        :mod:`extproc.federation.tenancy`)."""
        link = self.federation.links.get(came.forwarded_by) if came.forwarded_by else None
        peer = came.forwarded_by or "-"
        try:
            principal = asserted_principal(came, link, tenants)
        except GatewayError as exc:
            self.admissions[(peer, exc.code or exc.error_type)] += 1
            raise
        self.admissions[(peer, "admitted")] += 1
        return principal

    def may_forward(self, came: Inbound) -> bool:
        """Whether a request from ``came`` could go to a peer at all, known before its prompt is read: it
        is no final hop and some link is in force (what :meth:`worth_hashing` checks first, uncounted).
        The processor then hashes a lazy prompt's whole window where it tokenizes the prompt (in a worker
        thread for a large body), not on the event loop after the decision."""
        return not came.final and bool(self.federation.links.links())

    def worth_hashing(self, came: Inbound, prompt_blocks: int, local_lead: int, block_size: int) -> bool:
        """Whether a forward is possible at all (else the caller skips the hashing and :meth:`route`)."""
        if came.final:
            self.decisions["hop"] += 1
            return False
        if not self.federation.links.links():
            self.decisions["no_peer"] += 1
            return False
        if not self.federation.worth_hashing(prompt_blocks, local_lead, block_size):
            self.decisions["short"] += 1
            return False
        return True

    def route(
        self,
        model: str,
        digests: Sequence[Digest],
        local_lead: int,
        block_size: int,
        body_bytes: int,
        came: Inbound,
        now: float,
        allowed: frozenset[str] | None = None,
    ) -> Forward | None:
        """Where a decided request goes instead of its local pick (``None``: it stays); ``allowed``: the
        request's EPP subset hint (only a peer ingress it lists may be picked)."""
        verdict = self.federation.decide(
            model, digests, local_lead, block_size, body_bytes, came, now, allowed
        )
        self.decisions[verdict.reason] += 1
        if verdict.peer is None:
            return None
        self.forwards[verdict.peer.cluster] += 1
        return Forward(verdict.peer.cluster, verdict.peer.ingress, self.federation.cluster, verdict.lead)

    def note(self, model: str, digests: Sequence[Digest]) -> None:
        """A request served in this cluster: its prefix goes into the next summary."""
        self.builder.note(model, digests)
