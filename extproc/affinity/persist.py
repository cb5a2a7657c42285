"""The response affinity table across ext_proc restarts (README.md, "Kept across restarts"): the IO shell
around :class:`~extproc.affinity.core.ResponseAffinity`.

One file per worker, ``<state_dir>/affinity-<worker>.json``: read once at start (before the ext_proc
serves), written when the table changed every ``snapshot_interval_s`` and once more at a graceful shutdown.
Every write is atomic (a private temp file beside it, fsync, rename, fsync of the directory), mode 0600 in a
0700 directory, and runs on a thread (the event loop only copies the table's items). A file that cannot be
read as ours (missing, truncated, corrupt, another format version, too large, unreadable) is logged without
its content and ignored: the table starts empty, as it did before snapshots existed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import orjson

from extproc.affinity.core import Record, ResponseAffinity, to_records

log = logging.getLogger(__name__)

#: The snapshot's ``format`` and ``version`` fields; a file with another is not read.
FORMAT = "kvgate.response_affinity"
VERSION = 1
#: The most bytes one entry may take in a file read back (an id is at most 256 characters; scope, endpoint
#: id and address are short): a file over ``max_entries`` times this (plus a header) is refused unread.
ENTRY_BYTES = 2048
HEADER_BYTES = 64 * 1024

_temp_names = itertools.count()


class StateError(Exception):
    """A snapshot that is not ours to read; the message says why, never what it holds."""


def state_path(directory: str | Path, worker: str) -> Path:
    """This worker's file in ``directory`` (a worker name is reduced to ``[A-Za-z0-9._-]``)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", worker).lstrip(".") or "extproc"
    return Path(directory) / f"affinity-{safe}.json"


def encode(records: list[Record], written_at: float) -> bytes:
    """The snapshot's bytes: ``{"format", "version", "written_at", "entries": [[scope, response id,
    endpoint id, address, expires], ...]}``, least recently used first, times in wall-clock seconds."""
    doc = {"format": FORMAT, "version": VERSION, "written_at": written_at, "entries": records}
    return orjson.dumps(doc)


def decode(data: bytes) -> list[Record]:
    """The records of a snapshot; :class:`StateError` for anything this version did not write."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise StateError("not JSON: truncated or corrupt") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StateError("not a response affinity snapshot")
    version = doc.get("version")
    if version != VERSION or isinstance(version, bool):
        shown = version if isinstance(version, int) and not isinstance(version, bool) else "?"
        raise StateError(f"format version {shown}, this gateway reads {VERSION}")
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise StateError("no entry list")
    records: list[Record] = []
    for e in entries:
        if not (
            isinstance(e, list)
            and len(e) == 5
            and all(isinstance(x, str) for x in e[:4])
            and isinstance(e[4], (int, float))
            and not isinstance(e[4], bool)
        ):
            raise StateError("a malformed entry")
        records.append((e[0], e[1], e[2], e[3], float(e[4])))
    return records


def read(path: Path, max_bytes: int) -> list[Record] | None:
    """The records in ``path``; ``None`` when there is no file; :class:`StateError` when it cannot be
    read as a snapshot of at most ``max_bytes``."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"unreadable: {exc.strerror or type(exc).__name__}") from None
    if len(data) > max_bytes:
        raise StateError(f"larger than {max_bytes} bytes")
    return decode(data)


def write(path: Path, data: bytes) -> None:
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


class AffinityState:
    """``affinity``'s snapshot at ``path``: :meth:`load` once before serving, :meth:`start` the timer
    (every ``interval_s``, written when the table changed), :meth:`aclose` at shutdown (a last write).
    ``fleet()`` gives endpoint id -> address now, on the event loop; ``clock`` is monotonic (the table's
    time), ``wall`` the wall clock (the file's)."""

    def __init__(
        self,
        affinity: ResponseAffinity,
        path: Path,
        interval_s: float,
        fleet: Callable[[], Mapping[str, str]],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.affinity = affinity
        self.path = path
        self.interval_s = interval_s
        self._fleet = fleet
        self._clock = clock
        self._wall = wall
        #: Snapshots written, and files that could not be read (``load``) or written (``save``).
        self.saves = 0
        self.errors = {"load": 0, "save": 0}
        #: ``affinity.changes`` as last written (or loaded); ``None``: write at the next round.
        self._saved_changes: int | None = None
        #: Set by :meth:`load`: a table that never read its file never writes over it.
        self._loaded = False
        self._issued = 0
        self._written = 0
        self._lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None

    @property
    def max_bytes(self) -> int:
        return self.affinity.config.max_entries * ENTRY_BYTES + HEADER_BYTES

    async def load(self) -> int:
        """Restore the last run's entries (:meth:`ResponseAffinity.restore`); how many were kept. Never
        raises for a bad file: it is logged and the table starts empty."""
        self._loaded = True
        try:
            records = await asyncio.to_thread(read, self.path, self.max_bytes)
        except StateError as exc:  # replaced by the next snapshot
            self.errors["load"] += 1
            log.warning("response affinity: ignoring %s (%s); starting with an empty table", self.path, exc)
            return 0
        if records is None:
            log.info("response affinity: no snapshot at %s yet; starting with an empty table", self.path)
            self._saved_changes = self.affinity.changes  # nothing to write until something is learned
            return 0
        kept = self.affinity.restore(records, self._clock(), self._wall(), self._fleet())
        self._saved_changes = self.affinity.changes  # the file holds it already
        log.info("response affinity: %d of %d entries restored from %s", kept, len(records), self.path)
        return kept

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvgate-affinity-snapshots")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.save()

    async def save(self) -> bool:
        """Write the table when it changed since the last write; ``False`` when unchanged or not written
        (logged; the next round tries again)."""
        a = self.affinity
        changes = a.changes
        if not self._loaded or changes == self._saved_changes:
            return False
        items = a.entries.copy()  # the only part on the event loop: a shallow copy (~10 ms at 50,000)
        now, wall, fleet = self._clock(), self._wall(), dict(self._fleet())
        self._issued += 1
        try:
            await asyncio.to_thread(self._write, self._issued, items, now, wall, fleet)
        except OSError as exc:
            self.errors["save"] += 1
            log.warning(
                "response affinity: cannot write %s (%s)", self.path, exc.strerror or type(exc).__name__
            )
            return False
        self._saved_changes = changes
        self.saves += 1
        return True

    def _write(
        self,
        issued: int,
        items: Mapping[tuple[str, str], tuple[str, float]],
        now: float,
        wall: float,
        fleet: Mapping[str, str],
    ) -> None:
        data = encode(to_records(items.items(), now, wall, fleet), wall)
        with self._lock:  # a write cut short by shutdown's cancellation never lands after a newer one
            if issued < self._written:
                return
            write(self.path, data)
            self._written = issued

    async def aclose(self) -> None:
        """Stop the timer and write the table a last time (a graceful shutdown)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.save()
