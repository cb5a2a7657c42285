"""The agent's admin listener in the secure profile: HTTPS, and an allowed client identity for every change.

Without ``[agent.tls]`` the admin API is plaintext HTTP, open to whoever reaches ``admin_listen``. With
it, the listener serves HTTPS with the agent's certificate and key (the feed's, :mod:`runtime.feed.server`)
and asks every client for a certificate that chains to ``client_ca`` (:func:`server_context`). The
certificate is optional in the handshake (``CERT_OPTIONAL``), so that health probes and monitoring
without one still read ``GET /healthz``, ``/readyz`` and ``/status``; a certificate that does not
verify fails the handshake. Every request that may change state (any method but ``GET``, ``HEAD`` and
``OPTIONS``: ``POST /drain``, ``/slots/save``, ``/slots/restore``, ``/slots/restore-chain``, and any
route added later) must come over a connection whose client presented a verified certificate, or it is
answered 401, and that certificate's identity (its ``spiffe://kvgate.local/<role>[-suffix]`` URI SAN)
must name a role that may change agent state (:data:`certs.roles.CALLERS`: ``extproc``, ``operator``),
or it is answered 403; both with an OpenAI-style JSON error (:func:`client_cert_required`).

Gateways present their ``[feeds]`` client certificate, an ``extproc`` identity
(:mod:`extproc.control.restore`). An operator's ``POST /drain`` needs an ``operator-NAME`` certificate
from the same CA (``kvgate certs issue --dir D --name operator-alice``), e.g. ``curl --cacert ca.pem
--cert operator-alice.pem --key operator-alice.key -X POST https://<advertise>:<admin port>/drain``; an
API client's (``client-NAME``) or another service's certificate is refused. The listener follows
certificate rotation as the feed does (:func:`reloading_server_context`, a
:class:`runtime.tls.ReloadingServerContext`): each new handshake stats the three files and is served the
current pair, re-read when one changed and adopted only once the key matches the certificate.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler

from agent.config import TLSFiles
from agent.errors import AgentConfigError
from runtime.identity import AGENT_ADMIN, peercert_uris, permits
from runtime.tls import ReloadingServerContext, ServerTlsFiles

#: Methods that only read: served to clients without a certificate.
READ_ONLY_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


#: The OpenAI error ``type`` of each status the admin API answers with.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # OpenAI's own, as extproc/errors.py
    403: "permission_error",
    404: "invalid_request_error",
    409: "conflict_error",
    502: "upstream_error",
    503: "service_unavailable",
}


def error_response(status: int, message: str) -> web.Response:
    """The admin API's error answer: OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}``
    (``code`` is the HTTP status, as vLLM's errors carry it)."""
    error = {"message": message, "type": _ERROR_TYPES.get(status, "api_error"), "param": None, "code": status}
    return web.json_response({"error": error}, status=status)


def server_context(files: TLSFiles) -> ssl.SSLContext:
    """The admin listener's TLS context: ``files.cert``/``key`` served, client certificates asked for
    and verified against ``files.client_ca`` but not required in the handshake (module docstring)."""
    try:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=files.client_ca)
        ctx.load_cert_chain(files.cert, files.key)
    except (OSError, ssl.SSLError) as exc:
        raise AgentConfigError(f"agent.tls: cannot load the admin listener's certificates: {exc}") from exc
    ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def reloading_server_context(files: TLSFiles) -> ReloadingServerContext:
    """:func:`server_context` that follows rotation: serve ``.context`` (module docstring);
    :class:`AgentConfigError` if the files are unusable at start."""

    def build(f: ServerTlsFiles) -> ssl.SSLContext:
        return server_context(TLSFiles(str(f.cert), str(f.key), str(f.client_ca)))

    paths = ServerTlsFiles(Path(files.cert), Path(files.key), Path(files.client_ca))
    try:
        return ReloadingServerContext(paths, build, where="agent.tls")
    except OSError as exc:
        raise AgentConfigError(f"agent.tls: cannot read the admin listener's certificates: {exc}") from exc


def client_identity(request: web.Request) -> list[str] | None:
    """The identity URIs of the verified certificate ``request``'s client presented over TLS; ``None``
    without one (or once the connection is gone)."""
    transport = request.transport
    if transport is None:
        return None
    # ``None`` without a certificate; a certificate that fails verification fails the handshake.
    peercert = transport.get_extra_info("peercert")
    return peercert_uris(peercert) if peercert else None


@web.middleware
async def client_cert_required(request: web.Request, handler: Handler) -> web.StreamResponse:
    """For a state-changing request: 401 when its client presented no verified certificate, 403 when
    the certificate's identity may not change agent state (module docstring)."""
    if request.method not in READ_ONLY_METHODS:
        uris = client_identity(request)
        if uris is None:
            return error_response(401, f"{request.method} {request.path} needs a client certificate")
        if not permits(AGENT_ADMIN, uris):
            return error_response(
                403,
                f"{request.method} {request.path}: this certificate's identity may not change agent state",
            )
    return await handler(request)
