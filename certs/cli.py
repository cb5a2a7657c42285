"""``kvgate certs``: mint a dev CA and issue (or rotate) service certificates.

    kvgate certs init  --dir D [--days 30] [--force]
    kvgate certs issue --dir D --name NAME [--san DNS:host] [--san IP:addr] [--days 7]
                       [--server | --client | --both]

``issue`` on an existing name rotates it: fresh key and certificate, each file replaced atomically,
so Envoy and the ext_proc (which watch the files) serve the new certificate to new connections.
Exit codes: 0 done, 1 cannot build or write, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from collections.abc import Callable
from pathlib import Path

from cryptography import x509

from certs.authority import CA_DAYS, LEAF_DAYS, NAMES_TEXT, Usage, check_days, parse_san, role_of
from certs.errors import CertError
from certs.store import init_ca, issue


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate certs", description="Dev CA and service certificates.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_init = sub.add_parser("init", help="mint a dev CA (EC P-256, CA:TRUE pathlen:0) into --dir")
    p_init.add_argument("--dir", type=Path, required=True, help="certificate directory (created 0700)")
    p_init.add_argument("--days", type=_days, default=CA_DAYS, help=f"CA lifetime (default {CA_DAYS})")
    p_init.add_argument("--force", action="store_true", help="replace an existing CA")
    p_issue = sub.add_parser("issue", help="issue or rotate a service certificate signed by the CA")
    p_issue.add_argument("--dir", type=Path, required=True, help="certificate directory holding the CA")
    p_issue.add_argument(
        "--name",
        required=True,
        type=_checked(role_of),
        help=f"the service: {NAMES_TEXT} (its certificate's CN)",
    )
    p_issue.add_argument(
        "--san",
        action="append",
        default=[],
        type=_checked(parse_san),
        help="DNS:name, IP:address or URI:uri (repeatable)",
    )
    p_issue.add_argument("--days", type=_days, default=LEAF_DAYS, help=f"lifetime (default {LEAF_DAYS})")
    usage = p_issue.add_mutually_exclusive_group()
    for flag in Usage:
        usage.add_argument(
            f"--{flag.value}",
            dest="usage",
            action="store_const",
            const=flag,
            help=f"extended key usage: {flag.value} (default: by the name's role)",
        )
    return parser


def _checked(check: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse ``type``: the text as given, ``check``'s :class:`CertError` a usage error (exit 2)."""

    def convert(text: str) -> str:
        try:
            check(text)
        except CertError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
        return text

    return convert


def _days(text: str) -> int:
    """``--days``: a lifetime of 1 to 398 days, else a usage error (exit 2)."""
    try:
        days = int(text)
        check_days(days)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"a whole number of days, got {text!r}") from exc
    except CertError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return days


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    now = dt.datetime.now(dt.UTC)
    try:
        if args.command == "init":
            path = init_ca(args.dir, now, days=args.days, force=args.force)
            _report("CA", path)
        else:
            files = issue(args.dir, args.name, args.san, now, days=args.days, usage=args.usage)
            _report(args.name, files.cert)
            print(f"  key:  {files.key} (mode 0600)\n  CA:   {files.ca}")
    except CertError as exc:
        print(f"kvgate certs: {exc}", file=sys.stderr)
        return 1
    return 0


def _report(what: str, path: Path) -> None:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    until = f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M}Z"
    print(f"{what}: {path}\n  serial {cert.serial_number:x}, valid until {until}")


if __name__ == "__main__":
    sys.exit(main())
