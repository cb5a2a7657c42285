"""``kvgate status``: one gateway's fleet, index, queues and policy in force, read from its status page.

The ext_proc serves ``/status.json`` (and the HTML page ``/status``) on its metrics port
(``[extproc] metrics_listen``, :mod:`extproc.status`). The gateway is ``--url`` (``http://HOST:PORT``;
a trailing ``/metrics``, ``/status`` or ``/status.json`` is accepted), else the ext_procs of the running
``kvgate up`` (its published ``stack.json``, :mod:`kvgate.dev.stackfile`: every one of ``--extprocs N``).

Each ext_proc serves its own view. Given several (``--url`` repeated: a host's workers, the picker's
replicas), the command reads them all at once and shows each one's summary, what they disagree on, and
one combined view (:mod:`extproc.status.combine`: streams and queues summed, the worst endpoint state,
routed shares over every worker's routing); ``--each`` prints each view in full instead::

    kvgate status
    kvgate status --url http://10.0.0.7:9090 --json
    kvgate status --url http://10.0.0.7:9090 --url http://10.0.0.8:9090

Exit status: 0 shown, 1 a gateway unreachable or its answer not a status document (with several, the
others are still shown), 2 bad usage (no gateway found, a URL that is not http(s)).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import msgspec

from extproc.status.combine import combine
from extproc.status.render import drift_warning, render_combined_text, render_text
from extproc.status.snapshot import Status, StatusError, decode
from kvgate.dev.stackfile import StackNotRunning, find_running

DOCUMENT = "/status.json"
#: The longest --timeout taken (s): a socket timeout must fit the platform's time_t, and a NaN none.
MAX_TIMEOUT_S = 3600.0
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
    try:
        port = parts.port  # ValueError: not a number from 0 to 65535 (urlopen's InvalidURL otherwise)
    except ValueError:
        port = -1
    if port == -1 or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected http://HOST:PORT, got {url!r}")
    path = parts.path.rstrip("/")
    for suffix in _SUFFIXES:
        if path.endswith(suffix):
            path = path[: -len(suffix)]
            break
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path + DOCUMENT, "", ""))


def _local_urls() -> list[str]:
    """The running ``kvgate up``'s ext_procs' metrics URLs, for a command given no ``--url``."""
    try:
        stack = find_running()
    except StackNotRunning as exc:
        raise _Failed(f"no --url given and {exc}: pass --url http://HOST:PORT", 2) from exc
    host = urllib.parse.urlsplit(stack.metrics_url or "").hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    urls = [f"http://{host}:{p['metrics']}" for p in stack.extprocs.values() if p.get("metrics")]
    if not urls and stack.metrics_url is not None:
        urls = [stack.metrics_url]
    if not urls:
        raise _Failed(
            f"no --url given, and the running kvgate up (pid {stack.pid}) serves no ext_proc metrics: "
            "pass --url http://HOST:PORT",
            2,
        )
    return urls


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
        action="append",
        help="an ext_proc's metrics address, http://HOST:PORT; repeat it for several workers or replicas, "
        "whose views are combined (default: every ext_proc of the running kvgate up)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the status document (JSON) as served; with several: each one's and the combined one",
    )
    parser.add_argument(
        "--each", action="store_true", help="with several ext_procs: each one's view in full, not combined"
    )
    parser.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS", help="wait this long (default %(default)s)"
    )
    return parser


def _read(url: str, timeout_s: float) -> tuple[Status, bytes]:
    raw = _fetch(url, timeout_s)
    try:
        return decode(raw), raw
    except StatusError as exc:
        raise _Failed(f"{url}: {exc}", 1) from exc


def _warn_drift(status: Status) -> None:
    for drift in status.drift:  # the drift alarm's warnings reach a person on stderr, even with --json
        if drift.tripped:
            print(drift_warning(drift), file=sys.stderr)


def _one(url: str, args: argparse.Namespace) -> int:
    status, raw = _read(url, args.timeout)
    if args.json:
        print(json.dumps(json.loads(raw), indent=2, sort_keys=True))
        _warn_drift(status)
    else:
        sys.stdout.write(render_text(status, url.removesuffix(DOCUMENT)))
    return 0


def _several(urls: list[str], args: argparse.Namespace) -> int:
    """Every gateway read at once (each within ``--timeout``); the ones that answered are shown, and a
    failed one makes the exit status 1."""
    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        futures = [pool.submit(_read, url, args.timeout) for url in urls]
    views: list[tuple[str, Status, bytes]] = []
    failed: list[tuple[str, str]] = []
    for url, future in zip(urls, futures, strict=True):
        source = url.removesuffix(DOCUMENT)
        try:
            status, raw = future.result()
        except _Failed as exc:
            failed.append((source, str(exc)))
            print(f"kvgate status: {exc}", file=sys.stderr)
            continue
        views.append((source, status, raw))
    combined = combine([(s, v) for s, v, _ in views], failed)
    if args.json:
        doc = {
            "gateways": {s: json.loads(raw) for s, _, raw in views},
            "failed": dict(failed),
            "combined": None if combined.status is None else json.loads(msgspec.json.encode(combined.status)),
            "disagreements": list(combined.disagreements),
        }
        print(json.dumps(doc, indent=2, sort_keys=True))
        if combined.status is not None:
            _warn_drift(combined.status)
    elif args.each:
        sys.stdout.write("\n".join(render_text(v, s) for s, v, _ in views))
    else:
        sys.stdout.write(render_combined_text(combined))
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    """``kvgate status ...``"""
    args = _parser().parse_args(argv)
    try:
        if not 0 < args.timeout <= MAX_TIMEOUT_S:  # NaN, inf, 1e300: a socket timeout cannot hold them
            raise _Failed(f"--timeout must be > 0 and <= {MAX_TIMEOUT_S:g}", 2)
        try:
            urls = [document_url(u) for u in (args.url if args.url else _local_urls())]
        except ValueError as exc:
            raise _Failed(f"--url: {exc}", 2) from exc
        urls = list(dict.fromkeys(urls))  # the same gateway twice is one view
        return _one(urls[0], args) if len(urls) == 1 else _several(urls, args)
    except _Failed as exc:
        print(f"kvgate status: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
