"""``kvgate policy get|set|unset|list|watch|history|rollback`` and ``kvgate drain ID [--undo]``.

The operator's handle on the control plane: the policy paths of :mod:`extproc.control.policy` (scheduling,
routes, and flow control's ``flow/...`` and ``objectives/<name>``) in etcd (or in a local policy file with
``--file``), and the drain flag of an endpoint. ``set``, ``unset`` and ``rollback`` build the whole
policy that would result from every stored value, as a gateway builds it
(:meth:`~extproc.control.policy.PolicyStore.evaluate`), before anything is written: a write that would
not make a valid policy exits 2 with the reason and writes nothing; in etcd, a ``set`` or ``unset``
whose policy values changed after they were read (another operator's write meanwhile) exits 1, nothing
written. Values are JSON (``3.0``, ``16``, ``'{"labels": {}}'``); a word that is not JSON is taken as a
string. ``get`` and ``list`` print effective values (the stored values taken as a gateway takes them):
the override, else the embedded default (the built-in scheduling and flow policy, or those of
``--config gateway.toml``).
``tenants/<id>`` (etcd only) sets, gets or unsets one tenant (the ``[[tenants]]`` schema, validated by
:func:`extproc.admission.shared.decode_tenant` before the write); ``list`` ends with etcd's tenants.
``federation/<cluster>`` (etcd only) likewise: one federation link
(:func:`extproc.federation.links.parse_link`); ``burst/<name>`` (etcd only): one hosted burst endpoint
(:func:`extproc.burst.records.check_record`; with ``--config`` its credential must be declared there for
its host)::

    kvgate policy set weights/prefix 3.0 --etcd 10.0.0.5:2379
    kvgate policy set objectives/interactive '{"priority": 1, "ttft_ms": 500}'
    kvgate policy set tenants/acme '{"models": ["*"], "tokens": {"per_minute": 20000}}'
    kvgate policy set federation/eu '{"ingress": "10.1.0.5:10443", "service": "10.1.0.5:9500", ...}'
    kvgate policy set burst/hosted '{"host": "api.example.com", "credential": "hosted", "models": {...}}'
    kvgate policy list --file policy.toml
    kvgate drain vllm-0

In etcd every ``set``, ``unset`` and ``rollback`` is one transaction with its audit record (who: the CN
of ``--tls-cert``; :mod:`kvgate.etcdsec.audit`) and logs one audit line (identity, key, revision; no
value). ``history PATH`` lists the revisions of PATH's key with who made each where recorded;
``rollback PATH [--revision R]`` writes back the value PATH had at revision R (default: the one before
the current; a key absent then is deleted), validated as ``set`` and ``unset`` validate: a value or a
removal that no longer validates exits 2, nothing written::

    kvgate policy history weights/prefix
    kvgate policy rollback weights/prefix --revision 41

etcd is ``--etcd``, else ``$KVGATE_ETCD``, else the local etcd of the running ``kvgate up --agents N``
(found through its published ``stack.json``, :mod:`kvgate.dev.stackfile`); with none of these the
command fails naming ``--etcd``. ``kvgate drain`` refuses an id that no endpoint in etcd has (it lists
the ones it has) unless ``--force`` (a static endpoint of a gateway config, or one not registered yet).

Exit status: 0 done, 1 etcd unreachable, a file unreadable or the policy changed meanwhile, 2 bad usage,
a refused value or a bad setting (e.g. a TLS file that cannot be read; the message, never a stack trace).
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import etcd3aio

from contracts.audit import AUDIT
from contracts.errors import ConfigError
from contracts.etcd import (
    BURST,
    ENDPOINTS,
    FEDERATION,
    MODELS,
    OBJECTIVES,
    POLICY,
    TENANTS,
    EtcdSettings,
    drain_key,
    encode_value,
    endpoint_id_of,
    family_key,
    parse_etcd_settings,
    policy_key,
    policy_path,
    split_key,
)
from extproc.admission.shared import decode_tenant
from extproc.burst.records import check_record
from extproc.control.policy import (
    KNOWN_PATHS,
    PolicyStore,
    classify,
    load_policy_file,
    write_policy_file,
)
from extproc.federation.links import parse_link
from kvgate.dev.stackfile import StackNotRunning, find_running
from kvgate.etcdsec import audit
from runtime.etcd import ETCD_ERRORS, connect, describe_error

_DELETE = 1  # mvccpb.Event.EventType.DELETE


class _Failed(Exception):
    """A failure already worded for the operator, with its exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _source_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--etcd",
        action="append",
        metavar="HOST:PORT",
        help="etcd client endpoint, repeatable (default: $KVGATE_ETCD, comma-separated, else the etcd of "
        "the running kvgate up --agents N)",
    )
    parser.add_argument("--prefix", default="/kvgate/", help="key prefix (default: /kvgate/)")
    parser.add_argument("--tls-ca", help="CA bundle (PEM) that etcd's certificate chains to")
    parser.add_argument("--tls-cert", help="client certificate (PEM), with --tls-key")
    parser.add_argument("--tls-key", help="client key (PEM), with --tls-cert")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds per etcd call (default: 2)")


def _settings(args: argparse.Namespace) -> EtcdSettings:
    endpoints = args.etcd or [e for e in os.environ.get("KVGATE_ETCD", "").split(",") if e]
    raw: dict[str, object] = {"prefix": args.prefix, "timeout_s": args.timeout, "endpoints": endpoints}
    if not endpoints:  # the running kvgate up's etcd, with its operator certificate under --etcd-auth
        address, tls = _local_etcd()
        raw["endpoints"] = [address]
        if not any(getattr(args, key) for key in ("tls_ca", "tls_cert", "tls_key")):
            raw.update(tls)
    for key in ("tls_ca", "tls_cert", "tls_key"):
        if getattr(args, key):
            raw[key] = getattr(args, key)
    try:
        return parse_etcd_settings(raw, "etcd options")
    except ConfigError as exc:
        raise _Failed(str(exc), 2) from exc


def _local_etcd() -> tuple[str, dict[str, str]]:
    """The etcd of the running ``kvgate up`` and its operator's TLS files (``--etcd-auth``; else none),
    for a command given no ``--etcd`` nor ``$KVGATE_ETCD``."""
    hint = "pass --etcd HOST:PORT (or set KVGATE_ETCD)"
    try:
        stack = find_running()
    except StackNotRunning as exc:
        raise _Failed(f"no etcd given and {exc}: {hint}, or start kvgate up --agents N", 2) from exc
    if stack.etcd is None:
        raise _Failed(
            f"no etcd given, and the running kvgate up (pid {stack.pid}, {stack.url}) has none (start it "
            f"with --agents N): {hint}",
            2,
        )
    return stack.etcd, dict(stack.etcd_tls)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate policy",
        description="The run-time policy (scheduling, routes, flow control) in etcd (or in a policy file "
        "with --file).",
        epilog=f"paths: {KNOWN_PATHS}, tenants/<id> (etcd only). Values are JSON; a word that is not JSON "
        "is a string.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {
        "get": "print the effective value of PATH",
        "set": "validate VALUE and write it at PATH",
        "unset": "remove the override at PATH (back to the default)",
        "list": "print every effective PATH=VALUE",
        "watch": "print each policy change as it happens",
        "history": "list PATH's revisions in etcd, newest first, with who made each where recorded",
        "rollback": "write back the value PATH had at --revision R (default: the one before the current)",
    }
    for name, text in commands.items():
        cmd = sub.add_parser(name, help=text, description=text)
        if name in ("get", "set", "unset", "history", "rollback"):
            cmd.add_argument(
                "path", help="e.g. weights/prefix, plugins/load-threshold/max_waiting, flow/saturation"
            )
        if name == "set":
            cmd.add_argument("value", help="JSON value (a bare word is a string)")
        if name == "watch":
            cmd.add_argument("--once", action="store_true", help="exit after the first change")
        elif name == "history":
            cmd.add_argument("--limit", type=int, default=20, help="at most this many revisions (default 20)")
        elif name == "rollback":
            cmd.add_argument("--revision", type=int, help="etcd revision whose value to restore")
        if name not in ("watch", "history", "rollback"):
            cmd.add_argument("--file", type=Path, help="work on this policy file (.toml or .json), not etcd")
        cmd.add_argument(
            "--config", type=Path, help="gateway config whose scheduling and [flow] give the defaults"
        )
        _source_options(cmd)
    return parser


def _store(args: argparse.Namespace) -> PolicyStore:
    if args.config is None:
        return PolicyStore()
    from extproc.config import load_config

    try:
        return PolicyStore.from_config(load_config(args.config))
    except ConfigError as exc:
        raise _Failed(str(exc), 2) from exc


def _value(text: str) -> bytes:
    """The canonical JSON bytes of a command-line value (not JSON: a string)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = text
    return encode_value(value)


def _show(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def _check_path(store: PolicyStore, path: str) -> None:
    try:
        classify(path, store.base.scheduling)
    except ConfigError as exc:
        raise _Failed(str(exc), 2) from exc


def _print_effective(args: argparse.Namespace, store: PolicyStore) -> None:
    for reason in sorted(store.rejected.values()):
        print(f"warning: stored value refused ({reason}); the effective value is shown", file=sys.stderr)
    if args.command == "get":
        print(_show(store.get(args.path)))
    else:
        for path, value in store.effective().items():
            print(f"{path}={_show(value)}")


# -- file mode ------------------------------------------------------------------------------------------


def _file_command(args: argparse.Namespace, store: PolicyStore) -> int:
    path: Path = args.file
    items: dict[str, bytes] = {}
    if path.exists() or args.command in ("get", "list"):
        try:
            items = load_policy_file(path)
            store.load(items)
        except ConfigError as exc:
            raise _Failed(str(exc), 2 if path.exists() else 1) from exc
    if args.command in ("get", "list"):
        _print_effective(args, store)
        return 0
    if args.command == "set":
        raw = _value(args.value)
        try:
            store.validate(args.path, raw)
        except ConfigError as exc:
            raise _Failed(str(exc), 2) from exc
        items[args.path] = raw
        print(f"{args.path}={raw.decode()}")
    else:
        items.pop(args.path, None)
        try:
            store.load(items)  # what is left must stand on its own (all or nothing)
        except ConfigError as exc:
            raise _Failed(f"{args.path} cannot be unset, nothing written: {exc}", 2) from exc
        print(f"{args.path} unset")
    try:
        write_policy_file(path, items)
    except (ConfigError, OSError) as exc:
        raise _Failed(f"cannot write {path}: {exc}", 2 if isinstance(exc, ConfigError) else 1) from exc
    return 0


# -- etcd mode ------------------------------------------------------------------------------------------


def _kv(client: etcd3aio.Etcd3Client) -> etcd3aio.kv.KVService:
    assert client.kv is not None
    return client.kv


async def _load(
    client: etcd3aio.Etcd3Client, settings: EtcdSettings, store: PolicyStore
) -> tuple[int, dict[str, bytes]]:
    """Every policy value in etcd (path -> raw), applied to ``store`` as a gateway applies them (the whole
    set at once, :meth:`PolicyStore.replace`); with the revision read."""
    prefix = settings.prefix
    response = await _kv(client).get(prefix, etcd3aio.prefix_range_end(prefix), timeout=settings.timeout_s)
    items: dict[str, bytes] = {}
    for kv in response.kvs:
        path = _path_of(settings, kv.key)
        if path is not None:
            items[path] = bytes(kv.value)
    store.replace(items)
    return int(response.header.revision), items


def _check_write(store: PolicyStore, items: Mapping[str, bytes], path: str, raw: bytes | None) -> None:
    """:class:`ConfigError` for a write of ``raw`` at ``path`` (``None``: its removal) unless the whole
    resulting set of policy values makes a valid policy, as a gateway builds it
    (:meth:`PolicyStore.evaluate`), with ``path``'s own value accepted."""
    after = {p: v for p, v in items.items() if p != path}
    if raw is not None:
        after[path] = raw
    result = store.evaluate(after)
    if path in result.refused:
        raise ConfigError(result.refused[path])
    if result.policy is None:
        what = "without" if raw is None else "with this value at"
        reasons = "; ".join(sorted(set(result.refused.values())))
        raise ConfigError(f"the stored policy {what} {path} would not be valid: {reasons}")


def _checked_write(store: PolicyStore, items: Mapping[str, bytes], path: str, raw: bytes | None) -> None:
    """:func:`_check_write` for ``set`` and ``unset``: a refusal exits 2, nothing written."""
    try:
        _check_write(store, items, path, raw)
    except ConfigError as exc:
        raise _Failed(f"{exc}; nothing written", 2) from exc


def _path_of(settings: EtcdSettings, key: bytes) -> str | None:
    parsed = split_key(settings.prefix, key)
    return None if parsed is None else policy_path(*parsed)


def _tenant_id(args: argparse.Namespace) -> str | None:
    """The id when the command's PATH is ``tenants/<id>``, else ``None``."""
    path = getattr(args, "path", None)
    if path is None or not path.startswith(TENANTS + "/"):
        return None
    return str(path[len(TENANTS) + 1 :])


def _link_name(args: argparse.Namespace, family: str = FEDERATION) -> str | None:
    """The cluster when the command's PATH is ``federation/<cluster>`` (the name when ``<family>/<name>``),
    else ``None``."""
    path = getattr(args, "path", None)
    if path is None or not path.startswith(family + "/"):
        return None
    return str(path[len(family) + 1 :])


def _record(args: argparse.Namespace) -> tuple[str, str] | None:
    """``(family, name)`` when PATH is ``federation/<cluster>`` or ``burst/<name>``, else ``None``."""
    for family in (FEDERATION, BURST):
        name = _link_name(args, family)
        if name is not None:
            return family, name
    return None


def _checker(args: argparse.Namespace, family: str, name: str) -> Callable[[bytes], object]:
    """The validation of a ``family/<name>`` value (``set`` and ``rollback``)."""
    if family == TENANTS:
        return lambda raw: decode_tenant(name, raw)
    if family == FEDERATION:
        return lambda raw: _check_link(name, raw)
    credentials = None
    if getattr(args, "config", None) is not None:  # the gateway host's declared credentials
        from extproc.config import load_config

        try:
            credentials = {c.name: c for c in load_config(args.config).burst_credentials}
        except ConfigError as exc:
            raise _Failed(str(exc), 2) from exc
    return lambda raw: check_record(raw, name, credentials)


def _check_link(name: str, raw: bytes) -> None:
    try:
        parse_link(json.loads(raw), f"{FEDERATION}/{name}", name)
    except ValueError as exc:
        raise ConfigError(f"{FEDERATION}/{name}: not a JSON object") from exc


async def _tenant_command(
    args: argparse.Namespace,
    client: etcd3aio.Etcd3Client,
    settings: EtcdSettings,
    tenant_id: str,
    family: str = TENANTS,
) -> None:
    """get/set/unset of ``tenants/<id>`` (or ``federation/<cluster>``); ``set`` validates the value
    before writing it."""
    key, timeout = family_key(settings.prefix, family, tenant_id), settings.timeout_s
    if args.command == "set":
        raw = _value(args.value)
        try:
            _checker(args, family, tenant_id)(raw)
        except ConfigError as exc:
            raise _Failed(str(exc), 2) from exc
        await _audited(client, settings, key, raw, "set")
        print(f"{args.path}={raw.decode()}")
    elif args.command == "unset":
        await _audited(client, settings, key, None, "unset")
        print(f"{args.path} unset")
    elif args.command in ("history", "rollback"):
        checker = _checker(args, family, tenant_id) if args.command == "rollback" else None

        def check(raw: bytes | None) -> None:
            if raw is not None and checker is not None:  # removing a tenant or a link always stands
                checker(raw)

        await _revision_command(args, client, settings, key, check)
    else:
        response = await _kv(client).get(key, timeout=timeout)
        if not response.kvs:
            what = {TENANTS: "tenant", FEDERATION: "link"}.get(family, "burst endpoint")
            raise _Failed(f"{args.path}: no such {what} in etcd (a gateway config's are not shown)", 2)
        print(bytes(response.kvs[0].value).decode("utf-8", "replace"))


async def _print_tenants(client: etcd3aio.Etcd3Client, settings: EtcdSettings) -> None:
    """``tenants/<id>=<value>`` for every tenant in etcd, by id."""
    prefix = f"{settings.prefix}{TENANTS}/"
    response = await _kv(client).get(prefix, etcd3aio.prefix_range_end(prefix), timeout=settings.timeout_s)
    for kv in sorted(response.kvs, key=lambda kv: bytes(kv.key)):
        parsed = split_key(settings.prefix, kv.key)
        if parsed is not None:
            print(f"{TENANTS}/{parsed[1]}={bytes(kv.value).decode('utf-8', 'replace')}")


async def _audited(
    client: etcd3aio.Etcd3Client,
    settings: EtcdSettings,
    key: str,
    value: bytes | None,
    op: str,
    checked_at: int | None = None,
) -> None:
    """Write (``None``: delete) ``key`` with its audit record; the audit line goes to stderr.
    ``checked_at``: the revision of the policy values the write was checked against; a policy key
    written since (or an audited write: an unset) and nothing is written, exit 1."""
    record = audit.Record(audit.who(settings), op)
    guard = None
    if checked_at is not None:
        families = (POLICY, MODELS, OBJECTIVES, AUDIT)
        guard = ([f"{settings.prefix}{family}/" for family in families], checked_at)
    revision = await audit.write(
        client, settings.prefix, key, value, record, unchanged_since=guard, timeout_s=settings.timeout_s
    )
    if revision is None:
        raise _Failed("the policy changed while this write was checked; nothing written, try again", 1)
    print(audit.log_line(record, key, revision), file=sys.stderr)


async def _revision_command(
    args: argparse.Namespace,
    client: etcd3aio.Etcd3Client,
    settings: EtcdSettings,
    key: str,
    validate: Callable[[bytes | None], object],
) -> None:
    """``history`` (print) or ``rollback`` (validate, then write) of ``key``."""
    timeout = settings.timeout_s
    if args.command == "history":
        if args.limit < 1:
            raise _Failed("--limit must be at least 1", 2)
        entries = await audit.history(client, settings.prefix, key, limit=args.limit, timeout_s=timeout)
        if not entries:
            raise _Failed(f"{args.path}: no revisions in etcd (never set, or compacted)", 2)
        for entry in entries:
            text = "(unset)" if entry.value is None else entry.value.decode("utf-8", "replace")
            record = entry.record
            who = "by ? (not written through kvgate)" if record is None else f"by {record.by} ({record.op})"
            if record is not None and record.restored is not None:
                who += f" from revision {record.restored}"
            print(f"{entry.revision}\t{who}\t{args.path}={text}")
        return

    def check(raw: bytes | None) -> None:
        validate(raw)

    try:
        restored, restored_value, written = await audit.rollback(
            client,
            settings.prefix,
            key,
            audit.who(settings),
            check,
            revision=args.revision,
            timeout_s=timeout,
        )
    except audit.RollbackError as exc:
        raise _Failed(str(exc), exc.status) from exc
    shown = " unset" if restored_value is None else f"={restored_value.decode('utf-8', 'replace')}"
    print(f"{args.path}{shown} (the value at revision {restored}; written at revision {written})")
    print(
        audit.log_line(audit.Record(audit.who(settings), "rollback", restored), key, written), file=sys.stderr
    )


async def _etcd_command(args: argparse.Namespace, settings: EtcdSettings, store: PolicyStore) -> int:
    client = await connect(settings)
    try:
        tenant_id = _tenant_id(args)
        if tenant_id is not None:
            await _tenant_command(args, client, settings, tenant_id)
            return 0
        record = _record(args)
        if record is not None:
            await _tenant_command(args, client, settings, record[1], record[0])
            return 0
        revision, items = await _load(client, settings, store)
        if args.command == "list":
            _print_effective(args, store)
            await _print_tenants(client, settings)
        elif args.command == "get":
            _print_effective(args, store)
        elif args.command == "set":
            raw = _value(args.value)
            _checked_write(store, items, args.path, raw)
            await _audited(client, settings, policy_key(settings.prefix, args.path), raw, "set", revision)
            print(f"{args.path}={raw.decode()}")
        elif args.command == "unset":
            _checked_write(store, items, args.path, None)
            await _audited(client, settings, policy_key(settings.prefix, args.path), None, "unset", revision)
            print(f"{args.path} unset")
        elif args.command in ("history", "rollback"):
            key = policy_key(settings.prefix, args.path)
            path = args.path

            def check(raw: bytes | None) -> None:
                _check_write(store, items, path, raw)  # the whole resulting set, as set and unset do

            await _revision_command(args, client, settings, key, check)
        else:
            await _watch(client, settings, store, items, revision, once=args.once)
        return 0
    finally:
        await client.close()


async def _watch(
    client: etcd3aio.Etcd3Client,
    settings: EtcdSettings,
    store: PolicyStore,
    items: dict[str, bytes],
    revision: int,
    *,
    once: bool,
) -> None:
    assert client.watch is not None
    prefix = settings.prefix
    print(f"watching {prefix} from revision {revision + 1}", file=sys.stderr, flush=True)
    async for response in client.watch.watch(prefix, etcd3aio.prefix_range_end(prefix), revision + 1):
        if response.canceled:
            raise _Failed(f"watch cancelled by etcd (compacted at {response.compact_revision})", 1)
        for event in response.events:
            path = _path_of(settings, event.kv.key)
            if path is None:
                continue
            if event.type == _DELETE:
                items.pop(path, None)
                line = f"{path} unset"
            else:
                raw = bytes(event.kv.value)
                items[path] = raw
                line = f"{path}={raw.decode('utf-8', 'replace')}"
            store.replace(items)  # as a gateway takes it: the whole set
            refused = store.rejected.get(path)
            if refused:
                line += f" (refused: {refused})"
            print(line, flush=True)
            if once:
                return


def main(argv: list[str]) -> int:
    """``kvgate policy ...``"""
    args = _parser().parse_args(argv)
    try:
        store = _store(args)
        tenant = _tenant_id(args)
        link = _record(args)
        if args.command in ("get", "set", "unset", "history", "rollback") and tenant is None and link is None:
            _check_path(store, args.path)
        if getattr(args, "file", None) is not None:
            if tenant is not None or link is not None:
                raise _Failed(
                    "tenants/<id>, federation/<cluster> and burst/<name> live in etcd (or a gateway config),"
                    " not a"
                    " policy file",
                    2,
                )
            return _file_command(args, store)
        settings = _settings(args)
        try:
            return asyncio.run(_etcd_command(args, settings, store))
        except ETCD_ERRORS as exc:
            raise _Failed(f"etcd at {', '.join(settings.endpoints)}: {describe_error(exc)}", 1) from exc
        except ConfigError as exc:  # e.g. a TLS file that cannot be read
            raise _Failed(str(exc), 2) from exc
    except _Failed as exc:
        print(f"kvgate policy: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        return 130


# -- drain ----------------------------------------------------------------------------------------------


def _who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


async def _drain(args: argparse.Namespace, settings: EtcdSettings) -> int:
    client = await connect(settings)
    try:
        kv = _kv(client)
        key = drain_key(settings.prefix, args.id)
        if args.undo:
            deleted = (await kv.delete(key, timeout=settings.timeout_s)).deleted
            print(f"endpoint {args.id} " + ("no longer draining" if deleted else "was not draining"))
            return 0
        known = await _registered(kv, settings)
        if args.id not in known and not args.force:
            listed = ", ".join(sorted(known)) or "none"
            raise _Failed(
                f"no endpoint {args.id!r} is registered in etcd (registered: {listed}); nothing written. "
                "--force drains it anyway (a static endpoint of a gateway config, or one not started yet)",
                2,
            )
        value = json.dumps({"at": round(time.time(), 3), "by": args.by or _who()}).encode()
        await kv.put(key, value, timeout=settings.timeout_s)
        print(f"endpoint {args.id} draining: no new requests will be routed to it")
        return 0
    finally:
        await client.close()


async def _registered(kv: etcd3aio.kv.KVService, settings: EtcdSettings) -> set[str]:
    """The ids of the endpoints registered in etcd (``endpoints/<node>/<id>`` and ``endpoints/<id>`` keys)."""
    prefix = f"{settings.prefix}{ENDPOINTS}/"
    end = etcd3aio.prefix_range_end(prefix)
    response = await kv.get(prefix, end, keys_only=True, timeout=settings.timeout_s)
    keys = (split_key(settings.prefix, bytes(item.key)) for item in response.kvs)
    return {endpoint_id_of(key[1]) for key in keys if key is not None}


def drain_main(argv: list[str]) -> int:
    """``kvgate drain ID [--undo] [--force]``: stop (or resume) routing new requests to an endpoint."""
    parser = argparse.ArgumentParser(
        prog="kvgate drain", description="Stop routing new requests to an endpoint (in-flight ones finish)."
    )
    parser.add_argument("id", help="endpoint id")
    parser.add_argument("--undo", action="store_true", help="route to it again")
    parser.add_argument("--by", help="who drains it, recorded in the value (default: user@host)")
    parser.add_argument(
        "--force",
        action="store_true",
        help="drain an id no endpoint in etcd has (a static endpoint of a gateway config, or one not "
        "registered yet); without it such an id is refused",
    )
    _source_options(parser)
    args = parser.parse_args(argv)
    try:
        settings = _settings(args)
        try:
            return asyncio.run(_drain(args, settings))
        except ETCD_ERRORS as exc:
            raise _Failed(f"etcd at {', '.join(settings.endpoints)}: {describe_error(exc)}", 1) from exc
        except ConfigError as exc:  # e.g. a TLS file that cannot be read
            raise _Failed(str(exc), 2) from exc
    except _Failed as exc:
        print(f"kvgate drain: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:  # Ctrl-C while etcd does not answer
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
