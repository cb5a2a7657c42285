"""The tiered block store: an ordered chain of :class:`~kvcached.tier.Tier` s, fastest first, keyed by
chain digest. The node's chain is RAM (:mod:`kvcached.ram`) in front of an optional SSD
(:mod:`kvcached.ssd`); :meth:`TieredStore.of` builds any other chain (two RAM tiers of different budgets
in front of the SSD, ...). Every policy between tiers lives here; a tier only keeps its own blocks.

Movement, for tiers ``0..n-1``:

* ``put`` stores into the fastest tier that fits the block (a block larger than the RAM budget goes
  straight to the SSD); none fits: :class:`BadRequest`. With ``write_through``, also into the next
  slower tier that fits it, before ``put`` returns (the SSD: a ``kill -9`` then loses no acknowledged
  block; one RocksDB write per put, and a later RAM eviction costs no write).
* Evictions from tier ``i`` are *demoted*: each is written into the next slower tier that fits it,
  unless that tier already holds it (with two tiers: into the SSD unless it holds the block). At the last
  tier, or with no tier below that fits, they are dropped.
* A get tries the tiers in order. A hit in tier ``i`` is verified (by the tier), served and *promoted*:
  copied into the fastest tier that fits it; the copy in tier ``i`` stays, so evicting that block again
  costs no write. Tiers are therefore inclusive for promoted blocks: :meth:`TieredStore.held` may list a
  digest under several tiers, which is the truth the index feed should publish. A hit also refreshes the
  block in every slower tier.

Blocks are immutable: a put of a digest already held keeps the first content (the digest names
tokens, not bytes) and only refreshes it in every tier. RAM holds bytes that were checked when they were
put (RAM is never torn); every SSD read is verified (:mod:`kvcached.block`), and a record that fails is
deleted, counted under ``<tier>_corrupt``, logged and answered as a miss in that tier, never served.

Listener: :class:`~kvcached.tier.StoreListener` hears every change of what a tier holds, after the store
changed, digests batched per tier and per operation (``on_stored("ssd", [...])`` then
``on_removed("ram", [...])`` for a demotion: what a put evicts is demoted before the put, so a block is
never announced in neither tier).

A write a tier refuses (a full or read-only disk: :class:`KvcachedError`) fails the call with nothing half
done: a failed demotion leaves the faster tier as it was (the put that needed the room fails, its block
stored nowhere), a failed put leaves its victims demoted and still held, a failed write-through stores
nothing (and a write-through whose slower copy was written is kept there, acknowledged, when the faster
tier's demotion is refused); every change that was made is announced. The daemon turns them into index events
(``Stored``/``Removed`` with tier ``ram``/``ssd``).

Thread-safety: none. The store is driven from one thread (the daemon's event loop, or a worker thread
it hands whole calls to, one at a time); RocksDB calls are short enough to run inline.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from contracts.kvcached import MAX_BLOCK_BYTES_DEFAULT
from kvcached.block import check_digest, checksum
from kvcached.errors import BadRequest, CorruptBlock, KvcachedConfigError, KvcachedError
from kvcached.ram import RamTier
from kvcached.ssd import SsdTier
from kvcached.tier import TIER_SSD, Evicted, StoreListener, Tier

log = logging.getLogger(__name__)

COUNTERS = ("hits", "misses", "evictions", "demotions", "promotions", "corrupt")
"""The counters kept per tier, see :meth:`TieredStore.stats`."""


class TieredStore:
    """RAM (``ram_bytes`` of payload) over an optional SSD tier at ``ssd_path`` (``ssd_bytes`` of records).

    Opening the SSD tier rebuilds its index from RocksDB; :class:`KvcachedError` when it cannot be
    opened (another process holds it, IO error). Without an SSD path, :meth:`held` and :meth:`stats`
    still list an empty ``ssd`` tier, so a feed snapshot and the metrics keep their shape.

    ``max_block_bytes``: the largest payload a put accepts. Counters per tier, see :meth:`stats`:
    ``hits``/``misses`` (a get that reached the tier), ``evictions`` (blocks that left the tier for its
    budget), ``demotions`` (evictions written to a slower tier; counted under both tiers), ``promotions``
    (hits copied into a faster tier; both tiers), ``corrupt`` (records that failed verification).
    """

    _tiers: list[Tier]
    _absent: tuple[str, ...]
    _listener: StoreListener | None
    _counts: dict[str, dict[str, int]]
    max_block_bytes: int
    #: Each put is also written into the next slower tier that fits it (see the module docstring).
    write_through: bool

    def __init__(
        self,
        ram_bytes: int,
        ssd_path: Path | None,
        ssd_bytes: int,
        *,
        max_block_bytes: int = MAX_BLOCK_BYTES_DEFAULT,
        listener: StoreListener | None = None,
        write_through: bool = False,
    ) -> None:
        if ram_bytes < 0 or ssd_bytes < 0:
            raise KvcachedConfigError("ram_bytes and ssd_bytes must be >= 0")
        _check_max_block_bytes(max_block_bytes)  # before the SSD is opened (and locked)
        chain: list[Tier] = [RamTier(ram_bytes)]
        if ssd_path is not None:
            chain.append(SsdTier(ssd_path, ssd_bytes))
        self._setup(chain, max_block_bytes, listener, absent=() if ssd_path is not None else (TIER_SSD,))
        self.write_through = write_through

    @classmethod
    def of(
        cls,
        tiers: Sequence[Tier],
        *,
        max_block_bytes: int = MAX_BLOCK_BYTES_DEFAULT,
        listener: StoreListener | None = None,
    ) -> TieredStore:
        """A store over ``tiers``, fastest first (already opened; the store closes them in :meth:`close`).
        :class:`KvcachedConfigError` for an empty chain or two tiers of one name."""
        store = cls.__new__(cls)
        store._setup(list(tiers), max_block_bytes, listener, absent=())
        store.write_through = False
        return store

    def _setup(
        self,
        tiers: list[Tier],
        max_block_bytes: int,
        listener: StoreListener | None,
        *,
        absent: tuple[str, ...],
    ) -> None:
        """Both constructors end here. ``absent``: tier names listed empty by :meth:`held` and
        :meth:`stats` although the chain lacks them."""
        _check_max_block_bytes(max_block_bytes)
        names = [tier.name for tier in tiers] + list(absent)
        if not tiers:
            raise KvcachedConfigError("a store needs at least one tier")
        if len(set(names)) != len(names):
            raise KvcachedConfigError(f"tier names must be unique, got {', '.join(names)}")
        self.max_block_bytes = max_block_bytes
        self._listener = listener
        self._tiers = tiers
        self._absent = absent
        self._counts = {name: dict.fromkeys(COUNTERS, 0) for name in names}
        for tier in tiers:
            self._counts[tier.name]["evictions"] += len(tier.evicted_on_open)

    # -- writes ---------------------------------------------------------------------------------------

    def put(self, digest: bytes, data: bytes, checksum: bytes | None = None) -> None:
        """Store block ``digest``. :class:`BadRequest` (nothing stored) for a digest that is not 16 bytes,
        a payload over ``max_block_bytes`` or larger than every tier, or a ``checksum`` (16-byte BLAKE3
        of ``data``, optional) that does not match. Idempotent."""
        digest = check_digest(digest)
        data = bytes(data)
        if len(data) > self.max_block_bytes:
            raise BadRequest(f"block of {len(data)} bytes exceeds the limit of {self.max_block_bytes}")
        summed = None
        if checksum is not None:
            summed = _checksum(data)
            if checksum != summed:
                raise BadRequest("checksum does not match the block's bytes")
        if any(digest in tier for tier in self._tiers):
            for tier in self._tiers:
                tier.touch(digest)
            return
        for i, tier in enumerate(self._tiers):
            if tier.fits(len(data)):
                copied = False
                if self.write_through:  # the slower copy first: a failed write leaves nothing behind
                    j = self._fastest_fitting(len(data), range(i + 1, len(self._tiers)))
                    if j is not None and digest not in self._tiers[j]:
                        self._store(j, [(digest, data)], data_checksum=summed)
                        copied = True
                try:
                    self._store(i, [(digest, data)], data_checksum=summed)
                except KvcachedError as exc:
                    if not copied:
                        raise
                    # Tier i refused room (a demotion the disk refused); the block is held, and announced,
                    # in the slower tier: the put is kept there, not reported failed.
                    log.warning(
                        "%s tier: block %s kept in the slower tier only: %s", tier.name, digest.hex(), exc
                    )
                return
        raise BadRequest(f"block of {len(data)} bytes is larger than every tier's budget")

    def _store(
        self,
        i: int,
        blocks: list[tuple[bytes, bytes]],
        *,
        data_checksum: bytes | None = None,
        demoted_from: int | None = None,
    ) -> None:
        """Put ``blocks`` (each fits) into tier ``i``, one at a time: what a put will evict is demoted
        first, then the put is made, then announced. A failed write (:class:`KvcachedError`, a full or
        read-only disk) raises with every step before it complete and announced and nothing half done: a
        failed demotion leaves tier ``i`` untouched (its victims stay where they were), a failed put leaves
        them in both tiers. ``data_checksum``: the verified checksum of the only block (a client's put);
        ``demoted_from``: the faster tier the blocks are demoted from (each stored one is counted)."""
        assert data_checksum is None or len(blocks) == 1
        tier = self._tiers[i]
        below = i + 1 < len(self._tiers)
        stored: list[bytes] = []
        removed: list[bytes] = []
        try:
            for digest, data in blocks:
                if digest in tier:
                    tier.touch(digest)
                    continue
                if below:
                    victims = tier.victims_for(len(data))
                    self._demote(i, [Evicted(v, tier.peek(v)) for v in victims])
                evicted = tier.put(digest, data, data_checksum=data_checksum)
                self._counts[tier.name]["evictions"] += len(evicted)
                for gone in evicted:
                    if gone.digest in stored:  # a block of this batch evicted by a later one: never announced
                        stored.remove(gone.digest)
                    else:
                        removed.append(gone.digest)
                stored.append(digest)
                if demoted_from is not None:
                    self._counts[self._tiers[demoted_from].name]["demotions"] += 1
                    self._counts[tier.name]["demotions"] += 1
        finally:
            self._emit_removed(tier.name, removed)
            self._emit_stored(tier.name, stored)

    def _demote(self, i: int, evicted: list[Evicted]) -> None:
        """Write tier ``i``'s evictions each into the next slower tier that fits it, unless that tier
        holds it already; dropped when none fits or the payload could not be read."""
        moving: dict[int, list[tuple[bytes, bytes]]] = {}
        for digest, data in evicted:
            if data is None:
                continue
            j = self._fastest_fitting(len(data), range(i + 1, len(self._tiers)))
            if j is not None and digest not in self._tiers[j]:
                moving.setdefault(j, []).append((digest, data))
        for j, blocks in sorted(moving.items()):
            self._store(j, blocks, demoted_from=i)

    def _promote(self, i: int, digest: bytes, data: bytes) -> None:
        """Copy a block served from tier ``i`` into the fastest tier above it that fits (kept in ``i``)."""
        j = self._fastest_fitting(len(data), range(i))
        if j is not None:
            self._store(j, [(digest, data)])
            self._counts[self._tiers[i].name]["promotions"] += 1
            self._counts[self._tiers[j].name]["promotions"] += 1

    def _fastest_fitting(self, payload_bytes: int, among: range) -> int | None:
        return next((j for j in among if self._tiers[j].fits(payload_bytes)), None)

    def delete(self, digest: bytes) -> bool:
        """Remove block ``digest`` from every tier; whether any tier held it."""
        digest = check_digest(digest)
        held = False
        for tier in self._tiers:
            if tier.delete(digest):
                held = True
                self._emit_removed(tier.name, [digest])
        return held

    # -- reads ----------------------------------------------------------------------------------------

    def get(self, digest: bytes) -> bytes | None:
        """The block's bytes from the fastest tier holding it intact (verified by the tier, promoted when
        it was not the fastest); ``None`` on a miss. A corrupt record is dropped, counted and passed over
        as a miss in its tier."""
        digest = check_digest(digest)
        for i, tier in enumerate(self._tiers):
            counts = self._counts[tier.name]
            try:
                data = tier.get(digest)
            except CorruptBlock as exc:
                counts["corrupt"] += 1
                counts["misses"] += 1
                log.warning("%s tier: dropped corrupt block %s: %s", tier.name, digest.hex(), exc)
                self._emit_removed(tier.name, [digest])
                continue
            if data is None:
                counts["misses"] += 1
                continue
            counts["hits"] += 1
            for slower in self._tiers[i + 1 :]:
                slower.touch(digest)
            try:
                self._promote(i, digest, data)
            except KvcachedError as exc:  # a demotion the disk refused: the verified block is served anyway
                log.warning("%s tier: block %s served unpromoted: %s", tier.name, digest.hex(), exc)
            return data
        return None

    def tier_of(self, digest: bytes) -> str | None:
        """The name of the fastest tier holding ``digest``, or ``None``."""
        return next((tier.name for tier in self._tiers if digest in tier), None)

    def longest_prefix(self, digests: Sequence[bytes]) -> tuple[int, list[str]]:
        """How many leading blocks of the chain ``digests`` are held, and the fastest tier of each.
        The matched prefix is refreshed tail first (its head ends most recently used), in every tier:
        chains then lose their tail before their head (see :mod:`kvcached.ram`)."""
        names: list[str] = []
        for digest in digests:
            name = self.tier_of(check_digest(digest))
            if name is None:
                break
            names.append(name)
        matched = [bytes(d) for d in digests[: len(names)]]
        for tier in self._tiers:
            for digest in reversed(matched):
                tier.touch(digest)
        return len(names), names

    def contains(self, digests: Sequence[bytes]) -> list[bool]:
        """Whether each digest is held in any tier (recency unchanged)."""
        return [self.tier_of(check_digest(d)) is not None for d in digests]

    def held(self) -> dict[str, list[bytes]]:
        """Every digest each tier holds, least recently used first (for an index feed snapshot)."""
        out = {tier.name: list(tier) for tier in self._tiers}
        out.update((name, []) for name in self._absent)
        return out

    def stats(self) -> dict[str, int | float]:
        """Counters and gauges, flat: ``<tier>_<name>`` for the names in :data:`COUNTERS` and
        ``bytes`` (as the tier charges them: payload bytes for RAM, record + key bytes for the SSD),
        ``blocks`` and ``capacity_bytes``; zeros for an absent tier."""
        out: dict[str, int | float] = {}
        for name, counts in self._counts.items():
            for counter, value in counts.items():
                out[f"{name}_{counter}"] = value
        for tier in self._tiers:
            out[f"{tier.name}_bytes"] = tier.bytes
            out[f"{tier.name}_blocks"] = len(tier)
            out[f"{tier.name}_capacity_bytes"] = tier.capacity_bytes
        for name in self._absent:
            out[f"{name}_bytes"] = out[f"{name}_blocks"] = out[f"{name}_capacity_bytes"] = 0
        return out

    def close(self) -> None:
        """Close every tier (idempotent). RAM contents are not written down: a cache loses them."""
        for tier in self._tiers:
            tier.close()

    # -- events ---------------------------------------------------------------------------------------

    def _emit_stored(self, tier: str, digests: list[bytes]) -> None:
        if self._listener is not None and digests:
            self._listener.on_stored(tier, digests)

    def _emit_removed(self, tier: str, digests: list[bytes]) -> None:
        if self._listener is not None and digests:
            self._listener.on_removed(tier, digests)


def _check_max_block_bytes(max_block_bytes: int) -> None:
    if max_block_bytes <= 0:
        raise KvcachedConfigError("max_block_bytes must be positive")


_checksum = checksum  # ``put``'s parameter named ``checksum`` shadows the function
