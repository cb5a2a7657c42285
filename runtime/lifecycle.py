"""Process lifecycle shared by kvgate's daemons (ext_proc, node agent, kvcached).

The first SIGINT/SIGTERM asks for a clean stop (the daemon drains); a second one exits at once. A ready
file is written atomically (temp file + rename) so a launcher polling for it never reads half of it.
Under systemd (``Type=notify``: ``$NOTIFY_SOCKET`` set) readiness is also announced with ``READY=1``
(:func:`announce_ready`) and the first stop signal with ``STOPPING=1`` (the sd_notify protocol: one
datagram on that Unix socket; an ``@`` name is in the abstract namespace).
Children a process starts (engines under an agent, the stack under ``kvgate up``) die with it:
:func:`die_with_parent`.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

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
    caught by comparing the parent PID.
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
