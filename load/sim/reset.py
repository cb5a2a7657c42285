"""The connection-reset fault (``POST /_sim/reset_next``): an engine that aborts its TCP connection.

Real wire behaviour, not an error answer: the socket's ``SO_LINGER`` is set to zero seconds and the
transport aborted, so the kernel sends a TCP RST (the peer reads ``ECONNRESET``), as when an engine
process crashes with the connection open or a middlebox kills it. ``after`` says where: ``0`` before
any response byte (Envoy sees a reset before the response began: a retriable try, ``UC``/``UR``),
``K > 0`` after the K-th SSE event of a stream (the client already has a 200 and part of the answer;
a non-streamed answer is reset before its first byte).
"""

from __future__ import annotations

import contextlib
import socket
import struct

from aiohttp import web

#: The request key under which a request chosen for a reset carries its ``after`` (SSE events).
RESET_AFTER = web.RequestKey("kvgate_sim_reset_after", int)


def reset_connection(request: web.Request) -> None:
    """Abort ``request``'s connection with a TCP RST (``SO_LINGER`` 0, then close)."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # already closed: nothing to reset
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
