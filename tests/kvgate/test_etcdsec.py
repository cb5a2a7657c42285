"""etcd security against a real etcd with TLS client-certificate auth and kvgate's RBAC: who may write
what, the bootstrap's idempotence, the audit trail, ``kvgate policy history`` and ``rollback``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from contracts.etcd import EtcdSettings, endpoint_key
from kvgate.etcdsec import audit
from kvgate.etcdsec.cli import bootstrap
from kvgate.etcdsec.cli import main as etcd_main
from kvgate.policy_cli import main as policy_main
from runtime.etcd import ETCD_ERRORS, LeasedKeys, connect
from tests.etcd_access import may_put as _put

if TYPE_CHECKING:
    from tests.etcd_fixtures import SecureEtcd

pytest_plugins = ("tests.etcd_fixtures",)


async def _get(settings: EtcdSettings, key: str) -> bytes | None:
    client = await connect(settings)
    try:
        assert client.kv is not None
        response = await client.kv.get(key, timeout=5.0)
        return bytes(response.kvs[0].value) if response.kvs else None
    finally:
        await client.close()


async def test_agents_write_only_their_own_endpoints(secure_etcd: SecureEtcd) -> None:
    p = secure_etcd.prefix
    a = secure_etcd.settings("agent-node-a")
    assert await _put(a, endpoint_key(p, "vllm-0", "node-a"), b"{}")
    assert not await _put(a, endpoint_key(p, "vllm-0", "node-b"), b"{}")  # another agent's
    assert not await _put(a, endpoint_key(p, "vllm-0"), b"{}")  # the flat layout: nobody's prefix
    assert not await _put(a, endpoint_key(p, "x", "node-a-b"), b"{}")  # a node whose id extends ours
    for family in ("policy/weights/prefix", "tenants/acme", "models/m", "drain/vllm-0", "audit/policy/x"):
        assert not await _put(a, p + family, b"1"), family
    # What an agent does for real: a lease and its keys under it, revoked at the end.
    client = await connect(a)
    try:
        keys = LeasedKeys(client, 5)
        assert await keys.start({endpoint_key(p, "sim-0", "node-a"): b'{"id":"sim-0"}'})
        await keys.aclose()
    finally:
        await client.close()
    assert await _get(secure_etcd.settings("extproc"), endpoint_key(p, "sim-0", "node-a")) is None


async def test_the_gateway_reads_and_writes_only_usage(secure_etcd: SecureEtcd) -> None:
    p, gw = secure_etcd.prefix, secure_etcd.settings("extproc")
    assert await _put(secure_etcd.settings("agent-node-b"), endpoint_key(p, "e", "node-b"), b"{}")
    assert await _get(gw, endpoint_key(p, "e", "node-b")) == b"{}"
    for family in ("policy/weights/prefix", "tenants/acme", "models/m", "endpoints/node-b/e", "drain/e"):
        assert not await _put(gw, p + family, b"1"), family
    assert await _put(gw, p + "usage/acme/replica-1", b"7")


async def test_only_the_operator_writes_policy_tenants_models(secure_etcd: SecureEtcd) -> None:
    p, op = secure_etcd.prefix, secure_etcd.settings("operator-alice")
    for family in ("policy/weights/prefix", "tenants/acme", "models/m", "objectives/o", "drain/e"):
        assert await _put(op, p + family, b"1"), family
    # kvgate policy set federation/<cluster> and burst/<name> are the operator's too
    for family in ("federation/eu", "burst/hosted"):
        assert await _put(op, p + family, b"{}"), family
    assert not await _put(op, endpoint_key(p, "e", "node-a"), b"{}")  # endpoints are the agents'
    kv = secure_etcd.settings("kvcached-node-a")
    assert await _put(kv, p + "kvcached/node-a", b"{}")
    assert not await _put(kv, p + "kvcached/node-b", b"{}")
    assert not await _put(kv, p + "policy/weights/prefix", b"1")
    # Nothing outside the prefix for anyone but root.
    assert not await _put(op, "/elsewhere/policy/x", b"1")


async def test_bootstrap_is_idempotent(secure_etcd: SecureEtcd) -> None:
    again = await bootstrap(secure_etcd.settings("root"), list(secure_etcd.identities))
    assert again.changes == []
    # A new agent joins: its user and role, nothing else.
    report = await bootstrap(secure_etcd.settings("root"), [*secure_etcd.identities, "agent-node-c"])
    assert report.changes == [
        "role kvgate-agent-node-c added",
        "role kvgate-agent-node-c: readwrite /kvgate/endpoints/node-c/* granted",
        "role kvgate-agent-node-c: read /kvgate/policy/* granted",
        "user agent-node-c added",
        "user agent-node-c: role kvgate-agent-node-c granted",
    ]
    # Only root may change auth once it is on.
    with pytest.raises(ETCD_ERRORS):
        await bootstrap(secure_etcd.settings("operator-alice"), ["agent-node-d"])


def test_bootstrap_cli_refuses_an_identity_with_no_business_in_etcd(
    secure_etcd: SecureEtcd, capsys: pytest.CaptureFixture[str]
) -> None:
    s = secure_etcd.settings("root")
    assert s.tls_ca and s.tls_cert and s.tls_key
    base = ["bootstrap", "--etcd", secure_etcd.server.address, "--tls-ca", s.tls_ca]
    base += ["--tls-cert", s.tls_cert, "--tls-key", s.tls_key]
    assert etcd_main([*base, "--identity", "engine-gpu0"]) == 2
    assert "has no business in etcd" in capsys.readouterr().err
    assert etcd_main([*base, *(a for i in secure_etcd.identities for a in ("--identity", i))]) == 0
    assert capsys.readouterr().out == "etcd already matches: nothing changed\n"


def _cli(secure: SecureEtcd, identity: str) -> list[str]:
    s = secure.settings(identity)
    assert s.tls_ca and s.tls_cert and s.tls_key
    return [
        "--etcd",
        secure.server.address,
        "--tls-ca",
        s.tls_ca,
        "--tls-cert",
        s.tls_cert,
        "--tls-key",
        s.tls_key,
    ]


def test_policy_cli_as_agent_is_refused_and_as_operator_audited(
    secure_etcd: SecureEtcd, capsys: pytest.CaptureFixture[str]
) -> None:
    assert policy_main(["set", "weights/queue", "4", *_cli(secure_etcd, "agent-node-a")]) == 1
    assert "permission denied" in capsys.readouterr().err.lower()
    assert policy_main(["set", "weights/queue", "4", *_cli(secure_etcd, "operator-alice")]) == 0
    out = capsys.readouterr()
    assert out.out == "weights/queue=4\n"
    # The audit line: identity, key, operation, revision; never the value.
    (line,) = out.err.splitlines()
    assert line.startswith("audit: by=operator-alice key=/kvgate/policy/weights/queue op=set revision=")
    revision = int(line.rsplit("=", 1)[1])
    raw = asyncio.run(_get(secure_etcd.settings("extproc"), "/kvgate/audit/policy/weights/queue"))
    assert raw is not None and json.loads(raw) == {"by": "operator-alice", "op": "set"}
    assert "4" not in raw.decode()

    async def audit_revision() -> int:
        client = await connect(secure_etcd.settings("extproc"))
        try:
            assert client.kv is not None
            response = await client.kv.get("/kvgate/audit/policy/weights/queue", timeout=5.0)
            return int(response.kvs[0].mod_revision)
        finally:
            await client.close()

    assert asyncio.run(audit_revision()) == revision


def test_history_and_rollback_restore_the_exact_previous_value(
    secure_etcd: SecureEtcd, capsys: pytest.CaptureFixture[str]
) -> None:
    op = _cli(secure_etcd, "operator-alice")
    first = '{"labels":{"pool":"a"},"profile":"default"}'
    assert policy_main(["set", "models/org/chat", first, *op]) == 0
    assert policy_main(["set", "models/org/chat", '{"labels": {"pool": "b"}}', *op]) == 0
    # A write that did not go through kvgate (etcdctl as root): in the history, with no author.
    asyncio.run(_raw_put(secure_etcd, "/kvgate/models/org/chat", b'{"labels":{"pool":"c"}}'))
    capsys.readouterr()

    assert policy_main(["history", "models/org/chat", *op]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].endswith('by ? (not written through kvgate)\tmodels/org/chat={"labels":{"pool":"c"}}')
    assert lines[1].endswith('by operator-alice (set)\tmodels/org/chat={"labels":{"pool":"b"}}')
    assert lines[2].endswith(f"by operator-alice (set)\tmodels/org/chat={first}")
    revisions = [int(line.split("\t")[0]) for line in lines]
    assert revisions == sorted(revisions, reverse=True)

    # Default: back to the value before the current one.
    assert policy_main(["rollback", "models/org/chat", *op]) == 0
    assert (
        asyncio.run(_get(secure_etcd.settings("extproc"), "/kvgate/models/org/chat"))
        == b'{"labels":{"pool":"b"}}'
    )
    # To a given revision: byte for byte the value it had then.
    assert policy_main(["rollback", "models/org/chat", "--revision", str(revisions[2]), *op]) == 0
    assert asyncio.run(_get(secure_etcd.settings("extproc"), "/kvgate/models/org/chat")) == first.encode()
    capsys.readouterr()
    assert policy_main(["history", "models/org/chat", "--limit", "1", *op]) == 0
    (top,) = capsys.readouterr().out.splitlines()
    assert f"by operator-alice (rollback) from revision {revisions[2]}" in top
    # An agent may not roll back.
    assert policy_main(["rollback", "models/org/chat", *_cli(secure_etcd, "agent-node-a")]) == 1


def test_a_rollback_to_a_value_that_no_longer_validates_is_refused(
    secure_etcd: SecureEtcd, capsys: pytest.CaptureFixture[str]
) -> None:
    op = _cli(secure_etcd, "operator-alice")
    asyncio.run(_raw_put(secure_etcd, "/kvgate/policy/weights/kv-tier", b'"heavy"'))  # never valid
    assert policy_main(["set", "weights/kv-tier", "2", *op]) == 0
    capsys.readouterr()
    assert policy_main(["rollback", "weights/kv-tier", *op]) == 2
    assert "no longer validates, nothing written" in capsys.readouterr().err
    assert asyncio.run(_get(secure_etcd.settings("extproc"), "/kvgate/policy/weights/kv-tier")) == b"2"


def test_tenants_history_and_rollback(secure_etcd: SecureEtcd, capsys: pytest.CaptureFixture[str]) -> None:
    op = _cli(secure_etcd, "operator-alice")
    assert policy_main(["set", "tenants/acme2", '{"models": ["*"]}', *op]) == 0
    assert policy_main(["unset", "tenants/acme2", *op]) == 0
    capsys.readouterr()
    assert policy_main(["history", "tenants/acme2", *op]) == 0
    newest, oldest = capsys.readouterr().out.splitlines()
    assert "by operator-alice (unset)\ttenants/acme2=(unset)" in newest
    assert 'by operator-alice (set)\ttenants/acme2={"models":["*"]}' in oldest
    assert policy_main(["rollback", "tenants/acme2", *op]) == 0  # back from deleted
    assert asyncio.run(_get(secure_etcd.settings("extproc"), "/kvgate/tenants/acme2")) == b'{"models":["*"]}'


async def _raw_put(secure: SecureEtcd, key: str, value: bytes) -> None:
    client = await connect(secure.settings("root"))
    try:
        assert client.kv is not None
        await client.kv.put(key, value, timeout=5.0)
    finally:
        await client.close()


def test_audit_records_hold_no_values() -> None:
    record = audit.Record("operator-alice", "rollback", 41)
    assert json.loads(audit.encode_record(record)) == {"by": "operator-alice", "op": "rollback", "from": 41}
    assert audit.decode_record(audit.encode_record(record)) == record
    assert audit.decode_record(b"not json") is None
    assert audit.audit_key("/kvgate/", "/kvgate/models/org/chat") == "/kvgate/audit/models/org/chat"
    line = audit.log_line(record, "/kvgate/tenants/acme", 42)
    assert line == "audit: by=operator-alice key=/kvgate/tenants/acme op=rollback revision=42 restored=41"


def test_the_gateway_logs_each_audit_record_it_sees_live(caplog: pytest.LogCaptureFixture) -> None:
    from contracts.etcd import Change
    from extproc.control.plane import ControlCore
    from extproc.control.policy import PolicyStore
    from extproc.fleet import Fleet

    core = ControlCore("/kvgate/", Fleet([]), PolicyStore())
    record = audit.encode_record(audit.Record("operator-alice", "set"))
    caplog.set_level("INFO", logger="kvgate.audit")
    core.snapshot([("/kvgate/audit/policy/weights/queue", record)], 7)  # a resync: old news, not logged
    assert not caplog.records
    core.apply(
        [
            Change("/kvgate/policy/weights/queue", b"4"),
            Change("/kvgate/audit/policy/weights/queue", record + b" "),
        ],
        9,
    )
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == "audit: by=operator-alice key=/kvgate/policy/weights/queue op=set revision=9"
    assert core.store.policy.weight("queue") == 4.0


async def test_the_shared_agent_identity_writes_endpoints_and_no_policy(secure_etcd: SecureEtcd) -> None:
    p, shared = secure_etcd.prefix, secure_etcd.settings("agent")
    assert await _put(shared, endpoint_key(p, "vllm-0", "kvgate-model-server-7f9c-x2"), b"{}")
    for family in ("policy/weights/prefix", "tenants/acme", "models/m", "drain/vllm-0"):
        assert not await _put(shared, p + family, b"1"), family


def test_kvgate_policy_uses_the_operator_certificate_of_the_running_stack(
    secure_etcd: SecureEtcd,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No --etcd and no --tls-*: the etcd and the operator's files that `kvgate up --etcd-auth` published."""
    import os

    from kvgate.dev import stackfile
    from kvgate.dev.stackfile import StackInfo

    monkeypatch.setenv(stackfile.STATE_DIR_ENV, str(tmp_path / "state"))
    monkeypatch.delenv("KVGATE_ETCD", raising=False)
    s = secure_etcd.settings("operator-alice")
    assert s.tls_ca and s.tls_cert and s.tls_key
    info = StackInfo(
        pid=os.getpid(),
        started=stackfile.process_started(os.getpid()),
        url="http://127.0.0.1:8080",
        admin_url="http://127.0.0.1:9901",
        metrics_url=None,
        etcd=secure_etcd.server.address,
        workdir=str(tmp_path),
        models=(),
        engines={},
        logs={},
        etcd_tls={"tls_ca": s.tls_ca, "tls_cert": s.tls_cert, "tls_key": s.tls_key},
    )
    stackfile.write(stackfile.pointer_path(), info)
    assert StackInfo.from_json(info.to_json(), "stack.json") == info
    assert policy_main(["set", "weights/in-flight", "2"]) == 0
    assert "audit: by=operator-alice key=/kvgate/policy/weights/in-flight op=set" in capsys.readouterr().err
