"""Children that die with their parent: started through ``setpriv --pdeathsig`` (no ``preexec_fn``, so no
``fork()`` and no at-fork handler of the parent in the child), a ``preexec_fn`` without it, and the errors
``Popen`` would raise for a program that cannot be executed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import lifecycle
from runtime.lifecycle import spawn_dying_with_parent

needs_setpriv = pytest.mark.skipif(
    lifecycle._setpriv() is None, reason="no setpriv with --pdeathsig: install util-linux >= 2.33 to run it"
)


@needs_setpriv
def test_the_child_gets_its_parent_death_signal_with_no_preexec_fn() -> None:
    spawn = spawn_dying_with_parent([sys.executable, "-c", _PDEATHSIG_CODE])
    assert spawn.preexec_fn is None
    assert spawn.argv[1:] == ["--pdeathsig", "TERM", "--", sys.executable, "-c", _PDEATHSIG_CODE]
    out = subprocess.run(spawn.argv, capture_output=True, text=True, timeout=30, check=True).stdout
    assert out.strip() == str(int(signal.SIGTERM))


#: Prints the parent-death signal of the process running it (``prctl(PR_GET_PDEATHSIG)``).
_PDEATHSIG_CODE = (
    "import ctypes\n"
    "sig = ctypes.c_int(0)\n"
    "ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)\n"
    "print(sig.value)\n"
)


@needs_setpriv
def test_this_processs_at_fork_handlers_do_not_run_for_the_child(tmp_path: Path) -> None:
    """An ``os.register_at_fork(after_in_child=...)`` handler marks a file: it must stay unmarked (gRPC's
    handlers, run in a ``fork()`` child while its channels are busy, abort that child now and then)."""
    marker = tmp_path / "forked"
    code = (
        "import os, subprocess, sys\n"
        "from runtime.lifecycle import spawn_dying_with_parent\n"
        f"os.register_at_fork(after_in_child=lambda: open({str(marker)!r}, 'w').close())\n"
        "spawn = spawn_dying_with_parent([sys.executable, '-c', 'pass'])\n"
        "child = subprocess.Popen(spawn.argv, preexec_fn=spawn.preexec_fn, start_new_session=True)\n"
        "sys.exit(child.wait())\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, timeout=60, check=True)
    assert not marker.exists()


def test_without_setpriv_a_preexec_fn_sets_the_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle, "_setpriv", lambda: None)
    spawn = spawn_dying_with_parent([sys.executable, "-c", _PDEATHSIG_CODE])
    assert spawn.argv == [sys.executable, "-c", _PDEATHSIG_CODE] and spawn.preexec_fn is not None
    got = subprocess.run(spawn.argv, preexec_fn=spawn.preexec_fn, capture_output=True, text=True, timeout=30)
    assert got.stdout.strip() == str(int(signal.SIGTERM))


@needs_setpriv
def test_a_missing_program_raises_what_popen_would(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        spawn_dying_with_parent([str(tmp_path / "no-such-program")])
    with pytest.raises(FileNotFoundError):
        spawn_dying_with_parent(["kvgate-no-such-program"], env={"PATH": str(tmp_path)})
    plain = tmp_path / "plain"
    plain.write_text("#!/bin/sh\n")
    with pytest.raises(PermissionError):
        spawn_dying_with_parent([str(plain)])


@needs_setpriv
def test_a_program_is_found_where_popen_finds_it(tmp_path: Path) -> None:
    """On ``env``'s ``PATH``, or relative to ``cwd`` when the name holds a slash; a path-like name too."""
    tool = tmp_path / "bin" / "tool"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\necho ran\n")
    tool.chmod(0o755)
    env = {**os.environ, "PATH": str(tool.parent)}
    cases: list[tuple[list[str | os.PathLike[str]], Path | None]] = [
        (["tool"], None),
        (["./bin/tool"], tmp_path),
        ([tool], None),
    ]
    for argv, cwd in cases:
        spawn = spawn_dying_with_parent(argv, env, cwd)
        got = subprocess.run(spawn.argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=30)
        assert got.stdout == "ran\n"
