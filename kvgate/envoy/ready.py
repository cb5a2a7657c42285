"""Wait until Envoy says it is ready: ``python -m kvgate.envoy.ready --admin-socket PATH``.

Envoy has no sd_notify, so its systemd unit (deploy/systemd/kvgate-envoy.service) runs this as
``ExecStartPost``: systemd counts the unit started only once Envoy's admin answers ``GET /ready`` with 200
(the listeners are initialised and the clusters warmed), and fails the start if it does not within
``--timeout-s``. The admin is reached on its Unix socket (kvgate keeps it there: it can raise log levels
and stop the server) or on ``--admin-url http://127.0.0.1:PORT``. Exit status: 0 ready, 1 not ready in
time, 2 usage.
"""

from __future__ import annotations

import argparse
import http.client
import math
import socket
import sys
import time
from urllib.parse import urlsplit


class _UnixConnection(http.client.HTTPConnection):
    """HTTP/1.1 over the Unix socket at ``path``."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def ready_once(admin_socket: str | None, admin_url: str | None, timeout_s: float = 1.0) -> bool:
    """One ``GET /ready``: whether Envoy answered 200 (connection errors are "not yet")."""
    if admin_socket is not None:
        conn: http.client.HTTPConnection = _UnixConnection(admin_socket, timeout_s)
    else:
        assert admin_url is not None
        host = admin_url.removeprefix("http://").rstrip("/")
        conn = http.client.HTTPConnection(host, timeout=timeout_s)
    try:
        conn.request("GET", "/ready")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def _plain_http_origin(url: str) -> bool:
    """Whether ``url`` is ``http://HOST:PORT`` (an optional trailing ``/``), the only form probed."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return False
    return (
        parts.scheme == "http"
        and bool(parts.hostname)
        and port is not None
        and parts.path in ("", "/")
        and not (parts.query or parts.fragment or parts.username or parts.password)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgate.envoy.ready", description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--admin-socket", metavar="PATH", help="Envoy's admin Unix socket")
    where.add_argument("--admin-url", metavar="URL", help="Envoy's admin on TCP: http://127.0.0.1:PORT")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="give up after (default %(default)s)")
    parser.add_argument("--interval-s", type=float, default=0.1, help="between probes (default %(default)s)")
    args = parser.parse_args(argv)
    if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        parser.error(f"--timeout-s: a number of seconds > 0, got {args.timeout_s:g}")
    if not (math.isfinite(args.interval_s) and args.interval_s > 0):
        parser.error(f"--interval-s: a number of seconds > 0, got {args.interval_s:g}")
    if args.admin_url is not None and not _plain_http_origin(args.admin_url):
        parser.error(
            f"--admin-url: expected http://HOST:PORT (Envoy's admin, plain HTTP), got {args.admin_url!r}"
        )
    deadline = time.monotonic() + args.timeout_s
    while not ready_once(args.admin_socket, args.admin_url):
        if time.monotonic() > deadline:
            print(f"envoy not ready after {args.timeout_s:g} s", file=sys.stderr)
            return 1
        time.sleep(args.interval_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
