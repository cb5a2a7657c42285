"""The real counterparts the power source tests read from, started on 127.0.0.1 and stopped by PID:
``sushy-static`` (a DMTF mockup directory over HTTP or HTTPS, no auth), ``sushy-emulator`` (HTTP basic
auth from an htpasswd file, its fake driver) and OpenIPMI's ``ipmi_sim``."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.agent.power.bmc import free_port

BIN = Path(sys.executable).parent


def port_open(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port``."""
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_listening(proc: subprocess.Popen[bytes], port: int, log: Path, timeout_s: float = 30.0) -> None:
    """Poll until ``proc`` accepts on ``port`` (fail with its log if it exits or the deadline passes)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not port_open(port):
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args!r} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{proc.args!r} not listening on {port} within {timeout_s} s")
        time.sleep(0.05)


@contextmanager
def process(argv: Sequence[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` (output to ``log``); on exit stop that process by its PID (SIGTERM, then SIGKILL)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tool(name: str) -> str:
    """The path of a program the tests need: the venv's scripts first, then PATH (``./dev setup``
    installs the Debian ones); a failure that says how to get it otherwise."""
    local = BIN / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run ./dev setup (it installs the Debian packages tests need)")
    return found


@contextmanager
def sushy_static(
    mockup: Path, work: Path, *, cert: Path | None = None, key: Path | None = None
) -> Iterator[int]:
    """``sushy-static`` serving ``mockup`` on a free port (HTTPS with ``cert`` and ``key``); its port."""
    port = free_port()
    argv = [tool("sushy-static"), "-i", "127.0.0.1", "-p", str(port), "-m", str(mockup)]
    if cert is not None and key is not None:
        argv += ["-c", str(cert), "-k", str(key)]
    log = work / f"sushy-static-{port}.log"
    with process(argv, log) as proc:
        wait_listening(proc, port, log)
        yield port


@contextmanager
def sushy_emulator(work: Path, users: dict[str, str]) -> Iterator[int]:
    """``sushy-emulator`` with its fake driver and HTTP basic auth for ``users`` (name -> password,
    bcrypt-hashed into an htpasswd file, the only format it takes); its port."""
    import bcrypt

    htpasswd = work / "htpasswd"
    htpasswd.write_text(
        "".join(f"{u}:{bcrypt.hashpw(p.encode(), bcrypt.gensalt(4)).decode()}\n" for u, p in users.items())
    )
    config = work / "emulator.conf"
    config.write_text(f"SUSHY_EMULATOR_AUTH_FILE = {str(htpasswd)!r}\n")
    port = free_port()
    argv = [tool("sushy-emulator"), "--config", str(config), "--fake", "-i", "127.0.0.1", "-p", str(port)]
    log = work / f"sushy-emulator-{port}.log"
    with process(argv, log) as proc:
        wait_listening(proc, port, log)
        yield port


IPMI_DATA = Path(__file__).parents[2] / "data" / "ipmi"


@contextmanager
def ipmi_sim(work: Path, value_file: Path) -> Iterator[int]:
    """OpenIPMI's ``ipmi_sim`` with tests/data/ipmi's BMC (user ``kvgate``, password ``s3cret-pw``; the
    power sensor "Node Power" reads 10 x the number in ``value_file``, "Inlet Temp" the degrees C in
    ``<value_file>.temp``, 31 unless the caller wrote it) on a free UDP port; its port.
    Ready means a read succeeds: the caller polls for that (UDP has no listening state to probe)."""
    port = free_port(socket.SOCK_DGRAM)
    conf = work / "lan.conf"
    conf.write_text((IPMI_DATA / "lan.conf").read_text().replace("@PORT@", str(port)))
    emu = work / "kvgate.emu"
    temp_file = value_file.with_name(value_file.name + ".temp")
    if not temp_file.exists():
        temp_file.write_text("31\n")
    text = (IPMI_DATA / "kvgate.emu").read_text()
    emu.write_text(text.replace("@VALUE_FILE@", str(value_file)).replace("@TEMP_FILE@", str(temp_file)))
    state = work / "ipmi-state"
    state.mkdir(exist_ok=True)
    argv = [tool("ipmi_sim"), "-c", str(conf), "-f", str(emu), "-s", str(state), "-n"]
    with process(argv, work / f"ipmi_sim-{port}.log"):
        yield port
