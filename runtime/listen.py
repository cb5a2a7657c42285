"""A listener that cannot bind, as one error every daemon reports the same way.

A daemon whose listen address is taken, not this host's, or privileged must stop with one line
(``kvgate <daemon>: cannot listen on 127.0.0.1:8081: address already in use``, exit 1), not a stack
trace. Every bind site goes through this module: :func:`add_grpc_port` for a gRPC server's port (grpc
raises ``RuntimeError`` without the OS's reason, older grpc returned 0: the reason is found by binding
the address once more here), and :func:`binding` around an aiohttp, asyncio, aioquic or socketserver
bind (an ``OSError``: its reason is kept). Both raise :class:`ListenError`; each daemon's ``main``
prints it and exits 1 after its usual cleanup.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any


class ListenError(Exception):
    """``cannot listen on ADDRESS: REASON`` (the address as configured, the OS's reason)."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"cannot listen on {address}: {reason}")
        self.address = address
        self.reason = reason


def reason_of(exc: OSError) -> str:
    """The OS's reason for ``exc`` in lower case (asyncio's message repeats the address: not kept; uvloop's
    UDP bind error has no errno, its cause has)."""
    cause = exc.__cause__ or exc.__context__
    if not exc.errno and isinstance(cause, OSError) and cause.errno:
        exc = cause
    if isinstance(exc, socket.gaierror) or not exc.errno or exc.errno < 0:
        text = exc.strerror or str(exc)
    else:
        text = os.strerror(exc.errno)
    return text[:1].lower() + text[1:]


@contextlib.contextmanager
def binding(address: str) -> Iterator[None]:
    """Turn an ``OSError`` raised by the bind in the block into :class:`ListenError` for ``address``."""
    try:
        yield
    except OSError as exc:
        raise ListenError(address, reason_of(exc)) from None


def add_grpc_port(server: Any, address: str, credentials: Any = None) -> int:
    """``server.add_secure_port(address, credentials)`` (``add_insecure_port`` without credentials): the
    bound port (1 for a Unix socket), else :class:`ListenError` with the reason a bind of ``address``
    gives now."""
    try:
        if credentials is None:
            port = int(server.add_insecure_port(address))
        else:
            port = int(server.add_secure_port(address, credentials))
    except RuntimeError:
        port = 0
    if port == 0:
        raise ListenError(address, _probe(address))
    return port


def _probe(address: str) -> str:
    """Why ``address`` (``host:port``, ``[v6]:port``, ``unix:PATH``) cannot be bound: bind it the way
    grpc does (``SO_REUSEADDR``) and give the OS's reason."""
    try:
        if address.startswith("unix:"):
            path = address[len("unix:") :]
            if os.path.lexists(path):
                return "address already in use"
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.bind(path)
            os.unlink(path)
        else:
            host, _, port = address.rpartition(":")
            host = host.strip("[]")
            infos = socket.getaddrinfo(
                host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
            for family, kind, proto, _name, sockaddr in infos:
                with socket.socket(family, kind, proto) as sock:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind(sockaddr)
    except OSError as exc:
        return reason_of(exc)
    except ValueError:
        return "not a host:port"
    return "the address could not be bound"
