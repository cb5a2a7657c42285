"""The cascades' ``preroute`` learners across ext_proc restarts (README.md, "Kept across restarts"): the IO
shell around :class:`~extproc.cascade.plan.Cascader`'s learners.

One file per worker, ``<state_dir>/preroute-<worker>.json``: read once at start (before the ext_proc
serves), written when a learner learnt (or a policy was applied) every ``snapshot_interval_s`` and once
more at a graceful shutdown; the file and its timer are :mod:`runtime.statefile`'s (atomic, 0600 in a
0700 directory, encoded and written on a thread). A file that cannot be read as ours (truncated, corrupt,
another format version or feature set, a count out of range, too large, unreadable) is logged without its
content and ignored: the learners start empty, as they did before snapshots existed.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import orjson

from contracts.errors import ConfigError
from extproc.cascade.plan import Cascader
from extproc.cascade.prior import (
    COUNTS_BYTES,
    FEATURES,
    SavedPrior,
    check_counts,
    parse_preroute,
    parse_rule,
)
from runtime import statefile
from runtime.statefile import Snapshots, StateError, open_document, read_bounded

log = logging.getLogger(__name__)

#: The snapshot's ``format`` and ``version`` fields; a file with another is not read (version 1 named
#: only a learner's first step, not the gate its verdicts were taken under).
FORMAT = "kvgate.cascade_preroute"
VERSION = 2
#: Learners one file may hold (each a virtual model with ``preroute``), and the file's bound: each
#: learner's counts are 2 MiB before compression, which takes them under 1 MiB.
MAX_LEARNERS = 64
MAX_BYTES = 64 * 1024 * 1024
#: A learner's verdicts in a file: JSON's exact integers (far past any run's; one past 2**64 could not be
#: written again).
MAX_VERDICTS = 2**53


def state_path(directory: str | Path, worker: str) -> Path:
    """This worker's file in ``directory`` (a worker name is reduced to ``[A-Za-z0-9._-]``)."""
    return statefile.state_path(directory, "preroute", worker)


def encode(saved: list[SavedPrior], written_at: float) -> bytes:
    """The snapshot's bytes: ``{"format", "version", "written_at", "features", "learners": [{"model",
    "rule", "preroute", "verdicts", "counts"}, ...]}``, the counts zlib-compressed, in base64; ``rule`` is
    the first step and the gate (``{"first_step", "gate", "threshold", "stat", "k"}``)."""
    learners = [
        {
            "model": s.model,
            "rule": s.rule.to_json(),
            "preroute": s.spec.to_json(),
            "verdicts": s.verdicts,
            "counts": base64.b64encode(zlib.compress(s.counts, 1)).decode("ascii"),
        }
        for s in saved
    ]
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "written_at": written_at,
        "features": FEATURES,
        "learners": learners,
    }
    return orjson.dumps(doc)


def decode(data: bytes) -> list[SavedPrior]:
    """The learners of a snapshot; :class:`StateError` for anything this version did not write."""
    doc = open_document(data, FORMAT, VERSION, "preroute snapshot")
    if doc.get("features") != FEATURES:
        raise StateError("counts of other features (another kvgate's learner)")
    learners = doc.get("learners")
    if not isinstance(learners, list) or len(learners) > MAX_LEARNERS:
        raise StateError(f"no learner list of at most {MAX_LEARNERS}")
    saved = [_learner(x) for x in learners]
    if len({s.model for s in saved}) != len(saved):
        raise StateError("a virtual model's learner twice")
    return saved


def _learner(x: object) -> SavedPrior:
    if not isinstance(x, dict):
        raise StateError("a malformed learner")
    model, verdicts, packed = x.get("model"), x.get("verdicts"), x.get("counts")
    if not (
        isinstance(model, str)
        and isinstance(verdicts, int)
        and not isinstance(verdicts, bool)
        and 0 <= verdicts <= MAX_VERDICTS
        and isinstance(packed, str)
    ):
        raise StateError("a malformed learner")
    try:
        rule = parse_rule(x.get("rule"))
    except ValueError as exc:
        raise StateError(str(exc)) from None
    try:
        spec = parse_preroute(x.get("preroute"), "preroute")
        inflate = zlib.decompressobj()
        counts = inflate.decompress(base64.b64decode(packed, validate=True), COUNTS_BYTES + 1)
        check_counts(counts)
    except (ConfigError, ValueError, binascii.Error, zlib.error):
        raise StateError("a learner's preroute or counts out of range") from None
    return SavedPrior(model, rule, spec, verdicts, counts)


def read(path: Path) -> list[SavedPrior] | None:
    """The learners in ``path``; ``None`` when there is no file; :class:`StateError` when it cannot be
    read as a snapshot."""
    data = read_bounded(path, MAX_BYTES)
    return None if data is None else decode(data)


class PrerouteState(Snapshots):
    """``cascader``'s learners at ``path``: :meth:`load` once before serving, :meth:`start` the timer
    (every ``interval_s``, written when they changed), :meth:`aclose` at shutdown (a last write).
    ``wait``: a policy is still to come (from etcd), so a learner whose cascade the policy in force does
    not name waits for it (:meth:`Cascader.restore`); ``wall`` is the wall clock (``written_at``)."""

    def __init__(
        self,
        cascader: Cascader,
        path: Path,
        interval_s: float,
        *,
        wait: bool = False,
        wall: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(path, interval_s, lambda: cascader.changes, self._capture, "preroute")
        self.cascader = cascader
        self._wait = wait
        self._wall = wall

    async def load(self) -> int:
        """Take back the last run's learners (:meth:`Cascader.restore`); how many took their counts back
        now (with ``wait``, others may wait for etcd's policy). Never raises for a bad file: it is logged
        and the learners start empty."""
        try:
            saved = await asyncio.to_thread(read, self.path)
        except StateError as exc:  # replaced by the next snapshot
            self.loaded(current=False)
            log.warning("preroute: ignoring %s (%s); the learners start empty", self.path, exc)
            return 0
        if saved is None:  # the first start (said only where some cascade has preroute)
            level = logging.INFO if self.cascader.priors else logging.DEBUG
            log.log(level, "preroute: no snapshot at %s yet; the learners start empty", self.path)
            self.loaded(current=True)
            return 0
        restored = self.cascader.restore(saved, wait=self._wait)
        self.loaded(current=True)
        log.info(
            "preroute: %d of %d learners restored from %s (%d wait for etcd's policy)",
            restored,
            len(saved),
            self.path,
            len(self.cascader.pending),
        )
        return restored

    def _capture(self) -> Callable[[], bytes]:
        saved, wall = self.cascader.saved(), self._wall()  # on the loop: a copy of each learner's tables
        return lambda: encode(saved, wall)
