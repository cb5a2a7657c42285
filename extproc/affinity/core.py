"""Which endpoint produced which Responses API response, per tenant: a bounded LRU with a TTL.

Pure: every method takes ``now`` (seconds, monotonic). The shell learns an entry from Envoy's completion
log (:meth:`ResponseAffinity.learn`) and the processor asks for a follow-up's endpoint
(:meth:`ResponseAffinity.lookup`). Keys are ``(scope, response_id)``: the scope is the tenant (under
``[auth]``) or the open gateway's one scope, so a tenant's lookup never sees another tenant's ids.
Across a restart the shell (:mod:`extproc.affinity.persist`) writes :func:`to_records` (expiry in
wall-clock time) and gives them back to :meth:`ResponseAffinity.restore` (both clocks passed in).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from contracts.config import Section, state_options
from contracts.errors import ConfigError

#: Outcomes of a follow-up (``kvgate_response_affinity_requests_total{outcome}``).
HIT, UNKNOWN, UNAVAILABLE = "hit", "unknown", "unavailable"
#: A change since the snapshot shell's last capture: key -> the entry now, ``None`` when it was dropped.
Journal = dict[tuple[str, str], tuple[str, float] | None]
#: Why an entry left (``kvgate_response_affinity_evicted_total{reason}``).
LRU, TTL = "lru", "ttl"
#: The scope of requests without a tenant (no ``[auth]``); tenants' are ``tenant:<id>``.
OPEN_SCOPE = "open"
#: The longest response id kept (OpenAI's and vLLM's are ``resp_`` + 32 to 48 characters).
MAX_ID = 256

#: One entry as kept across restarts (:mod:`extproc.affinity.persist`): ``(scope, response id, endpoint
#: id, endpoint address, expires)``, ``expires`` in wall-clock seconds (monotonic time does not survive a
#: restart); the address is ``""`` when the endpoint was not in the fleet at the snapshot.
Record = tuple[str, str, str, str, float]


def scope_of(tenant: str | None) -> str:
    """The key space of a request: its tenant's own, else the open gateway's."""
    return OPEN_SCOPE if tenant is None else f"tenant:{tenant}"


@dataclass(frozen=True, slots=True)
class AffinityConfig:
    """``[response_affinity]``: ``enabled``; at most ``max_entries`` ids kept (least recently used leave
    first); each kept ``ttl_s`` seconds from when it was learned or last used; kept across restarts in
    ``state_dir`` (a file per worker, written every ``snapshot_interval_s`` when changed: README.md)."""

    enabled: bool = True
    max_entries: int = 50_000
    ttl_s: float = 3600.0
    #: Where each worker keeps its table across restarts (``affinity-<worker>.json``); ``None``: not kept.
    state_dir: str | None = None
    #: How often a changed table is written there (and once more at a graceful shutdown).
    snapshot_interval_s: float = 30.0


def parse_affinity(raw: object, where: str = "response_affinity") -> AffinityConfig:
    if raw is None:
        return AffinityConfig()
    s = Section(raw, where)
    d = AffinityConfig()
    enabled = s.flag("enabled", d.enabled)
    max_entries = s.integer("max_entries", d.max_entries, minimum=1)
    ttl_s = s.number("ttl_s", d.ttl_s)
    state_dir, interval = state_options(s, where, d.snapshot_interval_s)
    s.done()
    if ttl_s <= 0:
        raise ConfigError(f"{where}.ttl_s: must be > 0, got {ttl_s}")
    return AffinityConfig(enabled, max_entries, ttl_s, state_dir, interval)


@dataclass(slots=True)
class ResponseAffinity:
    """``(scope, response_id) -> (endpoint id, expires)``, most recently used last."""

    config: AffinityConfig = field(default_factory=AffinityConfig)
    entries: OrderedDict[tuple[str, str], tuple[str, float]] = field(default_factory=OrderedDict)
    learned: int = 0
    evicted: dict[str, int] = field(default_factory=lambda: {LRU: 0, TTL: 0})
    outcomes: dict[str, int] = field(default_factory=lambda: {HIT: 0, UNKNOWN: 0, UNAVAILABLE: 0})
    #: Entries taken from the last run's snapshot (:meth:`restore`).
    restored: int = 0
    #: Bumped on every change (learned, renewed, dropped): a snapshot is written only when it moved.
    changes: int = 0
    #: Kept only for a snapshot shell (:mod:`extproc.affinity.persist` sets it to ``{}``): each key changed
    #: since the shell last took it, with its entry now (``None``: dropped), in the order of their last
    #: change, so the shell replays them onto its own copy off the event loop instead of copying the whole
    #: table on it. ``None`` when off, or once it outgrew ``2 x max_entries`` (the shell then copies the
    #: table once).
    journal: Journal | None = None

    def learn(self, scope: str, response_id: str, endpoint: str, now: float) -> bool:
        """``endpoint`` produced ``response_id`` for ``scope``; ``False`` when not kept (an id too long or
        empty)."""
        if not response_id or len(response_id) > MAX_ID:
            return False
        key = (scope, response_id)
        entry = self.entries[key] = (endpoint, now + self.config.ttl_s)
        self.entries.move_to_end(key)
        self._note(key, entry)
        self.learned += 1
        self.changes += 1
        self._expire(now)
        while len(self.entries) > self.config.max_entries:
            self._note(self.entries.popitem(last=False)[0], None)
            self.evicted[LRU] += 1
        return True

    def lookup(self, scope: str, response_id: str, now: float) -> str | None:
        """The endpoint that produced ``response_id`` in ``scope`` (its TTL renewed), else ``None``."""
        key = (scope, response_id)
        got = self.entries.get(key)
        if got is None:
            return None
        endpoint, expires = got
        if expires <= now:
            del self.entries[key]
            self._note(key, None)
            self.evicted[TTL] += 1
            self.changes += 1
            return None
        entry = self.entries[key] = (endpoint, now + self.config.ttl_s)
        self.entries.move_to_end(key)
        self._note(key, entry)
        self.changes += 1
        return endpoint

    def _note(self, key: tuple[str, str], entry: tuple[str, float] | None) -> None:
        """Journal a change of ``key`` (its entry now; ``None``: dropped) for the snapshot shell."""
        journal = self.journal
        if journal is not None:
            journal.pop(key, None)  # re-inserted: the journal's order is the order of last change
            journal[key] = entry
            if len(journal) > 2 * self.config.max_entries:  # bounded: the shell copies the table instead
                self.journal = None

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    def _expire(self, now: float) -> None:
        """Drop expired entries from the least recently used end (amortized O(1) per learn)."""
        while self.entries:
            key, (_, expires) = next(iter(self.entries.items()))
            if expires > now:
                return
            del self.entries[key]
            self._note(key, None)
            self.evicted[TTL] += 1
            self.changes += 1

    def restore(self, records: Iterable[Record], now: float, wall: float, fleet: Mapping[str, str]) -> int:
        """Take a snapshot's ``records`` (least recently used first) at monotonic ``now`` and wall-clock
        ``wall``; how many were kept. An entry is dropped when it expired in wall time, when its id is
        empty or too long, or when ``fleet`` (endpoint id -> address now) has its endpoint at another
        address (a replaced engine: its response store went with it; an endpoint not in ``fleet`` is kept,
        as etcd may name it later). Each keeps its remaining TTL (at most ``ttl_s``); only the
        ``max_entries`` most recent stay."""
        kept = 0
        for scope, response_id, endpoint, address, expires in records:
            left = min(expires - wall, self.config.ttl_s)
            if left <= 0 or not math.isfinite(left) or not response_id or len(response_id) > MAX_ID:
                continue
            now_at = fleet.get(endpoint)
            if address and now_at is not None and now_at != address:
                continue
            key = (scope, response_id)
            entry = self.entries[key] = (endpoint, now + left)
            self.entries.move_to_end(key)
            self._note(key, entry)
            kept += 1
        while len(self.entries) > self.config.max_entries:
            self._note(self.entries.popitem(last=False)[0], None)
        kept = min(kept, len(self.entries))
        self.restored += kept
        return kept


def to_records(
    items: Iterable[tuple[tuple[str, str], tuple[str, float]]],
    now: float,
    wall: float,
    fleet: Mapping[str, str],
) -> list[Record]:
    """A copy of :attr:`ResponseAffinity.entries`' items (least recently used first) as :data:`Record` s:
    the expiry moved from monotonic ``now`` to wall-clock ``wall``, the address from ``fleet`` (endpoint id
    -> address; ``""`` when absent); the expired left out."""
    return [
        (scope, response_id, endpoint, fleet.get(endpoint, ""), wall + (expires - now))
        for (scope, response_id), (endpoint, expires) in items
        if expires > now
    ]
