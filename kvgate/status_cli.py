"""``kvgate status``: one gateway's fleet, index, queues and policy in force, read from its status page.

The ext_proc serves ``/status.json`` (and the HTML page ``/status``) on its metrics port
(``[extproc] metrics_listen``, :mod:`extproc.status`). The gateway is ``--url`` (``http://HOST:PORT``;
a trailing ``/metrics``, ``/status`` or ``/status.json`` is accepted), else the ext_proc of the running
``kvgate up`` (its published ``stack.json``, :mod:`kvgate.dev.stackfile`; with ``--extprocs N`` the
first one: each ext_proc serves its own view, the others at their ``metrics`` ports)::

    kvgate status
    kvgate status --url http://10.0.0.7:9090 --json

Exit status: 0 shown, 1 the gateway unreachable or its answer not a status document, 2 bad usage (no
gateway found, a URL that is not http(s)).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request

from extproc.status.render import drift_warning, render_text
from extproc.status.snapshot import StatusError, decode
from kvgate.dev.stackfile import StackNotRunning, find_running

DOCUMENT = "/status.json"
_SUFFIXES = ("/status.json", "/status", "/metrics")


class _Failed(Exception):
    """A failure already worded for the operator, with its exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def document_url(url: str) -> str:
    """The ``/status.json`` URL of the gateway at ``url`` (module docstring); :class:`ValueError` when
    ``url`` is not an ``http(s)://HOST[:PORT][/path]`` URL."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected http://HOST:PORT, got {url!r}")
    path = parts.path.rstrip("/")
    for suffix in _SUFFIXES:
        if path.endswith(suffix):
            path = path[: -len(suffix)]
            break
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path + DOCUMENT, "", ""))


def _local_url() -> str:
    """The running ``kvgate up``'s ext_proc metrics URL, for a command given no ``--url``."""
    try:
        stack = find_running()
    except StackNotRunning as exc:
        raise _Failed(f"no --url given and {exc}: pass --url http://HOST:PORT", 2) from exc
    if stack.metrics_url is None:
        raise _Failed(
            f"no --url given, and the running kvgate up (pid {stack.pid}) serves no ext_proc metrics: "
            "pass --url http://HOST:PORT",
            2,
        )
    return stack.metrics_url


def _fetch(url: str, timeout_s: float) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body: bytes = response.read()
            return body
    except urllib.error.HTTPError as exc:
        raise _Failed(f"{url}: HTTP {exc.code} {exc.reason}", 1) from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise _Failed(f"{url}: unreachable ({reason})", 1) from exc


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate status",
        description="Show a gateway's fleet (endpoints, role, load, KV use, routed share, drain state), its "
        "index (blocks, feeds and their staleness), the policy in force and flow control's queues.",
        epilog="The same is served as an HTML page at the gateway's /status (its metrics port).",
    )
    parser.add_argument(
        "--url",
        metavar="URL",
        help="the ext_proc's metrics address, http://HOST:PORT (default: the running kvgate up's)",
    )
    parser.add_argument("--json", action="store_true", help="print the status document (JSON) as served")
    parser.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS", help="wait this long (default %(default)s)"
    )
    return parser


def main(argv: list[str]) -> int:
    """``kvgate status ...``"""
    args = _parser().parse_args(argv)
    try:
        if args.timeout <= 0:
            raise _Failed("--timeout must be > 0", 2)
        try:
            url = document_url(args.url if args.url is not None else _local_url())
        except ValueError as exc:
            raise _Failed(f"--url: {exc}", 2) from exc
        raw = _fetch(url, args.timeout)
        try:
            status = decode(raw)
        except StatusError as exc:
            raise _Failed(f"{url}: {exc}", 1) from exc
        if args.json:  # the drift alarm's warnings still reach a person, on stderr
            print(json.dumps(json.loads(raw), indent=2, sort_keys=True))
            for drift in status.drift:
                if drift.tripped:
                    print(drift_warning(drift), file=sys.stderr)
        else:
            sys.stdout.write(render_text(status, url.removesuffix(DOCUMENT)))
        return 0
    except _Failed as exc:
        print(f"kvgate status: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
