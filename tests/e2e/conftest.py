from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvgate.dev.up import Stack, StackOptions

# Simulated replicas run 20x faster than the documented H100 timing model: the tests check routing
# and wire behaviour, not latency.
FAST_SIM = ("--time-scale", "0.05")


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(
        replicas=4,
        port=0,
        sim_args=FAST_SIM,
        workdir=tmp_path_factory.mktemp("stack"),
        extproc={"max_body_bytes": 2 * 1024 * 1024},
    )
    with Stack(options) as running:
        yield running


class Spy(http.server.ThreadingHTTPServer):
    """An HTTP server that records every request it gets: a backend that must never be reached."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        spy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                spy.hits.append(self.path)
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            do_GET = do_POST

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def spy() -> Iterator[Spy]:
    server = Spy()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


class Launched:
    """A ``kvgate up`` subprocess (:func:`launched_up`) and the lines it printed until it was up."""

    def __init__(self, proc: subprocess.Popen[str], lines: list[str]) -> None:
        self.proc = proc
        self.lines = lines

    @property
    def banner(self) -> str:
        """The line "kvgate is up: URL  (...)" (``""``: the launcher exited before it printed it)."""
        return next((line for line in self.lines if line.startswith("kvgate is up: ")), "")

    @property
    def base_url(self) -> str:
        return self.banner.split()[3]

    def stop(self) -> int:
        """Ctrl-C, as a user stops it; its exit status."""
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(60)


@contextmanager
def launched_up(args: Sequence[str], workdir: Path, until: str = "kvgate is up: ") -> Iterator[Launched]:
    """``kvgate up ARGS --workdir WORKDIR`` as a user runs it (``python -m kvgate.cli``), its stack.json
    pointer under ``WORKDIR/state`` (never the user's). Readiness: the launcher prints its banner once
    Envoy listens; this yields once it printed a line starting with ``until`` (or exited first: then
    :attr:`Launched.banner` is empty). At the end a launcher still running gets Ctrl-C (SIGINT), as a
    user stops it, so that it stops its children, and is killed by its PID if it has not ended in 30 s."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvgate.cli", "up", *args, "--workdir", str(workdir)],
        env={**os.environ, "KVGATE_STATE_DIR": str(workdir / "state")},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(until):
                break
        yield Launched(proc, lines)
    finally:
        if proc.poll() is None:  # a failed assertion: stop it as a user would, so it stops its children
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
