"""Peer routers for the routing benchmark: installed from PyPI into their own venvs, launched by PID.

``sglang-router`` (``smg launch``) and ``vllm-router`` are Rust routers shipped as binary wheels. Each
goes into its own virtual environment under ``.bench/venvs/<name>`` (ignored by git), created with the
Python running the benchmark and filled by pip with the pinned version; a marker file records a
finished install so later runs reuse it. Both run with ``--policy cache_aware`` and their other
defaults, on 127.0.0.1 only, with their Prometheus exporter on a free port (each binds a fixed default
port otherwise, and a second instance fails).

If an install or a launch fails, :class:`PeerUnavailable` carries the reason (the log's tail), and the
benchmark reports that peer as skipped instead of failing.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvgate.dev.procs import Child, ChildFailed, http_get

ROOT = Path(__file__).resolve().parents[2]
VENVS = ROOT / ".bench" / "venvs"
INSTALL_TIMEOUT_S = 600.0
READY_TIMEOUT_S = 60.0


class PeerUnavailable(RuntimeError):
    """A peer router could not be installed or started here; the message says why."""


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """One peer router: ``package==version`` from PyPI, the script it installs, and the arguments that
    start it with cache-aware routing. ``launch`` may start with a subcommand (``smg launch``)."""

    name: str
    requirement: str
    script: str
    launch: tuple[str, ...]
    policy: str = "cache_aware"

    def argv(self, bin_dir: Path, port: int, metrics_port: int, workers: list[str]) -> list[str]:
        return [
            str(bin_dir / self.script),
            *self.launch,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics_port),
            "--policy",
            self.policy,
            "--worker-urls",
            *workers,
        ]


PEERS: dict[str, PeerSpec] = {
    "sglang-router": PeerSpec("sglang-router", "sglang-router==0.3.2", "smg", ("launch",)),
    "vllm-router": PeerSpec("vllm-router", "vllm-router==0.1.17", "vllm-router", ()),
}


def install(spec: PeerSpec, venvs: Path = VENVS) -> Path:
    """The venv ``bin`` directory with ``spec`` installed (installing it first if needed)."""
    venv = venvs / spec.name
    marker = venv / ".kvgate-installed"
    bin_dir = venv / "bin"
    if (
        marker.is_file()
        and marker.read_text().strip() == spec.requirement
        and (bin_dir / spec.script).exists()
    ):
        return bin_dir
    venvs.mkdir(parents=True, exist_ok=True)
    log_path = venvs / f"{spec.name}.install.log"
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        [str(bin_dir / "python"), "-m", "pip", "install", "--quiet", spec.requirement],
    ]
    with open(log_path, "w") as log_file:
        for argv in steps:
            try:
                done = subprocess.run(
                    argv, stdout=log_file, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT_S, check=False
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise PeerUnavailable(f"{spec.requirement}: install failed: {exc}") from exc
            if done.returncode != 0:
                raise PeerUnavailable(
                    f"{spec.requirement}: `{' '.join(argv[-3:])}` exited {done.returncode}: {_tail(log_path)}"
                )
    if not (bin_dir / spec.script).exists():
        raise PeerUnavailable(f"{spec.requirement} installed no `{spec.script}` script")
    marker.write_text(spec.requirement + "\n")
    return bin_dir


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def launch(spec: PeerSpec, bin_dir: Path, workers: list[str], workdir: Path) -> tuple[Child, str]:
    """Start the router over ``workers`` (``http://host:port`` each); returns it and its base URL once
    it lists the served model on ``GET /v1/models`` (i.e. has registered healthy workers)."""
    port, metrics_port = free_port(), free_port()
    child = Child(spec.name, spec.argv(bin_dir, port, metrics_port, workers), workdir / f"{spec.name}.log")
    return _ready(spec, child, port)


def pd_argv(
    spec: PeerSpec,
    bin_dir: Path,
    port: int,
    metrics_port: int,
    prefills: list[tuple[str, int]],
    decodes: list[str],
) -> list[str]:
    """sglang-router's prefill/decode mode (``--pd-disaggregation``): each prefill server as ``--prefill URL
    BOOTSTRAP_PORT``, each decode server as ``--decode URL``, ``--policy`` for both pools."""
    argv = [str(bin_dir / spec.script), *spec.launch, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    argv += ["--pd-disaggregation", "--policy", spec.policy]
    for url, bootstrap_port in prefills:
        argv += ["--prefill", url, str(bootstrap_port)]
    for url in decodes:
        argv += ["--decode", url]
    return argv


def launch_pd(
    spec: PeerSpec, bin_dir: Path, prefills: list[tuple[str, int]], decodes: list[str], workdir: Path
) -> tuple[Child, str]:
    """Start sglang-router in its prefill/decode mode over SGLang-protocol servers (``prefills``: URL and
    bootstrap port each); returns it and its base URL once it answers ``GET /v1/models``."""
    port, metrics_port = free_port(), free_port()
    argv = pd_argv(spec, bin_dir, port, metrics_port, prefills, decodes)
    return _ready(spec, Child(f"{spec.name}-pd", argv, workdir / f"{spec.name}-pd.log"), port)


def _ready(spec: PeerSpec, child: Child, port: int) -> tuple[Child, str]:
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool | None:
        got = http_get(f"{url}/v1/models", timeout_s=2.0)
        return True if got is not None and got[0] == 200 and b'"data"' in got[1] else None

    try:
        child.wait_until(ready, READY_TIMEOUT_S, "serving /v1/models")
    except ChildFailed as exc:
        child.stop()
        raise PeerUnavailable(f"{spec.requirement} did not start: {exc}") from exc
    return child, url


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
