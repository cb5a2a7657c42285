"""End to end with etcd security: ``kvgate up --agents 2 --kvcached --etcd-auth`` (etcd with TLS
client-certificate auth and kvgate's RBAC; agents, kvcached daemons, the ext_proc and the operator each
with their own certificate)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from contracts.etcd import EtcdSettings, endpoint_key
from kvgate.dev.up import Stack, StackOptions
from kvgate.policy_cli import main as policy_main
from runtime.etcd import ETCD_ERRORS, connect
from tests.e2e.conftest import FAST_SIM
from tests.e2e.test_agents import chat, healthy_gauges
from tests.polling import poll

pytestmark = pytest.mark.e2e
PREFIX = "/kvgate/"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(
        agents=2,
        agent_args=FAST_SIM,
        lease_ttl_s=2,
        port=0,
        etcd_auth=True,
        kvcached=True,
        workdir=tmp_path_factory.mktemp("etcd-auth"),
    )
    with Stack(options) as running:
        poll(lambda: True if len(healthy_gauges(running)) == 2 else None, 10, "2 endpoints in the ext_proc")
        yield running


def _settings(stack: Stack, identity: str) -> EtcdSettings:
    assert stack.etcd is not None
    tls = stack.etcd_tls(identity)
    return EtcdSettings(endpoints=(stack.etcd.address,), timeout_s=5.0, **tls)


def _flags(stack: Stack, identity: str) -> list[str]:
    assert stack.etcd is not None
    tls = stack.etcd_tls(identity)
    flags = ["--etcd", stack.etcd.address]
    for name in ("tls_ca", "tls_cert", "tls_key"):
        flags += [f"--{name.replace('_', '-')}", tls[name]]
    return flags


def test_agents_register_under_their_node_and_the_gateway_routes(stack: Stack) -> None:
    async def keys() -> list[str]:
        client = await connect(_settings(stack, "extproc"))
        try:
            assert client.kv is not None
            got = await client.kv.get(
                f"{PREFIX}endpoints/", f"{PREFIX}endpoints0", keys_only=True, timeout=5.0
            )
            return sorted(bytes(kv.key).decode() for kv in got.kvs)
        finally:
            await client.close()

    assert asyncio.run(keys()) == [
        endpoint_key(PREFIX, "sim-0", "node-0"),
        endpoint_key(PREFIX, "sim-1", "node-1"),
    ]
    assert chat(stack, "Hello through an etcd with RBAC.") in {"sim-0-0", "sim-1-0"}


def test_without_a_certificate_etcd_refuses(stack: Stack) -> None:
    async def anonymous() -> None:
        settings = _settings(stack, "extproc")
        client = await connect(
            EtcdSettings(endpoints=settings.endpoints, tls_ca=settings.tls_ca, timeout_s=2.0)
        )
        try:
            assert client.kv is not None
            await client.kv.get(PREFIX, timeout=2.0, max_attempts=1)
        finally:
            await client.close()

    with pytest.raises(ETCD_ERRORS):
        asyncio.run(anonymous())


def test_only_the_operator_changes_policy(stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    assert policy_main(["set", "weights/queue", "2", *_flags(stack, "agent-node-0")]) == 1
    assert "permission denied" in capsys.readouterr().err.lower()
    assert policy_main(["set", "weights/queue", "2", *_flags(stack, "extproc")]) == 1
    capsys.readouterr()
    assert policy_main(["set", "weights/queue", "2", *_flags(stack, "operator")]) == 0
    assert "audit: by=operator key=/kvgate/policy/weights/queue op=set" in capsys.readouterr().err
    assert policy_main(["history", "weights/queue", *_flags(stack, "operator")]) == 0
    assert "by operator (set)\tweights/queue=2" in capsys.readouterr().out
