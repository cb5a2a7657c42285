"""The agent's admin listener in the secure profile: HTTPS, and a client certificate for every change.

Without ``[agent.tls]`` the admin API is plaintext HTTP, open to whoever reaches ``admin_listen``. With
it, the listener serves HTTPS with the agent's certificate and key (the feed's, :mod:`runtime.feed.server`)
and asks every client for a certificate that chains to ``client_ca`` (:func:`server_context`). The
certificate is optional in the handshake (``CERT_OPTIONAL``), so that health probes and monitoring
without one still read ``GET /healthz``, ``/readyz`` and ``/status``; a certificate that does not
verify fails the handshake. Every request that may change state (any method but ``GET``, ``HEAD`` and
``OPTIONS``: ``POST /drain``, ``/slots/save``, ``/slots/restore``, ``/slots/restore-chain``, and any
route added later) must come over a connection whose client presented a verified certificate, or it is
answered 401 with an OpenAI-style JSON error (:func:`client_cert_required`).

Gateways present their ``[feeds]`` client certificate (:mod:`extproc.control.restore`); an operator's
``POST /drain`` needs one from the same CA, e.g. ``curl --cacert ca.pem --cert client-ops.pem --key
client-ops.key -X POST https://<advertise>:<admin port>/drain``. The files are read when the listener
starts: rotating them needs an agent restart (the feed follows rotation).
"""

from __future__ import annotations

import ssl

from aiohttp import web
from aiohttp.typedefs import Handler

from agent.config import TLSFiles
from agent.errors import AgentConfigError

#: Methods that only read: served to clients without a certificate.
READ_ONLY_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def error_response(status: int, message: str) -> web.Response:
    """The admin API's error answer: OpenAI-style JSON ``{"error": {"code", "message"}}``."""
    return web.json_response({"error": {"code": status, "message": message}}, status=status)


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


def client_certified(request: web.Request) -> bool:
    """Whether ``request`` came over TLS from a client that presented a certificate that verified."""
    transport = request.transport
    if transport is None:  # the connection is gone
        return False
    # ``None`` without a certificate; a certificate that fails verification fails the handshake.
    return bool(transport.get_extra_info("peercert"))


@web.middleware
async def client_cert_required(request: web.Request, handler: Handler) -> web.StreamResponse:
    """401 for a state-changing request whose client presented no verified certificate."""
    if request.method not in READ_ONLY_METHODS and not client_certified(request):
        return error_response(401, f"{request.method} {request.path} needs a client certificate")
    return await handler(request)
