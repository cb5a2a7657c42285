"""Process lifecycle shared by kvgate's daemons (ext_proc, node agent, kvcached).

The first SIGINT/SIGTERM asks for a clean stop (the daemon drains); a second one exits at once. A ready
file is written atomically (temp file + rename) so a launcher polling for it never reads half of it.
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
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)


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
