"""Children of the launcher: ready files that prove whose they are, Envoy's bind failures, and children
that die with their parent (even a SIGKILLed one) but not with the thread that started them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path

import pytest

from kvgate.dev.procs import Child, ChildFailed, ListenFailed, _admin_url, start_envoy, written_by
from kvgate.envoy.bootstrap import EnvoyParams, render_yaml
from runtime import lifecycle
from tests.polling import until

ROOT = Path(__file__).resolve().parents[3]


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.mark.parametrize(
    ("data", "pid", "mine"),
    [
        ({"port": 1, "pid": 42}, 42, True),
        ({"port": 1, "pid": 43}, 42, False),
        ({"port": 1}, 42, False),  # written before ready files named their writer
        ([{"id": "a", "pid": 42}, {"id": "b", "pid": 42}], 42, True),
        ([{"id": "a", "pid": 42}, {"id": "b", "pid": 7}], 42, False),
        ([], 42, False),
        ("42", 42, False),
    ],
)
def test_written_by(data: object, pid: int, mine: bool) -> None:
    assert written_by(data, pid) is mine


@pytest.mark.parametrize("stale", [{"port": 1, "pid": 999_999_999}, {"port": 1}, [{"id": "sim-0"}]])
def test_an_earlier_runs_ready_file_is_never_taken_for_this_childs(tmp_path: Path, stale: object) -> None:
    """A child that exits without writing its ready file fails, whatever file was already there."""
    ready = tmp_path / "x.ready.json"
    ready.write_text(json.dumps(stale))
    child = Child("x", python("import sys; sys.exit(3)"), tmp_path / "x.log")
    with pytest.raises(ChildFailed, match=r"x exited \(3\) before ready"):
        child.wait_for_json_file(ready, 30)
    child.stop()


def test_the_childs_own_ready_file_is_returned(tmp_path: Path) -> None:
    ready = tmp_path / "x.ready.json"
    ready.write_text(json.dumps({"port": 1, "pid": 999_999_999}))
    code = (
        "import json, os, pathlib, sys, time\n"
        f"p = pathlib.Path({str(ready)!r})\n"
        "tmp = p.with_suffix('.tmp')\n"
        "tmp.write_text(json.dumps([{'port': 2, 'pid': os.getpid()}]))\n"
        "tmp.replace(p)\n"
        "time.sleep(60)\n"
    )
    child = Child("x", python(code), tmp_path / "x.log")
    try:
        assert child.wait_for_json_file(ready, 30) == [{"port": 2, "pid": child.pid}]
    finally:
        child.stop()


def test_envoy_that_cannot_bind_names_the_address(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        params = EnvoyParams(listen_port=port, admin_port=0, extproc_port=1)
        with pytest.raises(ListenFailed) as info:
            start_envoy("envoy", render_yaml(params), tmp_path, timeout_s=30)
    assert str(info.value) == f"envoy cannot listen on 127.0.0.1:{port}: Address already in use"


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ("127.0.0.1:9901", "http://127.0.0.1:9901"),
        ("[::1]:9901", "http://[::1]:9901"),
        ("localhost:19000", "http://localhost:19000"),
        ("/run/kvgate/envoy-admin.sock", "unix:/run/kvgate/envoy-admin.sock"),
        # a relative work directory (`kvgate bench routing --out results/x`) gives a relative socket path
        ("results/x/work/envoy-admin.sock", "unix:{cwd}/results/x/work/envoy-admin.sock"),
        ("envoy-admin.sock", "unix:{cwd}/envoy-admin.sock"),
        ("", None),
    ],
)
def test_the_admin_address_envoy_wrote(tmp_path: Path, written: str, expected: str | None) -> None:
    path = tmp_path / "envoy.admin"
    path.write_text(written + "\n")
    want = None if expected is None else expected.format(cwd=os.getcwd())
    assert _admin_url(path) == want


def test_envoy_with_its_admin_on_a_relative_socket_path_becomes_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative admin socket path is made absolute (it read as a host name, and Envoy never became
    ready to the caller, which broke `kvgate bench routing --out results/...`)."""
    monkeypatch.chdir(tmp_path)
    params = EnvoyParams(listen_port=0, admin_port=0, extproc_port=1, admin_socket="rel/envoy-admin.sock")
    (tmp_path / "rel").mkdir()
    child, admin, port = start_envoy("envoy", render_yaml(params), Path("rel"), timeout_s=60)
    try:
        assert admin == f"unix:{tmp_path}/rel/envoy-admin.sock" and port > 0
    finally:
        child.stop()


async def test_children_die_with_a_killed_parent(tmp_path: Path) -> None:
    """SIGKILL a process that started a Child: the kernel SIGTERMs the child (no orphan)."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from kvgate.dev.procs import Child\n"
        "argv = [sys.executable, '-c', 'import time; time.sleep(600)']\n"
        f"child = Child('sleeper', argv, Path({str(tmp_path)!r}) / 's.log')\n"
        "print(child.pid, flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    parent = await asyncio.create_subprocess_exec(*python(code), cwd=ROOT, stdout=asyncio.subprocess.PIPE)
    assert parent.stdout is not None
    grandchild = int(await parent.stdout.readline())
    try:
        assert _alive(grandchild)
        parent.kill()
        await parent.wait()
        await until(lambda: not _alive(grandchild), 20)
    finally:
        if _alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)


async def test_a_child_is_started_without_the_parents_at_fork_handlers(tmp_path: Path) -> None:
    """No ``fork()`` for a Child (``setpriv --pdeathsig``, no ``preexec_fn``): an at-fork handler of the
    parent (gRPC's, with its channels busy, aborted such children now and then) does not run for it, and
    the child still dies with its SIGKILLed parent."""
    if lifecycle._setpriv() is None:
        pytest.skip(
            "no setpriv with --pdeathsig (children are forked with a preexec_fn): install util-linux >= 2.33"
            " to run it"
        )
    marker = tmp_path / "forked"
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from kvgate.dev.procs import Child\n"
        f"os.register_at_fork(after_in_child=lambda: open({str(marker)!r}, 'w').close())\n"
        "argv = [sys.executable, '-c', 'import time; time.sleep(600)']\n"
        f"child = Child('sleeper', argv, Path({str(tmp_path)!r}) / 's.log')\n"
        "print(child.pid, flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    parent = await asyncio.create_subprocess_exec(*python(code), cwd=ROOT, stdout=asyncio.subprocess.PIPE)
    assert parent.stdout is not None
    grandchild = int(await parent.stdout.readline())
    try:
        assert _alive(grandchild) and not marker.exists()
        parent.kill()
        await parent.wait()
        await until(lambda: not _alive(grandchild), 20)
        assert not marker.exists()
    finally:
        if _alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)


async def test_a_child_started_on_another_thread_outlives_that_thread(tmp_path: Path) -> None:
    """The parent-death signal follows the thread that forks: a thread that started a child and ended must
    not take the child with it (children are then forked on a spawner thread that lives on)."""
    go, done = tmp_path / "go", tmp_path / "done"
    code = (
        "import pathlib, time\n"
        f"go, done = pathlib.Path({str(go)!r}), pathlib.Path({str(done)!r})\n"
        "while not go.exists():\n"
        "    time.sleep(0.01)\n"
        "done.touch()\n"
    )
    started: list[Child] = []
    tids: list[int] = []

    def start() -> None:
        tids.append(threading.get_native_id())
        started.append(Child("x", python(code), tmp_path / "x.log"))

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    (child,) = started
    try:
        # The thread is gone from the kernel too: a parent-death signal tied to it has been sent.
        await until(lambda: not Path(f"/proc/self/task/{tids[0]}").exists(), 10)
        go.touch()
        await until(lambda: done.exists() or not child.alive(), 30)
        assert done.exists(), f"the child died with its starting thread ({child.proc.poll()})"
        assert child.proc.wait(10) == 0
    finally:
        child.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False
