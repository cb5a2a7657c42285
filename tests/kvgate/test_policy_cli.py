"""kvgate policy get|set|unset|list|watch (policy paths and tenants/<id>) and kvgate drain, against a real
etcd and on a policy file."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from contracts.etcd import EtcdSettings, tenant_key
from kvgate.dev import stackfile
from kvgate.dev.etcd import EtcdServer
from kvgate.dev.stackfile import StackInfo
from kvgate.policy_cli import drain_main, main
from runtime.etcd import connect

pytest_plugins = ("tests.etcd_fixtures",)

ROOT = Path(__file__).resolve().parents[2]


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


def test_set_get_list_unset(
    etcd_args: list[str], etcd_settings: EtcdSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    p = etcd_settings.prefix
    assert main(["set", "weights/prefix", "5", *etcd_args]) == 0
    assert capsys.readouterr().out == "weights/prefix=5\n"
    assert _read(etcd_settings, f"{p}policy/weights/prefix") == b"5"

    assert main(["get", "weights/prefix", *etcd_args]) == 0
    assert capsys.readouterr().out == "5.0\n"
    assert main(["set", "models/org/m", '{"labels": {"pool": "a"}}', *etcd_args]) == 0
    assert _read(etcd_settings, f"{p}models/org/m") == b'{"labels":{"pool":"a"}}'
    capsys.readouterr()

    assert main(["list", *etcd_args]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "weights/prefix=5.0" in lines and "index/block_size=16" in lines
    assert 'models/org/m={"labels":{"pool":"a"},"profile":null}' in lines
    assert "plugins/load-threshold/max_waiting=8.0" in lines

    assert main(["unset", "weights/prefix", *etcd_args]) == 0
    assert main(["get", "weights/prefix", *etcd_args]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "3.0"  # the embedded default again


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["set", "weights/prefix", "-1"], "must be finite and >= 0"),
        (["set", "weights/prefix", "heavy"], "expected a number, got str"),
        (["set", "plugins/load-threshold/max_wait", "3"], "has no param 'max_wait'"),
        (["set", "models/m", '{"profile": "nope"}'], "no profile named 'nope'"),
        (["get", "weights/nope"], "no scorer named 'nope'"),
    ],
)
def test_bad_values_exit_2_and_write_nothing(
    argv: list[str],
    reason: str,
    etcd_args: list[str],
    etcd_settings: EtcdSettings,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*argv, *etcd_args]) == 2
    captured = capsys.readouterr()
    assert reason in captured.err and captured.out == ""
    key = f"{etcd_settings.prefix}{'models' if argv[1].startswith('models/') else 'policy'}/"
    key += argv[1].removeprefix("models/")
    assert _read(etcd_settings, key) is None


def test_flow_and_objectives_through_etcd(
    etcd_args: list[str], etcd_settings: EtcdSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    """flow/... lives under policy/, objectives/<name> in its own family; a bad value exits 2, writes
    nothing, and the value in force stays; one written past the CLI is refused by readers."""
    p = etcd_settings.prefix
    assert main(["set", "flow/saturation", '{"max_waiting": 8}', *etcd_args]) == 0
    assert _read(etcd_settings, f"{p}policy/flow/saturation") == b'{"max_waiting":8}'
    assert main(["set", "objectives/team/chat", '{"priority": 2, "ttft_ms": 500}', *etcd_args]) == 0
    assert _read(etcd_settings, f"{p}objectives/team/chat") == b'{"priority":2,"ttft_ms":500}'
    assert main(["set", "flow/fairness", "requests", *etcd_args]) == 0
    capsys.readouterr()

    for argv, reason in [
        (["set", "flow/saturation", '{"max_waiting": -1}'], "max_waiting: must be finite and >= 0"),
        (["set", "objectives/team/chat", '{"priority": "high"}'], "priority: expected an integer"),
        (["set", "flow/fairness", "bytes"], "expected one of tokens, requests"),
        (["set", "flow/bands/high", "{}"], "a band is named by its priority"),
        (["get", "flow/queue"], "unknown policy path 'flow/queue'"),
    ]:
        assert main([*argv, *etcd_args]) == 2
        captured = capsys.readouterr()
        assert reason in captured.err and captured.out == "", argv
    assert _read(etcd_settings, f"{p}policy/flow/saturation") == b'{"max_waiting":8}'
    assert _read(etcd_settings, f"{p}objectives/team/chat") == b'{"priority":2,"ttft_ms":500}'
    assert _read(etcd_settings, f"{p}policy/flow/fairness") == b'"requests"'
    assert _read(etcd_settings, f"{p}policy/flow/bands/high") is None

    _put(etcd_settings, f"{p}objectives/team/chat", b'{"priority": 1.5}')  # past the CLI's check
    assert main(["get", "objectives/team/chat", *etcd_args]) == 0
    captured = capsys.readouterr()
    assert captured.out == "null\n" and "refused" in captured.err  # never a good value: undefined

    assert main(["list", *etcd_args]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert 'flow/saturation={"max_in_flight":null,"max_kv_usage":null,"max_waiting":8.0}' in lines
    assert 'flow/fairness="requests"' in lines and "flow/retry_after_s=1" in lines
    assert main(["unset", "flow/fairness", *etcd_args]) == 0
    assert main(["get", "flow/fairness", *etcd_args]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == '"tokens"'


def test_get_shows_the_default_over_a_refused_etcd_value(
    etcd_args: list[str], etcd_settings: EtcdSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    async def write() -> None:
        client = await connect(etcd_settings)
        assert client.kv is not None
        await client.kv.put(f"{etcd_settings.prefix}policy/weights/queue", b'"lots"')
        await client.close()

    asyncio.run(write())
    assert main(["get", "weights/queue", *etcd_args]) == 0
    captured = capsys.readouterr()
    assert captured.out == "2.0\n" and "refused" in captured.err


def test_etcd_from_environment(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("KVGATE_ETCD", etcd_server.address)
    assert main(["get", "index/block_size", "--prefix", etcd_prefix]) == 0
    assert capsys.readouterr().out == "16\n"


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where `kvgate up` publishes its stack.json, for this test only; no $KVGATE_ETCD."""
    monkeypatch.setenv(stackfile.STATE_DIR_ENV, str(tmp_path / "state"))
    monkeypatch.delenv("KVGATE_ETCD", raising=False)
    return tmp_path / "state"


def _publish(etcd: str | None, pid: int | None = None) -> None:
    """A stack.json as a running `kvgate up` (this process, or ``pid``) publishes it."""
    pid = os.getpid() if pid is None else pid
    info = StackInfo(
        pid=pid,
        started=stackfile.process_started(pid),
        url="http://127.0.0.1:8080",
        admin_url="http://127.0.0.1:9901",
        metrics_url=None,
        etcd=etcd,
        workdir="/tmp/w",
        models=(),
        engines={},
        logs={},
    )
    stackfile.write(stackfile.pointer_path(), info)


def test_etcd_of_the_running_kvgate_up(
    state_dir: Path,
    etcd_server: EtcdServer,
    etcd_settings: EtcdSettings,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No --etcd, no $KVGATE_ETCD: the commands use the etcd of the local `kvgate up --agents N`."""
    _publish(etcd_server.address)
    p = etcd_settings.prefix
    assert main(["set", "weights/prefix", "5", "--prefix", p]) == 0
    assert _read(etcd_settings, f"{p}policy/weights/prefix") == b"5"
    assert main(["get", "weights/prefix", "--prefix", p]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "5.0"
    _put(etcd_settings, f"{p}endpoints/sim-0", b"{}")
    assert drain_main(["sim-0", "--prefix", p]) == 0
    assert _read(etcd_settings, f"{p}drain/sim-0") is not None


def test_without_etcd_nor_kvgate_up_the_error_names_the_flag(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvgate policy: no etcd given and no running kvgate up found (")
    assert "pass --etcd HOST:PORT" in err
    assert drain_main(["sim-0"]) == 2
    assert "pass --etcd HOST:PORT" in capsys.readouterr().err


def test_a_killed_kvgate_ups_pointer_is_ignored_and_said(
    state_dir: Path, etcd_server: EtcdServer, capsys: pytest.CaptureFixture[str]
) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    _publish(etcd_server.address, pid=int(gone.stdout))
    assert main(["list"]) == 2
    err = capsys.readouterr().err
    assert f"is stale: the kvgate up that wrote it (pid {int(gone.stdout)}) is not running" in err
    assert "pass --etcd HOST:PORT" in err


def test_a_kvgate_up_without_agents_has_no_etcd(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _publish(None)
    assert drain_main(["sim-0"]) == 2
    err = capsys.readouterr().err
    assert "the running kvgate up (pid" in err and "has none (start it with --agents N)" in err


def test_unreachable_etcd_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--etcd", "127.0.0.1:1", "--timeout", "0.5"]) == 1
    assert "etcd at 127.0.0.1:1: " in capsys.readouterr().err


def _put(settings: EtcdSettings, key: str, value: bytes) -> None:
    async def write() -> None:
        client = await connect(settings)
        try:
            assert client.kv is not None
            await client.kv.put(key, value, timeout=2.0)
        finally:
            await client.close()

    asyncio.run(write())


def test_drain_and_undo(
    etcd_server: EtcdServer, etcd_settings: EtcdSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--etcd", etcd_server.address, "--prefix", etcd_settings.prefix]
    key = f"{etcd_settings.prefix}drain/vllm-0"
    _put(etcd_settings, f"{etcd_settings.prefix}endpoints/vllm-0", b"{}")
    assert drain_main(["vllm-0", "--by", "ops", *args]) == 0
    captured = capsys.readouterr()
    assert "vllm-0 draining" in captured.out and captured.err == ""
    value = _read(etcd_settings, key)
    assert value is not None and json.loads(value)["by"] == "ops"
    assert drain_main(["vllm-0", "--undo", *args]) == 0
    assert "no longer draining" in capsys.readouterr().out
    assert _read(etcd_settings, key) is None
    assert drain_main(["vllm-0", "--undo", *args]) == 0
    assert "was not draining" in capsys.readouterr().out


def test_drain_of_an_unknown_id_is_refused_and_writes_nothing(
    etcd_server: EtcdServer, etcd_settings: EtcdSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--etcd", etcd_server.address, "--prefix", etcd_settings.prefix]
    for endpoint in ("sim-1", "sim-0"):
        _put(etcd_settings, f"{etcd_settings.prefix}endpoints/{endpoint}", b"{}")
    assert drain_main(["sim-9", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    refused = "no endpoint 'sim-9' is registered in etcd (registered: sim-0, sim-1); nothing written"
    assert refused in captured.err
    assert _read(etcd_settings, f"{etcd_settings.prefix}drain/sim-9") is None
    # A static endpoint of a gateway config is drained through etcd too: --force says so.
    assert drain_main(["sim-9", "--force", *args]) == 0
    assert _read(etcd_settings, f"{etcd_settings.prefix}drain/sim-9") is not None


def test_watch_once_prints_the_first_change(etcd_args: list[str]) -> None:
    argv = [sys.executable, "-m", "kvgate.cli", "policy", "watch", "--once", *etcd_args]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        banner = proc.stderr.readline()
        assert banner.startswith("watching "), banner
        assert main(["set", "plugins/load-threshold/max_waiting", "16", *etcd_args]) == 0
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert out == "plugins/load-threshold/max_waiting=16\n"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)


# -- --file mode ----------------------------------------------------------------------------------------


def test_file_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "policy.toml"
    file = ["--file", str(path)]
    assert main(["get", "weights/prefix", *file]) == 1  # no file yet
    assert "cannot read" in capsys.readouterr().err

    assert main(["set", "weights/prefix", "4.5", *file]) == 0
    assert main(["set", "models/org/m", '{"labels": {"pool": "a"}}', *file]) == 0
    text = path.read_text()
    assert "[weights]\nprefix = 4.5\n" in text
    before = path.read_bytes()
    capsys.readouterr()

    assert main(["set", "weights/prefix", "-4", *file]) == 2
    assert "must be finite and >= 0" in capsys.readouterr().err
    assert path.read_bytes() == before  # nothing written

    assert main(["get", "weights/prefix", *file]) == 0
    assert capsys.readouterr().out == "4.5\n"
    assert main(["list", *file]) == 0
    assert 'models/org/m={"labels":{"pool":"a"},"profile":null}' in capsys.readouterr().out.splitlines()
    assert main(["unset", "weights/prefix", *file]) == 0
    assert main(["get", "weights/prefix", *file]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "3.0"


def test_file_mode_flow_and_objectives(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "policy.toml"
    file = ["--file", str(path)]
    assert main(["set", "flow/models/org/m", '{"roles": {"prefill": {"max_in_flight": 2}}}', *file]) == 0
    assert main(["set", "flow/bands/-1", '{"max_requests": 64}', *file]) == 0
    assert main(["set", "objectives/interactive", '{"priority": 1, "ttft_ms": 500}', *file]) == 0
    text = path.read_text()
    assert '[flow.models."org/m".roles.prefill]\nmax_in_flight = 2\n' in text
    assert "[flow.bands.-1]\nmax_requests = 64\n" in text
    assert "[objectives.interactive]\npriority = 1\nttft_ms = 500\n" in text
    before = path.read_bytes()
    capsys.readouterr()

    assert main(["set", "objectives/interactive", '{"priority": 1, "ttft_ms": 0}', *file]) == 2
    assert "ttft_ms: must be finite and >= 1" in capsys.readouterr().err
    assert path.read_bytes() == before  # nothing written, the old value stays

    assert main(["list", *file]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        'flow/models/org/m={"roles":{"prefill":{"max_in_flight":2.0,"max_kv_usage":null,'
        '"max_waiting":null}}}' in lines
    )
    assert 'objectives/interactive={"priority":1,"tpot_ms":null,"ttft_ms":500.0}' in lines
    assert 'flow/bands/-1={"headroom":0.0,"max_bytes":268435456,"max_requests":64,"max_wait_s":60.0}' in lines


def test_file_mode_defaults_from_a_gateway_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text("[index]\nblock_size = 32\n[flow]\nwaiting_room_s = 5\n[objectives.chat]\npriority = 3")
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"weights": {"queue": 1.5}, "flow": {"retry_after_s": 2}}))
    assert main(["list", "--file", str(policy), "--config", str(config)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "index/block_size=32" in lines and "weights/queue=1.5" in lines
    assert "flow/waiting_room_s=5.0" in lines and "flow/retry_after_s=2" in lines
    assert 'objectives/chat={"priority":3,"tpot_ms":null,"ttft_ms":null}' in lines


def test_file_mode_refuses_an_invalid_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "policy.toml"
    path.write_text("[weights]\nprefix = -1\n")
    assert main(["set", "weights/queue", "1", "--file", str(path)]) == 2
    assert "weights/prefix" in capsys.readouterr().err
    assert path.read_text() == "[weights]\nprefix = -1\n"


def test_watch_needs_etcd() -> None:
    with pytest.raises(SystemExit) as info:
        main(["watch", "--file", "policy.toml"])
    assert info.value.code == 2


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


LINK = (
    '{"ingress": "10.1.0.5:10443", "service": "10.1.0.5:9500", "identity": "spiffe://kvgate.local/federation-eu",'
    ' "rtt_ms": 20, "egress_requests_per_s": 10, "egress_bytes_per_s": 1000000}'
)


def test_set_get_unset_a_federation_link_validated_first(
    etcd_args: list[str], etcd_settings: EtcdSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    key = f"{etcd_settings.prefix}federation/eu"
    assert main(["set", "federation/eu", LINK, *etcd_args]) == 0
    capsys.readouterr()
    assert _read(etcd_settings, key) is not None
    assert main(["get", "federation/eu", *etcd_args]) == 0
    assert "10.1.0.5:10443" in capsys.readouterr().out
    bad = LINK.replace('"rtt_ms": 20', '"rtt_ms": -1')
    assert main(["set", "federation/eu", bad, *etcd_args]) == 2
    assert "rtt_ms" in capsys.readouterr().err
    assert main(["set", "federation/eu", "[1", *etcd_args]) == 2
    assert b'"rtt_ms":20' in (_read(etcd_settings, key) or b"")  # the good one stays
    assert main(["unset", "federation/eu", *etcd_args]) == 0
    assert main(["get", "federation/eu", *etcd_args]) == 2
    assert "no such link" in capsys.readouterr().err


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


HUGE = "1" + "0" * 400  # an integer too large for a float


def test_a_number_too_large_is_refused_and_one_in_etcd_is_shown_refused(
    etcd_args: list[str], etcd_settings: EtcdSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    p = etcd_settings.prefix
    assert main(["set", "weights/queue", HUGE, *etcd_args]) == 2  # was an OverflowError stack trace
    assert "weights/queue: must be finite" in capsys.readouterr().err
    assert _read(etcd_settings, f"{p}policy/weights/queue") is None
    _put(etcd_settings, f"{p}policy/weights/queue", HUGE.encode())  # written around the CLI
    for argv in (["get", "weights/queue"], ["list"], ["set", "weights/prefix", "4"]):
        assert main([*argv, *etcd_args]) == 0
    captured = capsys.readouterr()
    assert "weights/queue=2.0" in captured.out and "refused" in captured.err
    assert _read(etcd_settings, f"{p}policy/weights/prefix") == b"4"


def test_set_and_unset_are_checked_against_the_whole_resulting_policy(
    etcd_args: list[str], etcd_settings: EtcdSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    p = etcd_settings.prefix
    local, peer = f"{p}policy/plugins/kv-tier/local", f"{p}policy/plugins/kv-tier/peer"
    assert main(["set", "plugins/kv-tier/local", "0.9", *etcd_args]) == 0
    assert main(["set", "plugins/kv-tier/peer", "0.6", *etcd_args]) == 0
    capsys.readouterr()
    # unset was never validated: peer=0.6 alone breaks the default local (0.5), a gateway would refuse it
    assert main(["unset", "plugins/kv-tier/local", *etcd_args]) == 2
    err = capsys.readouterr().err
    assert "without plugins/kv-tier/local would not be valid" in err and "nothing written" in err
    assert _read(etcd_settings, local) == b"0.9"
    # a set the sorted one-key-at-a-time load accepted (local=0.2 refused alone, then peer checked
    # against the default local): the whole set {local 0.2, peer 0.3} is not valid
    _put(etcd_settings, local, b"0.2")
    _put(etcd_settings, peer, b"0.1")
    assert main(["set", "plugins/kv-tier/peer", "0.3", *etcd_args]) == 2
    assert "would not be valid" in capsys.readouterr().err
    assert _read(etcd_settings, peer) == b"0.1"
    assert main(["get", "plugins/kv-tier/local", *etcd_args]) == 0  # the set {0.2, 0.1} is valid
    assert capsys.readouterr().out == "0.2\n"


def test_a_rollback_to_an_unset_state_is_checked(
    etcd_args: list[str], etcd_settings: EtcdSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    p = etcd_settings.prefix
    assert main(["set", "plugins/kv-tier/local", "0.9", *etcd_args]) == 0
    assert main(["set", "plugins/kv-tier/peer", "0.6", *etcd_args]) == 0
    assert main(["set", "plugins/kv-tier/local", "0.8", *etcd_args]) == 0
    capsys.readouterr()
    assert main(["history", "plugins/kv-tier/local", *etcd_args]) == 0
    first = int(capsys.readouterr().out.splitlines()[-1].split("\t")[0])
    # back to before local existed: a removal, which would leave peer=0.6 over the default local 0.5
    assert main(["rollback", "plugins/kv-tier/local", "--revision", str(first - 1), *etcd_args]) == 2
    assert "its removal no longer validates, nothing written" in capsys.readouterr().err
    assert _read(etcd_settings, f"{p}policy/plugins/kv-tier/local") == b"0.8"
    assert main(["rollback", "plugins/kv-tier/local", *etcd_args]) == 0  # to 0.9: valid
    assert _read(etcd_settings, f"{p}policy/plugins/kv-tier/local") == b"0.9"


def test_file_mode_unset_is_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "policy.toml"
    path.write_text("[plugins.kv-tier]\nlocal = 0.9\npeer = 0.6\n")
    before = path.read_bytes()
    assert main(["unset", "plugins/kv-tier/local", "--file", str(path)]) == 2
    assert "cannot be unset, nothing written" in capsys.readouterr().err
    assert path.read_bytes() == before


def test_a_config_error_inside_the_run_exits_2_with_its_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "nonexist")
    assert main(["list", "--etcd", "127.0.0.1:1", "--tls-ca", missing]) == 2
    assert f"etcd tls_ca {missing}" in capsys.readouterr().err
    assert drain_main(["e", "--etcd", "127.0.0.1:1", "--tls-ca", missing]) == 2
    assert f"etcd tls_ca {missing}" in capsys.readouterr().err
    config = tmp_path / "gateway.toml"
    config.write_text("not toml [")
    argv = ["rollback", "burst/hosted", "--config", str(config), "--etcd", "127.0.0.1:1", "--timeout", "0.5"]
    assert main(argv) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_a_rollback_to_a_compacted_revision_is_refused_not_a_delete(
    etcd_outage_server: EtcdServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """etcd no longer knows the value at a compacted revision: that is not "absent then" (a delete)."""
    settings = EtcdSettings(endpoints=(etcd_outage_server.address,), prefix="/kvgate/", timeout_s=2.0)
    args = ["--etcd", etcd_outage_server.address]
    assert main(["set", "weights/prefix", "1", *args]) == 0
    assert main(["set", "weights/prefix", "2", *args]) == 0
    capsys.readouterr()
    assert main(["history", "weights/prefix", *args]) == 0
    first = int(capsys.readouterr().out.splitlines()[-1].split("\t")[0])

    async def compact() -> None:
        client = await connect(settings)
        try:
            assert client.kv is not None
            now = (await client.kv.get("/kvgate/", timeout=2.0)).header.revision
            await client.kv.compact(int(now), physical=True, timeout=5.0)
        finally:
            await client.close()

    asyncio.run(compact())
    assert main(["rollback", "weights/prefix", "--revision", str(first), *args]) == 2
    err = capsys.readouterr().err
    assert f"revision {first} is compacted" in err and "nothing written" in err
    assert _read(settings, "/kvgate/policy/weights/prefix") == b"2"
    assert main(["rollback", "weights/prefix", "--revision", "0", *args]) == 2  # etcd's 0 is "now"
    assert "--revision must be at least 1" in capsys.readouterr().err


def test_file_mode_keeps_the_files_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The gateway reading the file may run as another user (deploy/systemd: User=kvgate): a set must not
    leave it 0600 (the temporary file's mode)."""
    path = tmp_path / "policy.toml"
    path.write_text("[weights]\nprefix = 2.0\n")
    path.chmod(0o640)
    assert main(["set", "weights/prefix", "3", "--file", str(path)]) == 0
    assert path.stat().st_mode & 0o777 == 0o640
    assert main(["unset", "weights/prefix", "--file", str(path)]) == 0
    assert path.stat().st_mode & 0o777 == 0o640
    new = tmp_path / "new.json"
    assert main(["set", "weights/prefix", "3", "--file", str(new)]) == 0
    assert new.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("command", ["policy", "drain"])
def test_ctrl_c_while_etcd_does_not_answer_exits_130_without_a_traceback(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(coro: object) -> int:
        coro.close()  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    monkeypatch.setattr(asyncio, "run", interrupted)
    args = ["--etcd", "127.0.0.1:1"]
    assert (main(["list", *args]) if command == "policy" else drain_main(["e", *args])) == 130
    assert capsys.readouterr().err == ""


def test_a_set_checked_against_values_changed_meanwhile_writes_nothing(
    etcd_args: list[str],
    etcd_settings: EtcdSettings,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two operators at once: each value is valid with what its command read, not with the other's. The
    second write must not land on a policy it was not checked against."""
    import threading

    import kvgate.policy_cli as policy_cli

    p = etcd_settings.prefix
    assert main(["set", "plugins/kv-tier/local", "0.9", *etcd_args]) == 0
    checked = policy_cli._check_write
    raced: list[int] = []

    def check_then_race(*args: object) -> None:
        checked(*args)  # type: ignore[arg-type]
        if not raced:  # another operator's set lands between this check and this write
            raced.append(0)
            other = threading.Thread(
                target=lambda: raced.append(main(["set", "plugins/kv-tier/local", "0.7", *etcd_args]))
            )
            other.start()
            other.join()

    monkeypatch.setattr(policy_cli, "_check_write", check_then_race)
    capsys.readouterr()
    assert main(["set", "plugins/kv-tier/peer", "0.8", *etcd_args]) == 1  # valid with local 0.9 only
    assert raced == [0, 0]
    assert "changed while" in capsys.readouterr().err
    assert _read(etcd_settings, f"{p}policy/plugins/kv-tier/peer") is None
    assert _read(etcd_settings, f"{p}policy/plugins/kv-tier/local") == b"0.7"
