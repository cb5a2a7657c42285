"""The response affinity table across ext_proc restarts (README.md, "Kept across restarts"): the IO shell
around :class:`~extproc.affinity.core.ResponseAffinity`.

One file per worker, ``<state_dir>/affinity-<worker>.json``: read once at start (before the ext_proc
serves), written when the table changed every ``snapshot_interval_s`` and once more at a graceful shutdown.
The file and its timer are :mod:`runtime.statefile`'s: every write atomic (a private temp file beside it,
fsync, rename, fsync of the directory), mode 0600 in a 0700 directory, and on a thread. The event loop
copies nothing: the table journals its changes (:attr:`ResponseAffinity.journal`), a capture hands the
journal over (a swap), and the thread replays it onto this shell's own copy of the table, then writes that
copy. A file that cannot be read as ours (missing, truncated, corrupt, another
format version, too large, unreadable) is logged without its content and ignored: the table starts empty,
as it did before snapshots existed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from pathlib import Path

import orjson

from extproc.affinity.core import Journal, Record, ResponseAffinity, to_records
from runtime import statefile
from runtime.statefile import Snapshots, StateError, open_document, read_bounded

log = logging.getLogger(__name__)

#: The snapshot's ``format`` and ``version`` fields; a file with another is not read.
FORMAT = "kvgate.response_affinity"
VERSION = 1
#: The most bytes one entry may take in a file read back (an id is at most 256 characters; scope, endpoint
#: id and address are short): a file over ``max_entries`` times this (plus a header) is refused unread.
ENTRY_BYTES = 2048
HEADER_BYTES = 64 * 1024

__all__ = ["FORMAT", "VERSION", "AffinityState", "StateError", "decode", "encode", "read", "state_path"]


def state_path(directory: str | Path, worker: str) -> Path:
    """This worker's file in ``directory`` (a worker name is reduced to ``[A-Za-z0-9._-]``)."""
    return statefile.state_path(directory, "affinity", worker)


#: Records serialized per ``orjson.dumps`` call: one call holds the GIL for its whole length (orjson does
#: not release it), so the event loop waits for it; 50,000 records in one call stalled the loop.
CHUNK = 1024


def encode(records: list[Record], written_at: float) -> bytes:
    """The snapshot's bytes: ``{"format", "version", "written_at", "entries": [[scope, response id,
    endpoint id, address, expires], ...]}``, least recently used first, times in wall-clock seconds.
    The same bytes as one ``orjson.dumps`` of the document, serialized :data:`CHUNK` records at a time."""
    head = orjson.dumps({"format": FORMAT, "version": VERSION, "written_at": written_at, "entries": []})
    parts = [head[:-2]]  # up to the entries' opening bracket
    for start in range(0, len(records), CHUNK):
        if start:
            parts.append(b",")
        parts.append(orjson.dumps(records[start : start + CHUNK])[1:-1])
    parts.append(b"]}")
    return b"".join(parts)


def decode(data: bytes) -> list[Record]:
    """The records of a snapshot; :class:`StateError` for anything this version did not write."""
    doc = open_document(data, FORMAT, VERSION, "response affinity snapshot")
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
    data = read_bounded(path, max_bytes)
    return None if data is None else decode(data)


class AffinityState(Snapshots):
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
        super().__init__(path, interval_s, lambda: affinity.changes, self._capture, "response affinity")
        self.affinity = affinity
        self._fleet = fleet
        self._clock = clock
        self._wall = wall
        #: The table as of the captures replayed so far, in use order: the writing thread's own, under
        #: ``_replaying``; the captures not yet replayed wait in ``_pending`` (a journal, or the whole
        #: table's items once the journal outgrew its bound), oldest first.
        self._copy: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict(affinity.entries)
        self._pending: deque[Journal | list[tuple[tuple[str, str], tuple[str, float]]]] = deque()
        self._replaying = threading.Lock()
        affinity.journal = {}

    @property
    def max_bytes(self) -> int:
        return self.affinity.config.max_entries * ENTRY_BYTES + HEADER_BYTES

    async def load(self) -> int:
        """Restore the last run's entries (:meth:`ResponseAffinity.restore`); how many were kept. Never
        raises for a bad file: it is logged and the table starts empty."""
        try:
            records = await asyncio.to_thread(read, self.path, self.max_bytes)
        except StateError as exc:  # replaced by the next snapshot
            self.loaded(current=False)
            log.warning("response affinity: ignoring %s (%s); starting with an empty table", self.path, exc)
            return 0
        if records is None:
            log.info("response affinity: no snapshot at %s yet; starting with an empty table", self.path)
            self.loaded(current=True)  # nothing to write until something is learned
            return 0
        kept = self.affinity.restore(records, self._clock(), self._wall(), self._fleet())
        self.loaded(current=True)  # the file holds it already
        log.info("response affinity: %d of %d entries restored from %s", kept, len(records), self.path)
        return kept

    def _capture(self) -> Callable[[], bytes]:
        # The only part on the event loop: the journal swapped for a new one (README.md, "Written"). A
        # copy of the whole table here took 16-18 ms at 50,000 fresh entries and far more once uses had
        # shuffled their order (walking the OrderedDict's links), every snapshot_interval_s.
        affinity = self.affinity
        journal = affinity.journal
        affinity.journal = {}
        self._pending.append(list(affinity.entries.items()) if journal is None else journal)
        now, wall, fleet = self._clock(), self._wall(), dict(self._fleet())
        return lambda: encode(self._records(now, wall, fleet), wall)

    def _records(self, now: float, wall: float, fleet: Mapping[str, str]) -> list[Record]:
        """On the writing thread: every capture not yet replayed applied to the copy, oldest first (a
        thread left over from a cancelled save may run beside the next one: the lock keeps the order),
        then the copy as records (:func:`to_records`), least recently used first. Item by item in
        Python, never one C call over the whole table (``list(copy.items())``, ``OrderedDict(items)``):
        such a call holds the GIL, and so the event loop, for its whole length."""
        with self._replaying:
            copy, pending = self._copy, self._pending
            while pending:
                change = pending.popleft()
                if isinstance(change, list):  # the whole table (the journal outgrew its bound)
                    copy = self._copy = OrderedDict()
                    for key, entry in change:
                        copy[key] = entry
                    continue
                for key, change_to in change.items():
                    if change_to is None:
                        copy.pop(key, None)
                    else:
                        copy[key] = change_to
                        copy.move_to_end(key)
            return to_records(copy.items(), now, wall, fleet)
