"""Process lifecycle shared by kvgate's daemons (ext_proc, node agent, kvcached).

The first SIGINT/SIGTERM asks for a clean stop (the daemon drains); a second one exits at once. A ready
file is written atomically (temp file + rename) so a launcher polling for it never reads half of it.
Under systemd (``Type=notify``: ``$NOTIFY_SOCKET`` set) readiness is also announced with ``READY=1``
(:func:`announce_ready`) and the first stop signal with ``STOPPING=1`` (the sd_notify protocol: one
datagram on that Unix socket; an ``@`` name is in the abstract namespace).
Children a process starts (engines under an agent, the stack under ``kvgate up``) die with it:
:func:`spawn_dying_with_parent`.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def stop_on_signals(stop: asyncio.Event) -> None:
    """Set ``stop`` on the first SIGINT/SIGTERM; exit with status 1 on the second."""
    received = 0

    def on_signal() -> None:
        nonlocal received
        received += 1
        if received > 1:
            log.warning("second signal: stopping now")
            raise SystemExit(1)
        notify_systemd("STOPPING=1")
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)


def announce_ready(ready_file: Path | None, status: object) -> None:
    """The daemon is ready: ``status`` (JSON) into ``ready_file`` when given, and ``READY=1`` to systemd
    when it started the daemon with ``Type=notify``."""
    if ready_file is not None:
        write_ready_file(ready_file, status)
    notify_systemd(f"READY=1\nMAINPID={os.getpid()}")


def systemd_notify_wanted() -> bool:
    """Whether systemd waits for ``READY=1`` from this process (``$NOTIFY_SOCKET`` is set)."""
    return bool(os.environ.get("NOTIFY_SOCKET"))


def notify_systemd(message: str) -> bool:
    """Send ``message`` (newline-separated ``KEY=value`` lines) to ``$NOTIFY_SOCKET``; ``False`` when
    unset. A failure to send is logged, never raised: the daemon serves either way."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    target = "\0" + address[1:] if address.startswith("@") else address
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(target)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", address, exc)
        return False
    return True


def write_ready_file(path: Path, status: object) -> None:
    """Write ``status`` as JSON to ``path`` atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(status))
    tmp.replace(path)


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive SIGTERM when its parent dies (``None`` off Linux).

    ``prctl(PR_SET_PDEATHSIG)``: the kernel sends the signal when the *thread* that forked the child exits,
    so fork from a thread that lives as long as the process. libc is loaded here, in the parent, so the
    child makes one system call between fork and exec; a parent that died before the call took effect is
    caught by comparing the parent PID. A ``preexec_fn`` makes Python ``fork()`` (no ``vfork``), running
    every at-fork handler of this process around it: :func:`spawn_dying_with_parent` avoids that.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def setup() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return setup


class Spawn(NamedTuple):
    """What to pass to ``subprocess.Popen`` (or ``asyncio.create_subprocess_exec``) for a child that dies
    with its parent: the command line to run and the ``preexec_fn`` (``None``: none needed)."""

    argv: list[str]
    preexec_fn: Callable[[], None] | None


def spawn_dying_with_parent(
    argv: Sequence[str | os.PathLike[str]],
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> Spawn:
    """``argv`` set up to receive SIGTERM when the thread that starts it exits (its parent's death).

    With util-linux's ``setpriv --pdeathsig`` (2.33+) the child execs ``setpriv``, which calls
    ``prctl(PR_SET_PDEATHSIG)`` and execs ``argv`` (same PID; the setting survives that exec). No
    ``preexec_fn`` is needed then, so Python spawns with ``vfork`` and no at-fork handler of this process
    runs: gRPC's ``pthread_atfork`` handlers, run in a ``fork()`` child while other threads are in gRPC,
    abort it now and then (SIGABRT). Not kept from :func:`die_with_parent`: the check that the parent did
    not die before the signal was set (a parent killed during those few milliseconds leaves the child
    running). Without a fit ``setpriv``: ``argv`` with :func:`die_with_parent` (a ``fork()``).

    ``env`` and ``cwd`` are those the child gets: a program that cannot be executed raises here what
    ``Popen`` would raise (:class:`FileNotFoundError`, :class:`PermissionError`), not an exit status of
    ``setpriv``'s."""
    args = [os.fspath(arg) for arg in argv]  # as Popen, a path-like argument is taken too
    setpriv = _setpriv()
    if setpriv is None:
        return Spawn(args, die_with_parent())
    _check_executable(args[0], env, cwd)
    return Spawn([setpriv, "--pdeathsig", "TERM", "--", *args], None)


@functools.cache
def _setpriv() -> str | None:
    """The path of a ``setpriv`` that takes ``--pdeathsig`` (Linux), found on first use; else ``None``.
    ``--pdeathsig TERM --help`` exits 0 only where the option is known (older ones reject it first)."""
    path = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    if path is None:
        log.debug("no setpriv: children get their parent-death signal from a preexec_fn")
        return None
    try:
        probe = subprocess.run(
            [path, "--pdeathsig", "TERM", "--help"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if probe.returncode != 0:
        log.debug("%s lacks --pdeathsig: children get their parent-death signal from a preexec_fn", path)
        return None
    return path


def _check_executable(
    program: str, env: Mapping[str, str] | None, cwd: str | os.PathLike[str] | None
) -> None:
    """Raise what exec would when ``program`` cannot be executed: looked up in ``env``'s ``PATH`` unless it
    holds a slash, then relative to ``cwd`` (as ``Popen`` does)."""
    if os.sep not in program:
        if shutil.which(program, path=os.pathsep.join(os.get_exec_path(env))) is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
        return
    path = os.path.join(cwd, program) if cwd is not None else program
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)
