"""Where a running ``kvgate up`` is found: ``WORKDIR/stack.json`` and a well-known pointer to it.

Once everything is up, the launcher writes one JSON document (:class:`StackInfo`) with every address a
user may need (the OpenAI base URL, the ext_proc's metrics page, Envoy's admin, the local etcd), the work
directory and each child's log, to ``WORKDIR/stack.json``; ``kvgate up`` also publishes a copy at
:func:`pointer_path`, so that other commands (``kvgate policy``, ``kvgate drain``) find the local stack
without flags. The pointer directory is ``$KVGATE_STATE_DIR``, else ``$XDG_STATE_HOME/kvgate``, else
``~/.local/state/kvgate``.

The document names the launcher's PID and that process's start time: a clean stop removes the pointer,
and a reader ignores (and says it ignores) a pointer whose launcher is gone, such as one left behind by
a ``kill -9``, even when the PID has since been given to another process.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from contracts.config import REQUIRED, Section
from contracts.errors import ConfigError

STATE_DIR_ENV = "KVGATE_STATE_DIR"
FILE_NAME = "stack.json"


class StackNotRunning(LookupError):
    """No live ``kvgate up`` is published at :func:`pointer_path`; the message says why."""


@dataclass(frozen=True, slots=True)
class StackInfo:
    """What a running ``kvgate up`` tells users and other commands.

    ``pid``, ``started``: the launcher and its start time (clock ticks after boot, from ``/proc``; 0
    where unknown). ``url``: the OpenAI listener (``scheme://host:port``; clients use :attr:`base_url`);
    ``admin_url``: Envoy's admin; ``metrics_url``: the ext_proc's Prometheus page (``None`` without an
    ext_proc); ``etcd``: the local etcd's ``host:port`` (``--agents``; ``None`` otherwise). ``models``:
    the served model names; ``engines``: endpoint id to ``host:port``; ``logs``: child name to log file.
    ``extprocs``: each ext_proc's bound ports by name (``extproc``: the gRPC service Envoy calls,
    ``health``, ``metrics``); ``pids``: each child's current PID by name (a restarted child's new one,
    once it is ready again). ``etcd_tls``: with ``--etcd-auth``, the operator's etcd client files
    (``tls_ca``, ``tls_cert``, ``tls_key``; ``kvgate policy`` and ``kvgate drain`` use them when given no
    ``--tls-*``). All three are optional in the document (absent in older ones).
    """

    pid: int
    started: int
    url: str
    admin_url: str
    metrics_url: str | None
    etcd: str | None
    workdir: str
    models: tuple[str, ...]
    engines: dict[str, str]
    logs: dict[str, str]
    extprocs: dict[str, dict[str, int]] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    etcd_tls: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (what SDKs take as ``base_url``)."""
        return f"{self.url}/v1"

    def to_json(self) -> dict[str, object]:
        return {
            "pid": self.pid,
            "started": self.started,
            "url": self.url,
            "base_url": self.base_url,
            "admin_url": self.admin_url,
            "metrics_url": self.metrics_url,
            "etcd": self.etcd,
            "workdir": self.workdir,
            "models": list(self.models),
            "engines": self.engines,
            "logs": self.logs,
            "extprocs": self.extprocs,
            "pids": self.pids,
            "etcd_tls": self.etcd_tls,
        }

    @classmethod
    def from_json(cls, raw: object, where: str) -> StackInfo:
        """Parse :meth:`to_json`'s document (:class:`ConfigError` naming ``where`` and the key)."""
        s = Section(raw, where)
        s.string("base_url")  # derived from url
        info = cls(
            pid=s.integer("pid", REQUIRED, minimum=1),
            started=s.integer("started", REQUIRED, minimum=0),
            url=s.string("url", REQUIRED),
            admin_url=s.string("admin_url", REQUIRED),
            metrics_url=_nullable(s.raw("metrics_url"), f"{where}.metrics_url"),
            etcd=_nullable(s.raw("etcd"), f"{where}.etcd"),
            workdir=s.string("workdir", REQUIRED),
            models=tuple(_string_list(s.array("models", []), f"{where}.models")),
            engines=_string_table(s.raw("engines"), f"{where}.engines"),
            logs=_string_table(s.raw("logs"), f"{where}.logs"),
            extprocs={
                name: _int_table(ports, f"{where}.extprocs.{name}")
                for name, ports in _table(s.raw("extprocs"), f"{where}.extprocs").items()
            },
            pids=_int_table(s.raw("pids"), f"{where}.pids"),
            etcd_tls=_string_table(s.raw("etcd_tls"), f"{where}.etcd_tls"),
        )
        s.done()
        return info


def _nullable(raw: object, where: str) -> str | None:
    if raw is not None and not isinstance(raw, str):
        raise ConfigError(f"{where}: expected a string or null, got {type(raw).__name__}")
    return raw


def _string_list(raw: list[object], where: str) -> list[str]:
    if not all(isinstance(v, str) for v in raw):
        raise ConfigError(f"{where}: expected strings")
    return [str(v) for v in raw]


def _string_table(raw: object, where: str) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise ConfigError(f"{where}: expected a table of strings")
    return {str(k): str(v) for k, v in raw.items()}


def _table(raw: object, where: str) -> dict[str, object]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table")
    return {str(k): v for k, v in raw.items()}


def _int_table(raw: object, where: str) -> dict[str, int]:
    ints = {}
    for key, value in _table(raw, where).items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{where}.{key}: expected an integer, got {type(value).__name__}")
        ints[key] = value
    return ints


def state_dir() -> Path:
    """The pointer's directory: ``$KVGATE_STATE_DIR``, else ``$XDG_STATE_HOME/kvgate``, else
    ``~/.local/state/kvgate``."""
    explicit = os.environ.get(STATE_DIR_ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "state") / "kvgate"


def pointer_path() -> Path:
    return state_dir() / FILE_NAME


def process_started(pid: int) -> int:
    """``pid``'s start time in clock ticks after boot (``/proc/PID/stat`` field 22); 0 when unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else 0


def alive(info: StackInfo) -> bool:
    """Whether the launcher that wrote ``info`` still runs (same PID, same start time, not a zombie)."""
    try:
        os.kill(info.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    try:
        state = Path(f"/proc/{info.pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: the PID exists, which is all that can be told
    return state != "Z" and (info.started == 0 or process_started(info.pid) == info.started)


def write(path: Path, info: StackInfo) -> None:
    """Write ``info`` to ``path`` atomically (temp file + rename), creating the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info.to_json(), indent=2) + "\n")
    tmp.replace(path)


def withdraw(info: StackInfo) -> None:
    """Remove the pointer if it still names ``info``'s launcher (a later ``kvgate up`` may own it now)."""
    path = pointer_path()
    try:
        current = read(path)
    except (OSError, ConfigError):
        return
    if current.pid == info.pid and current.started == info.started:
        path.unlink(missing_ok=True)


def read(path: Path) -> StackInfo:
    """The document at ``path`` (``OSError`` when unreadable, :class:`ConfigError` when malformed)."""
    try:
        raw = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from exc
    return StackInfo.from_json(raw, str(path))


def find_running() -> StackInfo:
    """The published stack, if its launcher runs; :class:`StackNotRunning` saying why not otherwise."""
    path = pointer_path()
    try:
        info = read(path)
    except FileNotFoundError as exc:
        raise StackNotRunning(f"no running kvgate up found ({path} does not exist)") from exc
    except (OSError, ConfigError) as exc:
        raise StackNotRunning(f"{path} is unreadable, so it is ignored ({exc})") from exc
    if not alive(info):
        raise StackNotRunning(
            f"{path} is stale: the kvgate up that wrote it (pid {info.pid}) is not running (killed?), "
            "so it is ignored"
        )
    return info
