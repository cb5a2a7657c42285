"""The precise prefix index: what each endpoint holds, as its engine reports it (DESIGN.md contract 2).

Node agents translate engine KV events into :mod:`contracts.events` (``Stored``/``Removed``/``Cleared`` per
endpoint and tier); :meth:`PreciseIndex.apply` folds them in. Holdings are exact and need not be
prefix-closed (an engine may evict a chain's head and keep its tail), so :meth:`PreciseIndex.match` walks
the request's chain from block 0 and an endpoint's count stops at its first missing block.

Layout. Endpoints get small-int *slots* (freed slots are reused, lowest first); a set of endpoints is an
int bitmask. ``_held`` maps digest -> mask of the endpoints holding it in an engine tier (``gpu``,
``cpu``, ``disk``: :data:`~contracts.events.ENGINE_TIERS`) *or* speculatively; a match is one dict lookup
and one AND per block. The other structures exist only where used:

- ``_split``: digest -> ``[gpu, cpu, disk]`` masks, for digests some endpoint holds in ``cpu`` or
  ``disk`` (a gpu-only fleet never has one); for any other digest the exact part of ``_held`` is gpu;
- ``_spec_by_slot[slot]``: digest -> expiry (monotonic seconds) of the endpoint's speculative entries.
  For one (endpoint, digest) a holding is exact or speculative, never both: a speculative entry is only
  made for a block the endpoint does not hold, and a ``Stored`` confirms it (one ``pop``);
- ``_node[tier]``: digest -> mask for kvcached's ``ram`` and ``ssd`` tiers, which :meth:`match` ignores
  (a fetch is needed) and :meth:`PreciseIndex.match_tiers` reports; ``_node_counts[tier]``: slot -> its
  bits set in ``_node[tier]`` (kept with each change, for :meth:`PreciseIndex.node_occupancy`).

Speculative entries (:meth:`PreciseIndex.record`, called right after routing) make the gateway prefer an
endpoint for a prefix it was just sent, before the engine's events arrive. They count until confirmed
by an engine-tier ``Stored`` for that (endpoint, digest), dropped by an engine-tier ``Removed`` or
``Cleared`` for it, or ``speculative_ttl_s`` after the last record. Records expire from a heap ordered by
expiry, at most :data:`SWEEP_ENTRIES` per call (bounded work, and memory bounded because every record
call sweeps more than it adds); :meth:`match` stays exact meanwhile (a slow path checks expiries while
an expired entry waits for its sweep).

Costs: :meth:`~PreciseIndex.match`, O(blocks); :meth:`~PreciseIndex.apply`, O(digests) for ``Stored`` and
``Removed``; a ``Cleared``, :meth:`~PreciseIndex.clear_endpoint` and :meth:`~PreciseIndex.drop_endpoint`
scan every entry (O(all digests), tens of ms at a million: they are rare, an engine restart).
``load/bench/index.py`` measures all of these. No clock reads: ``now`` is monotonic seconds from the caller.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Sequence

from contracts.digest import Digest
from contracts.errors import ConfigError
from contracts.events import ENGINE_TIERS, TIERS, EndpointId, EventError, IndexEvent, Removed, Stored
from extproc.index.interface import DEFAULT_MAX_MATCH_BLOCKS

DEFAULT_SPECULATIVE_TTL_S = 10.0
"""Seconds a speculative entry counts unconfirmed: enough for an engine to prefill and send its events."""

SWEEP_ENTRIES = 4
"""Speculative records (each up to ``max_match_blocks`` digests) expired per call, at most."""

SPECULATIVE = "speculative"
"""The :meth:`PreciseIndex.match_tiers` key for blocks held speculatively only."""

_ENGINE = tuple(t for t in TIERS if t in ENGINE_TIERS)  # ("gpu", "cpu", "disk"): positions in _split
_ENGINE_INDEX = {tier: k for k, tier in enumerate(_ENGINE)}
_NODE = tuple(t for t in TIERS if t not in ENGINE_TIERS)  # ("ram", "ssd")
_ALL_ENGINE = frozenset(range(len(_ENGINE)))
assert _ENGINE[0] == "gpu"

_Expiry = tuple[float, int, int, dict[bytes, float], list[bytes]]
"""A speculative record in the expiry heap: (expiry, serial, slot, that slot's entries when recorded,
digests). A heap, not a FIFO: the TTL may change at run time (policy), so records need not expire in
the order they were made."""

_MaskOf = Callable[[bytes], int]
"""The holders of a digest, as a slot mask."""


def _check_ttl(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ConfigError(f"speculative_ttl_s must be positive and finite, got {value!r}")
    return float(value)


def _clear(table: dict[bytes, int], digest: bytes, mask: int, bit: int) -> int:
    """Unset ``bit`` (set in ``mask``, the current value) for ``digest``; drop the entry when empty.
    Returns 1 when it dropped it (what :attr:`PreciseIndex.generation` counts), else 0."""
    if mask == bit:
        del table[digest]
        return 1
    table[digest] = mask ^ bit
    return 0


class PreciseIndex:
    """A prefix index fed by engine KV events, plus speculative entries from routing decisions.

    Memory: one ``_held`` entry per digest (its key, the 16-byte digest, is shared with the events that
    carried it; its value is an int mask), whatever the number of holders; see the module docstring.
    """

    __slots__ = (
        "_bits",
        "_counts",
        "_free",
        "_generation",
        "_held",
        "_ids",
        "_max_match",
        "_node",
        "_node_counts",
        "_queue",
        "_serial",
        "_slots",
        "_spec_by_slot",
        "_split",
        "_ttl",
    )

    def __init__(
        self,
        speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S,
        max_match_blocks: int = DEFAULT_MAX_MATCH_BLOCKS,
    ) -> None:
        if (
            isinstance(max_match_blocks, bool)
            or not isinstance(max_match_blocks, int)
            or max_match_blocks < 1
        ):
            raise ConfigError(f"max_match_blocks must be a positive integer, got {max_match_blocks!r}")
        self._ttl = _check_ttl(speculative_ttl_s)
        self._max_match = max_match_blocks
        self._slots: dict[EndpointId, int] = {}
        self._ids: list[EndpointId | None] = []  # slot -> endpoint
        self._bits: list[int] = []  # slot -> 1 << slot (shared objects: a sole holder's mask costs nothing)
        self._free: list[int] = []  # heap of free slots
        self._counts: list[int] = []  # slot -> digests held exactly in an engine tier
        self._spec_by_slot: list[dict[bytes, float]] = []
        self._held: dict[bytes, int] = {}
        self._split: dict[bytes, list[int]] = {}
        self._node: dict[str, dict[bytes, int]] = {tier: {} for tier in _NODE}
        self._node_counts: dict[str, dict[int, int]] = {tier: {} for tier in _NODE}
        self._queue: list[_Expiry] = []  # a heap
        self._serial = itertools.count()
        self._generation = 0  # entries dropped from ``_held`` or a node table (:attr:`generation`)

    @property
    def max_match_blocks(self) -> int:
        """Leading blocks considered by :meth:`match` and :meth:`record`."""
        return self._max_match

    @property
    def speculative_ttl_s(self) -> float:
        """Seconds a speculative entry counts unconfirmed; a new value applies to later records."""
        return self._ttl

    @speculative_ttl_s.setter
    def speculative_ttl_s(self, value: float) -> None:
        self._ttl = _check_ttl(value)

    # -- reads ---------------------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """How many times a digest's entry left ``_held`` or a node tier's table (a ``Removed``, a
        ``Cleared``, a speculative entry expired, an endpoint cleared or dropped): :meth:`held` may have
        turned false only when it grew (see :attr:`~extproc.index.interface.PrefixIndex.generation`)."""
        return self._generation

    def match(self, digests: Sequence[Digest], now: float) -> dict[EndpointId, int]:
        """Leading blocks of ``digests`` each endpoint holds in an engine tier or speculatively (live at
        ``now``). Endpoints holding none are absent. One dict lookup and one AND per block."""
        n = min(len(digests), self._max_match)
        if n == 0:
            return {}
        queue = self._queue
        if queue and queue[0][0] <= now:
            self._expire(now, SWEEP_ENTRIES)
            if queue and queue[0][0] <= now:
                return self._walk(digests, n, lambda d: self._live(d, now))
        get = self._held.get
        alive = get(digests[0], 0)
        if not alive:
            return {}
        result: dict[EndpointId, int] = {}
        for i in range(1, n):
            held = alive & get(digests[i], 0)
            if held != alive:
                self._assign(alive ^ held, i, result)
                alive = held
                if not alive:
                    return result
        self._assign(alive, n, result)
        return result

    def _walk(self, digests: Sequence[Digest], n: int, mask: _MaskOf) -> dict[EndpointId, int]:
        """:meth:`match` with the holders of each block given by ``mask`` (the slow path)."""
        result: dict[EndpointId, int] = {}
        alive = -1  # every slot
        for i in range(n):
            held = alive & mask(digests[i])
            if held != alive:
                if i:
                    self._assign(alive ^ held, i, result)
                alive = held
                if not alive:
                    return result
        self._assign(alive, n, result)
        return result

    def _assign(self, mask: int, count: int, result: dict[EndpointId, int]) -> None:
        ids = self._ids
        while mask:
            low = mask & -mask
            endpoint = ids[low.bit_length() - 1]
            if endpoint is not None:
                result[endpoint] = count
            mask ^= low

    def _live(self, digest: bytes, now: float) -> int:
        """Holders of ``digest`` in ``_held`` less speculative ones expired at ``now`` (not yet swept)."""
        mask = self._held.get(digest, 0)
        rest, by_slot = mask, self._spec_by_slot
        while rest:
            low = rest & -rest
            if by_slot[low.bit_length() - 1].get(digest, math.inf) <= now:
                mask ^= low
            rest ^= low
        return mask

    def _speculative(self, digest: bytes) -> int:
        """The holders of ``digest`` in ``_held`` that hold it speculatively. O(holders)."""
        rest, spec, by_slot = self._held.get(digest, 0), 0, self._spec_by_slot
        while rest:
            low = rest & -rest
            if digest in by_slot[low.bit_length() - 1]:
                spec |= low
            rest ^= low
        return spec

    def match_tiers(self, digests: Sequence[Digest], now: float) -> dict[EndpointId, dict[str, int]]:
        """Where each endpoint's lead of ``digests`` lives, tier by tier (for tier placement).

        An endpoint's lead runs from block 0 while it holds the block anywhere: an engine tier, a live
        speculative entry, or kvcached's ``ram``/``ssd``. Each block of the lead is counted once, under
        the fastest place holding it, in the order gpu, cpu, disk, :data:`SPECULATIVE`, ram, ssd. Only
        places with a count appear. Slower than :meth:`match` (a Python loop per block and holder).
        """
        per_slot: dict[int, dict[str, int]] = {}
        alive = -1
        for digest in digests[: self._max_match]:
            places = self._places(digest, now)
            anywhere = 0
            for _name, mask in places:
                anywhere |= mask
            alive &= anywhere
            if not alive:
                break
            remaining = alive
            for name, mask in places:
                got = remaining & mask
                remaining ^= got
                while got:
                    low = got & -got
                    counts = per_slot.setdefault(low.bit_length() - 1, {})
                    counts[name] = counts.get(name, 0) + 1
                    got ^= low
        ids = self._ids
        return {endpoint: counts for slot, counts in per_slot.items() if (endpoint := ids[slot]) is not None}

    def _places(self, digest: bytes, now: float) -> list[tuple[str, int]]:
        """(place, holders mask) for ``digest``, fastest first."""
        spec_all = self._speculative(digest)
        live = self._live(digest, now) if spec_all else self._held.get(digest, 0)
        split = self._split.get(digest)
        engine = split if split is not None else [self._held.get(digest, 0) & ~spec_all, 0, 0]
        places = list(zip(_ENGINE, engine, strict=True))
        places.append((SPECULATIVE, live & spec_all))
        places.extend((tier, self._node[tier].get(digest, 0)) for tier in _NODE)
        return places

    def is_precise(self, endpoint: EndpointId) -> bool:
        """Always: what this index holds comes from KV events (and speculative entries they confirm or
        expire)."""
        return True

    def node_leads(self, endpoints: Iterable[EndpointId], digests: Sequence[Digest]) -> dict[EndpointId, int]:
        """Leading blocks of ``digests`` each of ``endpoints`` holds in a node tier (kvcached ``ram`` or
        ``ssd``); endpoints holding none are absent. One dict lookup per tier and block while any of them
        still holds the chain."""
        bits: dict[EndpointId, int] = {}
        for endpoint in endpoints:
            slot = self._slots.get(endpoint)
            if slot is not None:
                bits[endpoint] = self._bits[slot]
        if not bits:
            return {}
        ram, ssd = self._node["ram"], self._node["ssd"]
        alive = 0
        for bit in bits.values():
            alive |= bit
        ends: dict[EndpointId, int] = {}
        n = min(len(digests), self._max_match)
        for i in range(n):
            digest = digests[i]
            held = (ram.get(digest, 0) | ssd.get(digest, 0)) & alive
            if held != alive:
                for endpoint, bit in bits.items():
                    if alive & bit and not held & bit and i:
                        ends[endpoint] = i
                alive = held
                if not alive:
                    break
        for endpoint, bit in bits.items():
            if alive & bit:
                ends[endpoint] = n
        return ends

    def held(self, digest: Digest) -> bool:
        """Whether some endpoint holds ``digest`` in an engine tier or speculatively (live or awaiting its
        sweep), or some node store in ``ram`` or ``ssd`` (see
        :meth:`~extproc.index.interface.PrefixIndex.held`). Three dict lookups at most."""
        if digest in self._held:
            return True
        return any(digest in table for table in self._node.values())

    def unheld(self, digests: Sequence[Digest], start: int) -> int:
        """The first of ``digests[start:]`` that :meth:`held` says nobody holds, else ``len(digests)``."""
        held, nodes = self._held, tuple(self._node.values())
        for i in range(start, len(digests)):
            digest = digests[i]
            if digest not in held and not any(digest in table for table in nodes):
                return i
        return len(digests)

    def holders(self, digest: Digest, now: float) -> list[EndpointId]:
        """Endpoints holding ``digest`` in an engine tier or live speculatively (inspection, tests)."""
        result: dict[EndpointId, int] = {}
        self._assign(self._live(digest, now), 1, result)
        return list(result)

    def occupancy(self) -> dict[EndpointId, int]:
        """Blocks each endpoint holds in an engine tier, plus its unconfirmed speculative blocks (some of
        which may have expired since the last sweep)."""
        counts, by_slot = self._counts, self._spec_by_slot
        return {endpoint: counts[slot] + len(by_slot[slot]) for endpoint, slot in self._slots.items()}

    def node_occupancy(self) -> dict[EndpointId, dict[str, int]]:
        """Blocks each endpoint (a node's kvcached pseudo endpoint) holds per node tier (``ram``,
        ``ssd``); endpoints holding none are absent. O(endpoints): the counts are kept with each change."""
        result: dict[EndpointId, dict[str, int]] = {}
        for tier, counts in self._node_counts.items():
            for slot, n in counts.items():
                endpoint = self._ids[slot]
                if n and endpoint is not None:
                    result.setdefault(endpoint, {})[tier] = n
        return result

    def endpoints(self) -> list[EndpointId]:
        """Endpoints the index has a slot for (they held something since they were last dropped)."""
        return list(self._slots)

    def __len__(self) -> int:
        """Distinct digests held in an engine tier or speculatively by at least one endpoint."""
        return len(self._held)

    # -- writes --------------------------------------------------------------------------------------

    def _slot(self, endpoint: EndpointId) -> int:
        slot = self._slots.get(endpoint)
        if slot is not None:
            return slot
        if self._free:
            slot = heapq.heappop(self._free)
            self._ids[slot] = endpoint
        else:
            slot = len(self._ids)
            self._ids.append(endpoint)
            self._bits.append(1 << slot)
            self._counts.append(0)
            self._spec_by_slot.append({})
        self._slots[endpoint] = slot
        return slot

    def record(self, endpoint: EndpointId, digests: Sequence[Digest], now: float) -> None:
        """``endpoint`` was just sent the chain ``digests``: it holds each block it does not already hold
        speculatively, until ``now + speculative_ttl_s`` (refreshed by a later record)."""
        slot = self._slot(endpoint)
        bit = self._bits[slot]
        held, mine = self._held, self._spec_by_slot[slot]
        get = held.get
        expiry = now + self._ttl
        added: list[bytes] = []
        for digest in digests[: self._max_match]:
            mask = get(digest, 0)
            if not mask & bit:
                held[digest] = mask | bit if mask else bit
            elif digest not in mine:
                continue  # held exactly
            mine[digest] = expiry
            added.append(digest)
        if added:
            heapq.heappush(self._queue, (expiry, next(self._serial), slot, mine, added))
        self._expire(now, SWEEP_ENTRIES)

    def apply(self, events: Sequence[IndexEvent], now: float) -> None:
        """Fold index events in, in order. Events for a tier outside the contract raise
        :class:`~contracts.events.EventError` (those before it are applied). ``Stored.parent`` is not
        needed: digests are chained, so a digest names its whole prefix."""
        for event in events:
            if isinstance(event, Stored):
                self._stored(self._slot(EndpointId(event.endpoint)), event.tier, event.digests)
                continue
            slot = self._slots.get(EndpointId(event.endpoint))
            if slot is None:
                continue  # holds nothing we know of
            if isinstance(event, Removed):
                self._removed(slot, event.tier, event.digests)
            elif event.tier is None:
                self._clear_slot(slot, _ALL_ENGINE, _NODE)
            elif event.tier in _ENGINE_INDEX:
                self._clear_slot(slot, frozenset((_ENGINE_INDEX[event.tier],)), ())
            elif event.tier in self._node:
                self._clear_slot(slot, frozenset(), (event.tier,))
            else:
                raise EventError(f"unknown tier {event.tier!r}; known: {', '.join(TIERS)}")
        self._expire(now, SWEEP_ENTRIES)

    def _stored(self, slot: int, tier: str, digests: Iterable[bytes]) -> None:
        bit = self._bits[slot]
        k = _ENGINE_INDEX.get(tier)
        if k is None:
            self._node_update(tier, digests, slot, add=True)
            return
        held, split, mine = self._held, self._split, self._spec_by_slot[slot]
        get = held.get
        added = 0
        if k == 0 and not split:  # the hot paths: gpu and no offload tier anywhere
            if not mine:
                for digest in digests:
                    mask = get(digest, 0)
                    if not mask & bit:
                        held[digest] = mask | bit if mask else bit
                        added += 1
            else:
                pop = mine.pop
                for digest in digests:
                    mask = get(digest, 0)
                    if not mask & bit:
                        held[digest] = mask | bit if mask else bit
                        added += 1
                    elif pop(digest, None) is not None:  # confirms a speculative entry
                        added += 1
            self._counts[slot] += added
            return
        for digest in digests:
            if k or split:
                tiers = split.get(digest)
                if tiers is None and k:
                    gpu = get(digest, 0) & ~self._speculative(digest)
                    tiers = split[digest] = [gpu, 0, 0]
                if tiers is not None:
                    tiers[k] |= bit
            mask = get(digest, 0)
            if not mask & bit:
                held[digest] = mask | bit if mask else bit
                added += 1
            elif mine and mine.pop(digest, None) is not None:  # confirms a speculative entry
                added += 1
        self._counts[slot] += added

    def _removed(self, slot: int, tier: str, digests: Iterable[bytes]) -> None:
        bit = self._bits[slot]
        k = _ENGINE_INDEX.get(tier)
        if k is None:
            self._node_update(tier, digests, slot, add=False)
            return
        held, split, mine = self._held, self._split, self._spec_by_slot[slot]
        get = held.get
        removed = 0
        for digest in digests:
            mask = get(digest, 0)
            if not mask & bit:
                continue
            if mine and mine.pop(digest, None) is not None:  # speculative: the eviction stops it
                self._generation += _clear(held, digest, mask, bit)
                continue
            tiers = split.get(digest) if split else None
            if tiers is None:
                if k == 0:
                    self._generation += _clear(held, digest, mask, bit)
                    removed += 1
                continue
            tiers[k] &= ~bit
            if not (tiers[0] | tiers[1] | tiers[2]) & bit:
                self._generation += _clear(held, digest, mask, bit)
                removed += 1
            if not tiers[1] | tiers[2]:
                del split[digest]
        self._counts[slot] -= removed

    def _node_update(self, tier: str, digests: Iterable[bytes], slot: int, *, add: bool) -> None:
        table = self._node.get(tier)
        if table is None:
            raise EventError(f"unknown tier {tier!r}; known: {', '.join(TIERS)}")
        bit = self._bits[slot]
        get = table.get
        changed = 0
        for digest in digests:
            mask = get(digest, 0)
            if add and not mask & bit:
                table[digest] = mask | bit if mask else bit
                changed += 1
            elif not add and mask & bit:
                self._generation += _clear(table, digest, mask, bit)
                changed += 1
        if changed:
            counts = self._node_counts[tier]
            counts[slot] = counts.get(slot, 0) + (changed if add else -changed)

    def _clear_slot(self, slot: int, engine: frozenset[int], node: Sequence[str]) -> None:
        """Forget what ``slot`` holds in the engine tiers at positions ``engine`` (and, if any, its
        speculative entries) and in the ``node`` tiers. Scans every entry of the tables involved."""
        bit = self._bits[slot]
        held, split = self._held, self._split
        if engine:
            mine = self._spec_by_slot[slot]
            for digest in mine:
                self._generation += _clear(held, digest, held[digest], bit)
            self._spec_by_slot[slot] = {}  # queued expiries of the old entries now find nothing to do
        if engine and self._counts[slot]:
            removed = 0
            for digest in [d for d, mask in held.items() if mask & bit]:
                tiers = split.get(digest) if split else None
                if tiers is not None:
                    for k in engine:
                        tiers[k] &= ~bit
                    if not tiers[1] | tiers[2]:
                        del split[digest]
                    if (tiers[0] | tiers[1] | tiers[2]) & bit:
                        continue
                elif 0 not in engine:
                    continue
                self._generation += _clear(held, digest, held[digest], bit)
                removed += 1
            self._counts[slot] -= removed
        for tier in node:
            table = self._node[tier]
            self._node_counts[tier].pop(slot, None)
            for digest in [d for d, mask in table.items() if mask & bit]:
                self._generation += _clear(table, digest, table[digest], bit)

    def clear_endpoint(self, endpoint: EndpointId) -> None:
        """Forget everything ``endpoint`` holds, every tier and speculative, keeping its slot (a
        ``Cleared`` with no tier, e.g. before a snapshot). O(all digests)."""
        slot = self._slots.get(endpoint)
        if slot is not None:
            self._clear_slot(slot, _ALL_ENGINE, _NODE)

    def drop_endpoint(self, endpoint: EndpointId) -> None:
        """Forget ``endpoint`` entirely and free its slot. O(all digests)."""
        slot = self._slots.pop(endpoint, None)
        if slot is None:
            return
        self._clear_slot(slot, _ALL_ENGINE, _NODE)
        self._ids[slot] = None
        heapq.heappush(self._free, slot)

    def sweep(self, now: float, max_records: int = SWEEP_ENTRIES) -> bool:
        """Expire up to ``max_records`` speculative records due at ``now``; True when none is left due
        (a shell may call it from a timer so that idle periods leave no expired backlog)."""
        self._expire(now, max_records)
        return not (self._queue and self._queue[0][0] <= now)

    def _expire(self, now: float, budget: int) -> None:
        queue, by_slot = self._queue, self._spec_by_slot
        held = self._held
        while budget > 0 and queue and queue[0][0] <= now:
            budget -= 1
            expiry, _serial, slot, mine, digests = heapq.heappop(queue)
            if mine is not by_slot[slot]:
                continue  # the slot was cleared or dropped since
            bit = self._bits[slot]
            for digest in digests:
                if mine.get(digest) == expiry:  # not refreshed, confirmed or removed since
                    del mine[digest]
                    self._generation += _clear(held, digest, held[digest], bit)
