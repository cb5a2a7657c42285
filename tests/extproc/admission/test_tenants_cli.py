"""kvgate policy set|get|unset|list tenants/<id>: validated before any write, against a real etcd (the
policy CLI's own tests are tests/kvgate/test_policy_cli.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from contracts.etcd import EtcdSettings, tenant_key
from kvgate.dev.etcd import EtcdServer
from kvgate.policy_cli import main
from runtime.etcd import connect

pytest_plugins = ("tests.etcd_fixtures",)


def _read(settings: EtcdSettings, key: str) -> bytes | None:
    async def read() -> bytes | None:
        client = await connect(settings)
        try:
            assert client.kv is not None
            response = await client.kv.get(key, timeout=2.0)
            return bytes(response.kvs[0].value) if response.kvs else None
        finally:
            await client.close()

    return asyncio.run(read())


@pytest.fixture
def etcd_args(etcd_server: EtcdServer, etcd_prefix: str) -> list[str]:
    return ["--etcd", etcd_server.address, "--prefix", etcd_prefix]


def test_set_get_list_unset_a_tenant(
    etcd_args: list[str], etcd_settings: EtcdSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tenant_key(etcd_settings.prefix, "acme")
    assert main(["set", "tenants/acme", '{"models": ["*"], "tokens": {"per_minute": 60}}', *etcd_args]) == 0
    stored = '{"models":["*"],"tokens":{"per_minute":60}}'
    assert capsys.readouterr().out == f"tenants/acme={stored}\n"
    assert _read(etcd_settings, key) == stored.encode()

    assert main(["get", "tenants/acme", *etcd_args]) == 0
    assert capsys.readouterr().out == f"{stored}\n"
    assert main(["list", *etcd_args]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"tenants/acme={stored}" and "weights/prefix=3.0" in lines

    assert main(["unset", "tenants/acme", *etcd_args]) == 0
    assert _read(etcd_settings, key) is None
    assert main(["get", "tenants/acme", *etcd_args]) == 2
    assert "no such tenant" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ('{"models": "m"}', "tenants/acme.models"),
        ('{"id": "other", "models": ["m"]}', "does not match the key"),
        ('{"models": ["m"], "tokens": {"per_minute": 0}}', "tenants/acme.tokens.per_minute"),
    ],
)
def test_a_bad_tenant_exits_2_and_writes_nothing(
    value: str,
    reason: str,
    etcd_args: list[str],
    etcd_settings: EtcdSettings,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["set", "tenants/acme", value, *etcd_args]) == 2
    captured = capsys.readouterr()
    assert reason in captured.err and captured.out == ""
    assert _read(etcd_settings, tenant_key(etcd_settings.prefix, "acme")) is None


def test_tenants_are_not_for_policy_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["set", "tenants/acme", '{"models": ["m"]}', "--file", str(tmp_path / "p.toml")]) == 2
    assert "live in etcd" in capsys.readouterr().err
    assert not (tmp_path / "p.toml").exists()
