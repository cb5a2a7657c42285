"""Supervision of the launcher's children with real processes: a child that dies is started again with the
same command line and log, its readiness is its own (never a dead child's ready file), a crash loop is
retried at capped delays forever, one slow or failing child never holds up the others, and the local etcd
comes back on its ports with its data."""

from __future__ import annotations

import base64
import json
import logging
import os
import signal
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgate.dev.etcd import EtcdServer
from kvgate.dev.supervise import Backoff
from kvgate.dev.supervisor import Restartable, Service, Supervisor
from tests.polling import until

FAST = Backoff(initial_s=0.1, max_s=0.4, stable_s=30)


def sleeper(tmp: Path, name: str, code: str = "", ready_timeout_s: float = 30) -> Service[Any]:
    """A child that runs ``code``, then writes ``{"pid", "port": 7}`` to its ready file and sleeps; it
    is not ready if that takes more than ``ready_timeout_s``."""
    ready = tmp / f"{name}.ready.json"
    program = (
        "import json, os, pathlib, sys, time\n"
        f"ready = pathlib.Path({str(ready)!r})\n"
        f"{code}\n"
        "print('run of', os.getpid(), flush=True)\n"
        "tmp = ready.with_suffix('.tmp')\n"
        "tmp.write_text(json.dumps({'pid': os.getpid(), 'port': 7}))\n"
        "tmp.replace(ready)\n"
        "time.sleep(600)\n"
    )
    return Service(
        name,
        [sys.executable, "-c", program],
        tmp / f"{name}.log",
        lambda child: child.wait_for_json_file(ready, ready_timeout_s),
        stale=[ready],
    )


class Readiness:
    """What ``on_ready`` heard: (child name, the value it reported), in order."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, Any]] = []
        self._lock = threading.Lock()

    def __call__(self, child: Restartable, value: object) -> None:
        with self._lock:
            self.heard.append((child.name, value))

    def pids(self, name: str) -> list[int]:
        with self._lock:
            return [v["pid"] for n, v in self.heard if n == name]


@pytest.fixture
def services() -> Iterator[list[Service[Any]]]:
    """Services a test starts, stopped at its end."""
    started: list[Service[Any]] = []
    yield started
    for service in started:
        service.stop(grace_s=1)


@pytest.fixture
def supervisors() -> Iterator[list[Supervisor]]:
    started: list[Supervisor] = []
    yield started
    for supervisor in started:
        supervisor.close()


async def test_a_killed_child_is_started_again_and_the_others_are_left_alone(
    tmp_path: Path,
    services: list[Service[Any]],
    supervisors: list[Supervisor],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "kvgate.dev.supervisor")
    a, b = sleeper(tmp_path, "a"), sleeper(tmp_path, "b")
    services += [a, b]
    first_a, first_b = a.await_ready()["pid"], b.await_ready()["pid"]
    argv = list(a.argv)
    heard = Readiness()
    supervisor = Supervisor([a, b], backoff=FAST, on_ready=heard)
    supervisors.append(supervisor)
    supervisor.start()
    os.kill(first_a, signal.SIGKILL)
    await until(lambda: heard.pids("a") != [], 30)
    (second_a,) = heard.pids("a")
    assert second_a == a.pid != first_a and a.alive() and a.argv == argv
    assert b.pid == first_b and b.alive() and heard.pids("b") == []
    assert supervisor.restarts == {"a": 1, "b": 0}
    assert f"a (pid {first_a}) died (signal SIGKILL): restarting it in 0.1 s (attempt 1)" in caplog.messages
    assert a.log_path.read_text().splitlines() == [f"run of {first_a}", f"run of {second_a}"]  # appended


async def test_a_dead_childs_ready_file_never_counts_for_the_restarted_one(
    tmp_path: Path, services: list[Service[Any]], supervisors: list[Supervisor]
) -> None:
    """The restarted child writes its ready file only once told to: until then it is not ready, although
    the dead one's file was there (it is removed before the start, and would not carry the new PID)."""
    go, first = tmp_path / "go", tmp_path / "first"
    wait_for_go = (
        f"if pathlib.Path({str(first)!r}).exists():\n"
        f"    while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.01)\n"
        f"pathlib.Path({str(first)!r}).touch()"
    )
    child = sleeper(tmp_path, "c", wait_for_go)
    services.append(child)
    dead = child.await_ready()["pid"]
    heard = Readiness()
    supervisor = Supervisor([child], backoff=FAST, on_ready=heard)
    supervisors.append(supervisor)
    supervisor.start()
    os.kill(dead, signal.SIGKILL)
    await until(lambda: child.pid != dead and child.alive(), 30)
    assert not (tmp_path / "c.ready.json").exists() and heard.heard == []
    go.touch()
    await until(lambda: heard.heard != [], 30)
    assert heard.pids("c") == [child.pid]


async def test_a_child_that_keeps_crashing_is_retried_at_capped_delays_and_never_given_up(
    tmp_path: Path,
    services: list[Service[Any]],
    supervisors: list[Supervisor],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "kvgate.dev.supervisor")
    crashing = tmp_path / "crash"
    crashing.touch()
    child = sleeper(tmp_path, "d", f"if pathlib.Path({str(crashing)!r}).exists(): sys.exit(3)")
    steady = sleeper(tmp_path, "e")
    services += [child, steady]
    steady_pid = steady.await_ready()["pid"]
    await until(lambda: not child.alive(), 30)
    heard = Readiness()
    supervisor = Supervisor([child, steady], backoff=FAST, on_ready=heard)
    supervisors.append(supervisor)
    supervisor.start()
    await until(lambda: supervisor.restarts["d"] >= 5, 30)
    died = [m for m in caplog.messages if m.startswith("d (pid ") and "died (exit code 3)" in m]
    delays = [m.split("restarting it in ")[1] for m in died[:5]]
    assert delays == [
        "0.1 s (attempt 1)",
        "0.2 s (attempt 2)",
        "0.4 s (attempt 3)",
        "0.4 s (attempt 4)",
        "0.4 s (attempt 5)",
    ]
    assert steady.pid == steady_pid and steady.alive() and supervisor.restarts["e"] == 0
    crashing.unlink()  # the cause is fixed: the next restart serves
    await until(lambda: heard.pids("d") != [], 30)
    assert child.alive()


async def test_a_restarted_child_not_ready_in_time_is_killed_and_started_again(
    tmp_path: Path, services: list[Service[Any]], supervisors: list[Supervisor]
) -> None:
    hang = tmp_path / "hang"
    slow = sleeper(tmp_path, "f", f"if pathlib.Path({str(hang)!r}).exists(): time.sleep(600)", 1.0)
    services.append(slow)
    first = slow.await_ready()["pid"]
    hang.touch()
    supervisor = Supervisor([slow], backoff=FAST)
    supervisors.append(supervisor)
    supervisor.start()
    os.kill(first, signal.SIGKILL)
    await until(lambda: supervisor.restarts["f"] >= 2, 30)  # the hung restart was ended, then retried


async def test_close_ends_supervision(
    tmp_path: Path, services: list[Service[Any]], supervisors: list[Supervisor]
) -> None:
    child = sleeper(tmp_path, "g")
    services.append(child)
    child.await_ready()
    supervisor = Supervisor([child], backoff=FAST)
    supervisor.start()
    supervisor.close()
    assert "kvgate-supervisor" not in {t.name for t in threading.enumerate()}
    child.stop(grace_s=1)
    assert supervisor.restarts == {"g": 0}


def etcd_put(etcd: EtcdServer, key: str, value: str) -> None:
    body = json.dumps({"key": _b64(key), "value": _b64(value)}).encode()
    with urllib.request.urlopen(f"http://{etcd.address}/v3/kv/put", body, timeout=5):
        pass


def etcd_get(etcd: EtcdServer, key: str) -> str | None:
    body = json.dumps({"key": _b64(key)}).encode()
    with urllib.request.urlopen(f"http://{etcd.address}/v3/kv/range", body, timeout=5) as resp:
        kvs = json.loads(resp.read()).get("kvs", [])
    return base64.b64decode(kvs[0]["value"]).decode() if kvs else None


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


async def test_a_killed_etcd_comes_back_on_its_ports_with_its_data(
    tmp_path: Path, supervisors: list[Supervisor]
) -> None:
    with EtcdServer(tmp_path / "etcd") as etcd:
        etcd_put(etcd, "kvgate/test", "kept")
        first, address = etcd.pid, etcd.address
        heard = Readiness()
        supervisor = Supervisor([etcd], backoff=FAST, on_ready=heard)
        supervisors.append(supervisor)
        supervisor.start()
        os.kill(first, signal.SIGKILL)
        await until(lambda: heard.heard != [], 30)
        assert etcd.pid != first and etcd.running and etcd.address == address
        assert etcd_get(etcd, "kvgate/test") == "kept"
        supervisor.close()
