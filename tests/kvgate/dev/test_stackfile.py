"""The published `kvgate up`: where its pointer lives, and how a reader tells a live one from a stale one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from contracts.errors import ConfigError
from kvgate.dev import stackfile
from kvgate.dev.stackfile import StackInfo, StackNotRunning, find_running, pointer_path, withdraw

ME = StackInfo(
    pid=os.getpid(),
    started=stackfile.process_started(os.getpid()),
    url="http://127.0.0.1:8080",
    admin_url="http://127.0.0.1:9901",
    metrics_url="http://127.0.0.1:9090/metrics",
    etcd="127.0.0.1:2379",
    workdir="/tmp/w",
    models=("SmolLM2-135M-Instruct",),
    engines={"sim-0": "127.0.0.1:8001"},
    logs={"sim": "/tmp/w/sim.log"},
)


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(stackfile.STATE_DIR_ENV, str(tmp_path / "state"))
    return tmp_path / "state"


def test_where_the_pointer_lives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert pointer_path() == tmp_path / "state" / "stack.json"
    monkeypatch.delenv(stackfile.STATE_DIR_ENV)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert pointer_path() == tmp_path / "xdg" / "kvgate" / "stack.json"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert pointer_path() == tmp_path / "home" / ".local" / "state" / "kvgate" / "stack.json"


def test_a_live_launcher_is_found(state_dir: Path) -> None:
    stackfile.write(pointer_path(), ME)
    assert find_running() == ME
    assert ME.started > 0  # Linux: the start time tells a reused PID apart


def test_without_a_pointer(state_dir: Path) -> None:
    with pytest.raises(StackNotRunning, match=r"no running kvgate up found \(.*stack\.json does not exist\)"):
        find_running()


def test_a_killed_launchers_pointer_is_stale() -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    pid = int(gone.stdout)
    stackfile.write(pointer_path(), replace(ME, pid=pid))
    with pytest.raises(StackNotRunning, match=rf"is stale: the kvgate up that wrote it \(pid {pid}\)"):
        find_running()


def test_a_reused_pid_is_not_taken_for_the_launcher() -> None:
    stackfile.write(pointer_path(), replace(ME, started=ME.started + 1))
    with pytest.raises(StackNotRunning, match="is stale"):
        find_running()


def test_a_malformed_pointer_is_ignored_with_the_reason(state_dir: Path) -> None:
    state_dir.mkdir(parents=True)
    pointer_path().write_text('{"pid": "x"}')
    with pytest.raises(StackNotRunning, match=r"is unreadable, so it is ignored \(.*pid: expected int"):
        find_running()


def test_withdraw_removes_only_its_own_pointer() -> None:
    other = replace(ME, pid=1)
    stackfile.write(pointer_path(), other)
    withdraw(ME)  # a later kvgate up owns the pointer now
    assert pointer_path().exists()
    stackfile.write(pointer_path(), ME)
    withdraw(ME)
    assert not pointer_path().exists()
    withdraw(ME)  # nothing there: nothing to do


def test_ext_procs_and_child_pids_round_trip(tmp_path: Path) -> None:
    """Every ext_proc's ports and each child's current PID (a restarted child's new one) are in the file."""
    info = replace(
        ME,
        extprocs={
            "extproc-0": {"extproc": 9002, "health": 9003, "metrics": 9090},
            "extproc-1": {"extproc": 9012},
        },
        pids={"sim-0": 101, "extproc-0": 102, "envoy": 103},
    )
    stackfile.write(tmp_path / "stack.json", info)
    assert stackfile.read(tmp_path / "stack.json") == info


def test_a_file_without_ext_procs_or_pids_still_reads(tmp_path: Path) -> None:
    """Written before the launcher named them: both default to empty."""
    raw = ME.to_json()
    del raw["extprocs"], raw["pids"]
    (tmp_path / "stack.json").write_text(json.dumps(raw))
    assert stackfile.read(tmp_path / "stack.json") == ME


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        ("pids", {"sim-0": "101"}, r"pids\.sim-0: expected an integer, got str"),
        ("pids", {"sim-0": True}, r"pids\.sim-0: expected an integer, got bool"),
        ("pids", [101], r"pids: expected a table"),
        ("extprocs", {"extproc": 9002}, r"extprocs\.extproc: expected a table"),
    ],
)
def test_malformed_ext_procs_or_pids_are_refused(tmp_path: Path, key: str, value: object, error: str) -> None:
    (tmp_path / "stack.json").write_text(json.dumps({**ME.to_json(), key: value}))
    with pytest.raises(ConfigError, match=error):
        stackfile.read(tmp_path / "stack.json")
