"""``kvgate etcd bootstrap``: etcd's users, roles and auth for kvgate's identities (idempotent).

    kvgate etcd bootstrap --etcd 10.0.0.5:2379 --tls-ca ca.pem --tls-cert root.pem --tls-key root.key \\
        --identity extproc --identity operator-alice --identity agent-node-a --identity kvcached-node-a

``--identity`` (repeatable) names a service certificate's CN: etcd's user for it (the roles each gets:
:mod:`kvgate.etcdsec.rbac`). The client certificate must be ``root``'s (CN ``root``) once auth is on;
before that any certificate etcd's CA verifies may run it. Prints each change (nothing on a second run
with the same identities). Exit status: 0 done, 1 etcd unreachable or refused, 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from contracts.errors import ConfigError
from contracts.etcd import EtcdSettings, parse_etcd_settings
from kvgate.etcdsec.bootstrap import Report, apply
from kvgate.etcdsec.rbac import plan
from runtime.etcd import ETCD_ERRORS, connect, describe_error


async def bootstrap(settings: EtcdSettings, identities: list[str]) -> Report:
    """Apply the plan for ``identities`` under ``settings.prefix`` to the etcd of ``settings``."""
    wanted = plan(settings.prefix, identities)
    client = await connect(settings)
    try:
        return await apply(client, wanted, timeout_s=max(settings.timeout_s, 5.0))
    finally:
        await client.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate etcd", description="etcd security for kvgate.")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("bootstrap", help="create users and roles for kvgate's identities, enable auth")
    cmd.add_argument("--etcd", action="append", required=True, metavar="HOST:PORT", help="repeatable")
    cmd.add_argument("--prefix", default="/kvgate/", help="key prefix (default: /kvgate/)")
    cmd.add_argument("--tls-ca", required=True, help="CA bundle (PEM) etcd's certificate chains to")
    cmd.add_argument("--tls-cert", required=True, help="root's client certificate (PEM, CN root)")
    cmd.add_argument("--tls-key", required=True, help="its key (PEM)")
    cmd.add_argument("--identity", action="append", default=[], help="a service's CN, repeatable")
    cmd.add_argument("--timeout", type=float, default=5.0, help="seconds per etcd call (default: 5)")
    args = parser.parse_args(argv)
    try:
        settings = parse_etcd_settings(
            {
                "endpoints": args.etcd,
                "prefix": args.prefix,
                "tls_ca": args.tls_ca,
                "tls_cert": args.tls_cert,
                "tls_key": args.tls_key,
                "timeout_s": args.timeout,
            },
            "etcd options",
        )
        report = asyncio.run(bootstrap(settings, args.identity))
    except ConfigError as exc:
        print(f"kvgate etcd: {exc}", file=sys.stderr)
        return 2
    except ETCD_ERRORS as exc:
        print(f"kvgate etcd: etcd at {', '.join(args.etcd)}: {describe_error(exc)}", file=sys.stderr)
        return 1
    for line in report.changes:
        print(line)
    if not report.changes:
        print("etcd already matches: nothing changed")
    return 0
