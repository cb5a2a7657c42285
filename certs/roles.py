"""Who may call whom: the callers each internal TLS server accepts, by the role in their identity URI.

Every kvgate leaf carries ``spiffe://kvgate.local/<name>`` (:func:`certs.authority.identity_uri`), with
``<name>`` = ``<role>`` or ``<role>-<suffix>``. A server that requires a client certificate from the dev
CA also checks, on every connection or request, that the certificate names a role allowed to call it;
chaining to the CA alone proves only that the caller is *some* kvgate service. API client certificates
come from their own CA, which no internal hop trusts, so they fail before this check.

==================  =============================================  ===================================
hop (key)           server                                         caller roles
==================  =============================================  ===================================
``engine``          an engine's OpenAI API and ``/metrics``        envoy-edge (requests), extproc
                                                                   (metrics scraper), agent (health
                                                                   checks, supervision)
``feed``            index-event feeds (gRPC Subscribe) of agents   extproc
                    and kvcached daemons (:mod:`runtime.feed`)
``agent-admin``     an agent's admin API, state-changing requests  extproc (slot restores), operator
                    (``POST /drain``, ``/slots/*``)                (``operator-NAME`` certificates)
``kvcached-peers``  kvcached's QUIC peer fetch server              kvcached (other nodes' daemons)
``kvcached-api``    kvcached's block API over TCP (gRPC; mTLS)     agent, operator (the local Unix
                                                                   socket, which agents use today,
                                                                   is guarded by its file mode)
``extproc``         the ext_proc gRPC port                         envoy-edge (the ext_proc itself
                                                                   reads ``[extproc]
                                                                   tls_allowed_peers``; the migration
                                                                   proxy presents envoy-edge too)
==================  =============================================  ===================================

The other direction, who may *serve* a hop, is :data:`SERVERS`: a client that dials a hop checks the
server's certificate names one of those roles, not only that it chains to the CA and matches the address
(Envoy: ``combined_validation_context``'s URI SAN matcher, ``kvgate/envoy/tls.py``; the migration proxy:
:func:`runtime.identity.check_server_role` at the handshake; kvcached's QUIC peer client,
:mod:`kvcached.peers`, after the handshake and before its first request). Only the hops some client checks
are listed.

Pure: no IO, no clock.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from certs.authority import TRUST_DOMAIN, role_of
from certs.errors import CertError

ENGINE = "engine"
FEED = "feed"
AGENT_ADMIN = "agent-admin"
KVCACHED_PEERS = "kvcached-peers"
KVCACHED_API = "kvcached-api"
EXTPROC = "extproc"

#: Hop -> the roles that may call it (table in the module docstring).
CALLERS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        ENGINE: frozenset({"envoy-edge", "extproc", "agent"}),
        FEED: frozenset({"extproc"}),
        AGENT_ADMIN: frozenset({"extproc", "operator"}),
        KVCACHED_PEERS: frozenset({"kvcached"}),
        KVCACHED_API: frozenset({"agent", "operator"}),
        EXTPROC: frozenset({"envoy-edge"}),
    }
)

#: Hop -> the roles that may serve it, for the clients that check the server's role (module docstring).
SERVERS: Mapping[str, frozenset[str]] = MappingProxyType(
    {ENGINE: frozenset({"engine"}), KVCACHED_PEERS: frozenset({"kvcached"})}
)

_PREFIX = f"spiffe://{TRUST_DOMAIN}/"
_NAME_CHARS = re.compile(r"[a-z0-9-]+")


def role_of_uri(uri: str) -> str | None:
    """The role named by identity URI ``uri`` (``spiffe://kvgate.local/engine-gpu3`` -> ``engine``);
    ``None`` for a URI of another scheme or trust domain, or whose path is not a service name."""
    if not uri.startswith(_PREFIX):
        return None
    name = uri[len(_PREFIX) :]
    if _NAME_CHARS.fullmatch(name) is None:
        return None
    try:
        return role_of(name)
    except CertError:
        return None


def permits(hop: str, peer_uris: Iterable[str]) -> bool:
    """Whether a peer whose certificate carries the URI SANs ``peer_uris`` may call ``hop`` (a key of
    :data:`CALLERS`; ``KeyError`` otherwise): true when one of them names an allowed role."""
    allowed = CALLERS[hop]
    return any(role_of_uri(uri) in allowed for uri in peer_uris)


def serves(hop: str, peer_uris: Iterable[str]) -> bool:
    """Whether a server whose certificate carries the URI SANs ``peer_uris`` may serve ``hop`` (a key of
    :data:`SERVERS`; ``KeyError`` otherwise): true when one of them names an allowed role."""
    allowed = SERVERS[hop]
    return any(role_of_uri(uri) in allowed for uri in peer_uris)
