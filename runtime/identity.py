"""Who the TLS peer is: identity URIs from a peer certificate, and a gRPC interceptor that refuses calls
from identities not allowed (:mod:`certs.roles` holds the who-may-call-whom matrix).

A certificate that chains to the dev CA proves only that its holder is *some* kvgate service; the servers
that require client certificates also check the role in its ``spiffe://kvgate.local/<name>`` URI SAN:
gRPC servers with :class:`PeerCheck`, aiohttp servers with :func:`peercert_uris` on the transport's
``peercert``, the QUIC peer server with :func:`certificate_uris` on the verified certificate. A Python
client that must know whom it reached (the migration proxy towards engines) installs
:func:`check_server_role` on its ``ssl.SSLContext``: the server's role is checked at the handshake,
before a byte of the request is sent.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from typing import Any

import grpc
from cryptography import x509

from certs.roles import (
    AGENT_ADMIN,
    CALLERS,
    ENGINE,
    FEED,
    KVCACHED_API,
    KVCACHED_PEERS,
    SERVERS,
    permits,
    role_of_uri,
    serves,
)

__all__ = [
    "AGENT_ADMIN",
    "ENGINE",
    "FEED",
    "KVCACHED_API",
    "KVCACHED_PEERS",
    "PeerCheck",
    "certificate_uris",
    "check_server_role",
    "hop_callers",
    "peercert_uris",
    "permits",
    "serves",
]


def hop_callers(hop: str) -> Callable[[Collection[str]], bool]:
    """The predicate "these peer URIs may call ``hop``" (:func:`certs.roles.permits`; ``KeyError`` for a
    hop :data:`certs.roles.CALLERS` does not name)."""
    if hop not in CALLERS:  # fail here, not on the first call
        raise KeyError(hop)
    return lambda uris: permits(hop, uris)


def peercert_uris(peercert: Mapping[str, Any] | None) -> list[str]:
    """The URI SANs of a peer certificate as :meth:`ssl.SSLSocket.getpeercert` decodes it (what an
    asyncio transport's ``get_extra_info("peercert")`` returns); none without a certificate."""
    if not peercert:
        return []
    return [value for kind, value in peercert.get("subjectAltName", ()) if kind == "URI"]


def check_server_role(context: ssl.SSLContext, hop: str) -> ssl.SSLContext:
    """``context`` (returned, changed in place) refusing, at the end of each client handshake, a server
    whose certificate names no role that may serve ``hop`` (:data:`certs.roles.SERVERS`; ``KeyError``
    for a hop it does not name). The refusal is an ``ssl.SSLCertVerificationError`` naming the roles
    found and the one expected, raised where the chain's own verification errors are, so callers treat
    it as any failed handshake (aiohttp: ``ClientConnectorCertificateError``); nothing was sent yet.
    Works with asyncio's and uvloop's TLS, which both drive ``SSLContext.sslobject_class``."""
    expected = SERVERS[hop]

    class _RoleChecked(ssl.SSLObject):
        def do_handshake(self) -> None:
            super().do_handshake()  # SSLWantRead/WriteError until it completes: no check before
            uris = peercert_uris(self.getpeercert())
            if not serves(hop, uris):
                found = sorted({role_of_uri(u) or "?" for u in uris}) or ["none"]
                raise ssl.SSLCertVerificationError(
                    f"the server's certificate names role {'/'.join(found)}, "
                    f"not one that serves {hop} ({', '.join(sorted(expected))})"
                )

    context.sslobject_class = _RoleChecked
    return context


def certificate_uris(cert: x509.Certificate) -> list[str]:
    """The URI SANs of ``cert``; none without a subject alternative name extension."""
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return list(names.get_values_for_type(x509.UniformResourceIdentifier))


class PeerCheck(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call but gRPC health (PERMISSION_DENIED, before a message is read or a response
    sent) unless the TLS peer's identity URIs (gRPC's ``peer_uri`` property) pass ``allowed``: a set of
    exact URIs, or a predicate over the peer's URIs (e.g. :func:`hop_callers`). ``service`` names the
    server in the refusal's message. Streaming handlers must be async generators."""

    def __init__(
        self, allowed: frozenset[str] | Callable[[Collection[str]], bool], service: str = "this service"
    ) -> None:
        if isinstance(allowed, frozenset):
            exact = allowed
            self._allowed: Callable[[Collection[str]], bool] = lambda uris: not exact.isdisjoint(uris)
        else:
            self._allowed = allowed
        self._service = service

    def permits(self, context: grpc.aio.ServicerContext) -> bool:
        """Whether the peer of ``context`` may call."""
        uris = context.auth_context().get("peer_uri", [])
        return self._allowed([uri.decode(errors="replace") for uri in uris])

    async def _require(self, context: grpc.aio.ServicerContext) -> None:
        if not self.permits(context):
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"this identity may not call {self._service}"
            )

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        codec = handler.request_deserializer, handler.response_serializer
        if handler.stream_stream is not None or handler.unary_stream is not None:
            streamed_in = handler.stream_stream is not None
            inner_stream = handler.stream_stream if streamed_in else handler.unary_stream

            async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await self._require(context)
                async for response in inner_stream(request, context):
                    yield response

            wrap_stream = (
                grpc.stream_stream_rpc_method_handler if streamed_in else grpc.unary_stream_rpc_method_handler
            )
            return wrap_stream(streaming, *codec)
        streamed = handler.stream_unary is not None
        inner = handler.stream_unary if streamed else handler.unary_unary

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._require(context)
            return await inner(request, context)

        wrap = grpc.stream_unary_rpc_method_handler if streamed else grpc.unary_unary_rpc_method_handler
        return wrap(call, *codec)
