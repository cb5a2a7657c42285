"""Process lifecycle shared by kvgate's daemons (ext_proc, node agent, kvcached).

The first SIGINT/SIGTERM asks for a clean stop (the daemon drains); a second one exits at once. A ready
file is written atomically (temp file + rename) so a launcher polling for it never reads half of it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from pathlib import Path

log = logging.getLogger(__name__)


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
