"""``kvgate apikey``: create, revoke and list API keys in a key file (:mod:`extproc.admission.keys`).

    kvgate apikey create --tenant acme [--name ci] [--file api_keys.json] [--config gateway.toml]
    kvgate apikey revoke key_3f2a9c01d4e5 [--file api_keys.json]
    kvgate apikey list [--file api_keys.json]

``create`` prints the key once, on stdout; only its hash is stored. A running ext_proc watches the
file: a new key works and a revoked one is refused from the very next request. Writes are atomic and
serialised by a lock file next to the key file.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from contracts.errors import ConfigError
from extproc.admission.keys import ApiKey, KeyFileError, hash_key, new_key, new_key_id, read_keys, write_keys
from extproc.admission.tenants import TENANT_ID
from extproc.config import load_config

DEFAULT_FILE = os.environ.get("KVGATE_API_KEYS", "api_keys.json")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def create(path: Path, tenant: str, name: str | None, now: int) -> tuple[str, ApiKey]:
    """Add a key for ``tenant``; returns (the key, shown once; its stored record)."""
    key = new_key()
    record = ApiKey(new_key_id(), tenant, hash_key(key), now, name)
    with _locked(path):
        keys = list(read_keys(path).keys)
        write_keys(path, [*keys, record])
    return key, record


def revoke(path: Path, key_id: str, now: int) -> ApiKey:
    """Mark the key ``key_id`` revoked (kept in the file for audit); raises ``KeyError`` if unknown."""
    with _locked(path):
        keys = list(read_keys(path).keys)
        for i, k in enumerate(keys):
            if k.id == key_id:
                keys[i] = k if k.revoked is not None else replace(k, revoked=now)
                write_keys(path, keys)
                return keys[i]
    raise KeyError(key_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate apikey", description="Manage kvgate API keys.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_create = sub.add_parser("create", help="create a key for a tenant and print it once")
    p_create.add_argument("--tenant", required=True)
    p_create.add_argument("--name", help="a label for the key (who or what uses it)")
    p_create.add_argument("--config", type=Path, help="gateway config: check the tenant exists in it")
    p_revoke = sub.add_parser("revoke", help="revoke a key by id (effective on the next request)")
    p_revoke.add_argument("key_id")
    sub.add_parser("list", help="list keys (ids, tenants, states; never hashes)")
    for p in (p_create, p_revoke, sub.choices["list"]):
        p.add_argument("--file", type=Path, default=Path(DEFAULT_FILE), help="key file (JSON)")
    args = parser.parse_args(argv)
    now = int(time.time())
    try:
        if args.command == "create":
            if not TENANT_ID.fullmatch(args.tenant):
                raise ValueError(f"not a valid tenant id: {args.tenant!r}")
            if args.config is not None and args.tenant not in {
                t.id for t in load_config(args.config).tenants
            }:
                raise ValueError(f"tenant {args.tenant!r} is not in {args.config}")
            key, record = create(args.file, args.tenant, args.name, now)
            print(
                f"created {record.id} for tenant {record.tenant} in {args.file}; the key (shown once):",
                file=sys.stderr,
            )
            print(key)
        elif args.command == "revoke":
            record = revoke(args.file, args.key_id, now)
            print(f"revoked {record.id} (tenant {record.tenant})", file=sys.stderr)
        else:
            for k in read_keys(args.file).keys:
                state = (
                    "valid"
                    if k.revoked is None
                    else f"revoked {time.strftime('%Y-%m-%d', time.gmtime(k.revoked))}"
                )
                print(f"{k.id}\t{k.tenant}\t{k.name or '-'}\t{state}")
    except KeyError as exc:
        print(f"kvgate apikey: no key with id {exc.args[0]!r} in {args.file}", file=sys.stderr)
        return 1
    except (ValueError, KeyFileError, ConfigError, OSError) as exc:
        print(f"kvgate apikey: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
