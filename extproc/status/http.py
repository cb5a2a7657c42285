"""The shell of the status page: the ext_proc's metrics port, which also serves the status, read-only.

``GET /status`` is the HTML page, ``GET /status.json`` the document ``kvgate status`` reads
(:mod:`extproc.status.snapshot`); every other path serves Prometheus text from ``registry`` as the
metrics port always has (``/status/`` redirects to ``/status``, whose page links ``status.json``
relatively). ``/status`` and ``/status.json`` answer GET and HEAD only (else 405). The metrics port,
not a port of its own: it is already the gateway's read-only, plaintext, loopback-by-default admin
surface that operators reach (and ``kvgate up`` publishes), and what the status shows is what its
metrics already expose (no prompt, token or credential), in one consistent view.

The server runs on its own thread (as prometheus_client's does), but the gateway's objects belong to
its event loop: each status request asks the loop for a snapshot (``take``, run there between two
callbacks, so it sees a consistent state) and waits at most ``timeout_s`` for it (then 503); the
JSON and HTML are made on the server's thread from the frozen snapshot.

With ``peers`` (a host's workers sharing a siblings directory, :mod:`extproc.status.peers`), the server
announces its URL there, and the HTML page shows this worker's view combined with every sibling's
(read from their ``/status.json`` on that request's thread); ``/status.json`` stays this worker's own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from extproc.status.combine import combine
from extproc.status.peers import StatusPeers, announced_url
from extproc.status.render import render_html
from extproc.status.snapshot import Status, encode

log = logging.getLogger(__name__)

_SECURITY_HEADERS = [
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    ("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'"),
    ("X-Frame-Options", "DENY"),
]
_StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class StatusServer:
    """Prometheus metrics plus ``/status`` and ``/status.json`` on one port (module docstring)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        take: Callable[[], Status],
        loop: asyncio.AbstractEventLoop,
        *,
        refresh_s: int = 2,
        timeout_s: float = 5.0,
        peers: StatusPeers | None = None,
    ) -> None:
        self._metrics = make_wsgi_app(registry)
        self._peers = peers
        self._take, self._loop = take, loop
        self._refresh_s, self._timeout_s = refresh_s, timeout_s
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self, listen: str) -> int:
        """Listen on ``listen`` (``host:port``, ``[v6]:port``; port 0: a free one); the bound port."""
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")
        server_class = _Server6 if ":" in host else _Server
        self._httpd = make_server(host, int(port), self._app, server_class, handler_class=_Quiet)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvgate-status", daemon=True)
        self._thread.start()
        bound = int(self._httpd.server_port)
        if self._peers is not None:
            self._peers.announce(announced_url(listen, bound))
        return bound

    def close(self) -> None:
        """Stop serving (blocks until the server's loop notices, at most half a second)."""
        if self._peers is not None:
            self._peers.withdraw()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def _snapshot(self) -> Status:
        """``take()`` run on the event loop, awaited here for at most ``timeout_s`` (then ``TimeoutError``,
        and it will not run later); ``RuntimeError`` when the loop is closed."""
        future: concurrent.futures.Future[Status] = concurrent.futures.Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._take())
                except Exception as exc:
                    future.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        try:
            return future.result(self._timeout_s)
        finally:
            future.cancel()  # no-op once done

    def _app(self, environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path not in ("/status", "/status.json"):
            if path == "/status/":
                return _answer(
                    start_response, "308 Permanent Redirect", b"", "text/plain", [("Location", "/status")]
                )
            return self._metrics(environ, start_response)  # type: ignore[no-any-return]
        method = environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):
            return _answer(
                start_response,
                "405 Method Not Allowed",
                b"read-only\n",
                "text/plain",
                [("Allow", "GET, HEAD")],
            )
        try:
            status = self._snapshot()
        except (TimeoutError, RuntimeError) as exc:  # the loop busy past the bound, or closed: never hang
            log.warning("status snapshot unavailable: %s", type(exc).__name__)
            return _answer(start_response, "503 Service Unavailable", b"status unavailable\n", "text/plain")
        except Exception:  # a bug in the snapshot: logged in full, the page says only that it failed
            log.exception("status snapshot failed")
            return _answer(start_response, "500 Internal Server Error", b"status failed\n", "text/plain")
        if path == "/status.json":
            body, kind = encode(status), "application/json"
        elif self._peers is not None and method == "GET":
            views, failed = self._peers.fetch()
            combined = combine([(f"{self._peers.name} (this page)", status), *views], failed)
            page = render_html(status, self._refresh_s, combined=combined if views or failed else None)
            body, kind = page.encode(), "text/html; charset=utf-8"
        else:
            body, kind = render_html(status, self._refresh_s).encode(), "text/html; charset=utf-8"
        return _answer(start_response, "200 OK", b"" if method == "HEAD" else body, kind, length=len(body))


def _answer(
    start_response: _StartResponse,
    status: str,
    body: bytes,
    kind: str,
    extra: list[tuple[str, str]] | None = None,
    length: int | None = None,
) -> list[bytes]:
    headers = [("Content-Type", kind), ("Content-Length", str(len(body) if length is None else length))]
    start_response(status, headers + _SECURITY_HEADERS + (extra or []))
    return [body]
