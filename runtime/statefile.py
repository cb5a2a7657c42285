"""State a daemon keeps across its restarts, in one private file per worker: the IO shell that a sans-IO
table (the response affinity table, the cascade's preroute learners) is snapshotted through.

:func:`write_atomic` writes a whole file or nothing (a private temp file beside it, fsync, rename, fsync
of the directory; mode 0600 in a 0700 directory). :func:`read_bounded` reads one back, refusing a file
over its bound unread. :class:`Snapshots` runs the timer: every ``interval_s``, when its table changed
(its ``version`` moved), it takes the table's copy on the event loop (``capture``: cheap) and encodes and
writes it on a thread; once more at a graceful shutdown. A file that cannot be read is its owner's to log
(:class:`StateError` says why, never what it holds); a failed write is logged and counted, never raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.core import CounterMetricFamily, Metric

log = logging.getLogger(__name__)

_temp_names = itertools.count()


class StateError(Exception):
    """A state file that is not ours to read; the message says why, never what it holds."""


def state_path(directory: str | Path, kind: str, worker: str) -> Path:
    """``<directory>/<kind>-<worker>.json``, the worker name reduced to ``[A-Za-z0-9._-]``."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", worker).lstrip(".") or "extproc"
    return Path(directory) / f"{kind}-{safe}.json"


def read_bounded(path: Path, max_bytes: int) -> bytes | None:
    """The bytes of ``path``; ``None`` when there is no file; :class:`StateError` when it cannot be read
    or holds more than ``max_bytes``."""
    try:
        # O_NONBLOCK: a FIFO (or a device) at the path must not hang the start in open(); only a regular
        # file is read (the flag does nothing to one).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"unreadable: {exc.strerror or type(exc).__name__}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StateError("not a regular file")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise StateError(f"unreadable: {exc.strerror or type(exc).__name__}") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > max_bytes:
        raise StateError(f"larger than {max_bytes} bytes")
    return data


def open_document(data: bytes, fmt: str, version: int, what: str) -> dict[str, Any]:
    """``data`` as a JSON object whose ``format`` is ``fmt`` and ``version`` is ``version``;
    :class:`StateError` (``what`` naming the kind of file) for anything else."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise StateError("not JSON: truncated or corrupt") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise StateError(f"not a {what}")
    found = doc.get("version")
    if found != version or isinstance(found, bool):
        shown = found if isinstance(found, int) and not isinstance(found, bool) else "?"
        raise StateError(f"format version {shown}, this gateway reads {version}")
    return doc


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` into ``path`` atomically: a private (0600) temp file beside it, fsync, rename over
    ``path``, fsync of the directory (created 0700 when missing)."""
    directory = path.parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    temp = directory / f".{path.name}.{os.getpid()}.{next(_temp_names)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # whatever the umask
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class Snapshots:
    """``path`` rewritten every ``interval_s`` while ``version()`` moves, and once more at :meth:`aclose`.

    ``capture()`` runs on the event loop and returns what the thread then turns into the file's bytes (a
    copy of the table, or of its changes, and the clocks it needs: nothing the loop goes on changing).
    ``what`` names the table in log lines. Nothing is written before :meth:`loaded` says the file was
    read (or found missing, or refused), so a table that never read its file never writes over it. A
    table's state class derives from it and adds its ``load``.
    """

    def __init__(
        self,
        path: Path,
        interval_s: float,
        version: Callable[[], int],
        capture: Callable[[], Callable[[], bytes]],
        what: str,
    ) -> None:
        self.path = path
        self.interval_s = interval_s
        self._version = version
        self._capture = capture
        self._what = what
        #: Snapshots written; files that could not be read (``load``) or written (``save``).
        self.saves = 0
        self.errors = {"load": 0, "save": 0}
        #: ``version()`` as last written (or loaded); ``None``: write at the next round.
        self._saved: int | None = None
        self._armed = False
        self._issued = 0
        self._written = 0
        self._lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None

    def loaded(self, *, current: bool) -> None:
        """The file was read (``current``: it holds the table as it is now, so nothing to write until it
        changes) or refused (the next round writes the table over it; counted)."""
        self._armed = True
        self._saved = self._version() if current else None
        if not current:
            self.errors["load"] += 1

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kvgate-{self._what.replace(' ', '-')}-snapshots")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.save()

    async def save(self) -> bool:
        """Write the table when it changed since the last write; ``False`` when unchanged or not written
        (logged; the next round tries again)."""
        version = self._version()
        if not self._armed or version == self._saved:
            return False
        encode = self._capture()
        self._issued += 1
        try:
            await asyncio.to_thread(self._write, self._issued, encode)
        except OSError as exc:
            self.errors["save"] += 1
            why = exc.strerror or type(exc).__name__
            log.warning("%s: cannot write %s (%s)", self._what, self.path, why)
            return False
        except Exception as exc:  # encoding: never the timer's end (the table keeps serving)
            self.errors["save"] += 1
            log.warning("%s: cannot encode a snapshot for %s (%s)", self._what, self.path, type(exc).__name__)
            return False
        self._saved = version
        self.saves += 1
        return True

    def _write(self, issued: int, encode: Callable[[], bytes]) -> None:
        data = encode()
        with self._lock:  # a write cut short by shutdown's cancellation never lands after a newer one
            if issued < self._written:
                return
            write_atomic(self.path, data)
            self._written = issued

    def families(
        self, prefix: str, restored: int, restored_help: str, held: str, empty: str
    ) -> Iterator[Metric]:
        """``<prefix>_restored_total`` (``restored``: what was taken back from the file, said by
        ``restored_help``), ``<prefix>_snapshots_total`` and ``<prefix>_state_errors_total{op}`` of this
        file; ``held`` names what a snapshot holds, ``empty`` what is left when the file is not read."""
        yield CounterMetricFamily(f"{prefix}_restored", restored_help, value=restored)
        yield CounterMetricFamily(
            f"{prefix}_snapshots", f"Snapshots of {held} written to state_dir", value=self.saves
        )
        errors = CounterMetricFamily(
            f"{prefix}_state_errors",
            f"Snapshot files that could not be read at start (ignored: {empty}) or written, by op",
            labels=["op"],
        )
        for op, n in sorted(self.errors.items()):
            errors.add_metric([op], n)
        yield errors

    async def aclose(self) -> None:
        """Stop the timer and write the table a last time (a graceful shutdown)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                try:
                    await self._task
                except Exception as exc:  # the shutdown goes on: the other parts still close
                    log.warning("%s: the snapshot timer had failed (%s)", self._what, type(exc).__name__)
        await self.save()
