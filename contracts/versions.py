"""Versions of what kvgate processes exchange, and the one compatibility rule every reader applies.

Four things carry a version (``contracts/README.md`` has the table and the upgrade order):

* :data:`DIGEST_VERSION`: the digest chain's seed material (:func:`contracts.digest.chain_seed`). Two
  digests are compared only when both sides hash under the same digest version: a different one (older or
  newer) means the endpoint's reported KV is treated as absent, never matched against this side's digests.
  kvcached daemons state theirs too (record ``kvcached/<node>`` and Stats ``digest``): gateways, peers
  and agents of another digest version do not use their blocks.
* :data:`FEED_VERSION`: the index-event feed (:class:`contracts.events.Batch`, field ``version``).
* :data:`RECORD_VERSION`: the JSON records machines write into etcd (``endpoints/<node>/<id>``, field
  ``schema``; :mod:`engines.endpoint`).
* :data:`KVCACHED_RECORD_VERSION`: the kvcached daemons' records (``kvcached/<node>``, field ``schema``;
  :func:`contracts.etcd.peer_skew`).

Rule (feed and records): a reader of version ``N`` accepts ``N - 1`` and ``N`` (:attr:`Skew.OK`). A
newer version (:attr:`Skew.NEWER`) is read leniently: only what the reader knows is kept, and the KV
data it carries (index events, the endpoint's KV events and slot restores) is treated as absent, so that
endpoint is routed without its KV reports (load and what this gateway learns from its own decisions)
until the reader is upgraded. An older version than ``N - 1`` (:attr:`Skew.TOO_OLD`) is refused. Every
skew is logged once per source and version (:class:`SkewLog`) and counted. A value without a version
field is version 1 (what kvgate wrote before versions existed).

Upgrade order that keeps routing precise throughout: gateways first (they read N - 1), then agents and
kvcached daemons. Pure: no IO.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

#: The digest chain's seed version (``b"kvgate-v<DIGEST_VERSION>\\0"`` starts the seed material).
DIGEST_VERSION = 1
#: The feed protocol's version (batches without the field are version 1).
FEED_VERSION = 2
#: The version of the JSON records agents write into etcd (records without ``schema`` are version 1).
RECORD_VERSION = 2
#: The version of the ``kvcached/<node>`` records kvcached daemons write (records without ``schema``: 1).
KVCACHED_RECORD_VERSION = 2
#: The version a value has when it carries none: what kvgate wrote before versions existed.
LEGACY_VERSION = 1


class Skew(enum.Enum):
    """How a version read compares with the reader's own."""

    OK = "ok"
    """``N - 1`` or ``N``: read as usual."""
    NEWER = "newer"
    """Above ``N``: read what is known, treat the KV data as absent (load-only for that endpoint)."""
    TOO_OLD = "too_old"
    """Below ``N - 1``: refused."""


def skew(version: int, current: int) -> Skew:
    """The compatibility rule: accept ``current - 1`` and ``current``."""
    if version > current:
        return Skew.NEWER
    if version < current - 1:
        return Skew.TOO_OLD
    return Skew.OK


def digest_matches(version: int) -> bool:
    """Whether digests made under ``version`` may be compared with this process's (only the same one)."""
    return version == DIGEST_VERSION


@dataclass(slots=True)
class SkewLog:
    """Warn once per (what, source, version) and count every skewed value (``counts[what]``); pure
    bookkeeping: :meth:`note` returns the line to log the first time, ``None`` after."""

    seen: set[tuple[str, str, int | str]] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=dict)

    def note(self, what: str, source: str, version: int | str, outcome: str) -> str | None:
        self.counts[what] = self.counts.get(what, 0) + 1
        key = (what, source, version)
        if key in self.seen:
            return None
        self.seen.add(key)
        return f"version skew: {what} of {source} is version {version}: {outcome}"


def describe(version: int, current: int) -> str:
    """What a reader does with a skewed value (for the log line)."""
    match skew(version, current):
        case Skew.NEWER:
            return f"newer than this reader's {current}; its KV data is ignored (load-only routing for it)"
        case Skew.TOO_OLD:
            return f"older than {current - 1}, the oldest this reader accepts; refused"
        case _:
            return "accepted"
