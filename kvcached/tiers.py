"""The tiered block store: a RAM tier in front of an SSD tier, keyed by chain digest.

``put`` stores into RAM (a block larger than the RAM budget goes straight to the SSD). RAM evictions are
*demoted*: written to the SSD unless it already holds them. An SSD hit is verified, served and *promoted*
(copied into RAM; the SSD copy stays, so evicting that block from RAM again costs no write). Tiers are
therefore inclusive for promoted blocks: :meth:`TieredStore.held` may list a digest under both, which is
the truth the index feed should publish. With no SSD path, RAM evictions are dropped.

Blocks are immutable: a put of a digest already held keeps the first content (the digest names
tokens, not bytes) and only refreshes it. RAM holds bytes that were checked when they were put (RAM is
never torn); every SSD read is verified (:mod:`kvcached.block`), and a record that fails is deleted,
counted under ``ssd_corrupt``, logged and answered as a miss, never served.

Listener: :class:`StoreListener` hears every change of what a tier holds, after the store changed,
digests batched per tier and per operation (``on_removed("ram", [...])`` then ``on_stored("ssd",
[...])`` for a demotion, ...). The daemon turns them into index events (``Stored``/``Removed`` with
tier ``ram``/``ssd``).

Thread-safety: none. The store is driven from one thread (the daemon's event loop, or a worker thread
it hands whole calls to, one at a time); RocksDB calls are short enough to run inline.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from contracts.kvcached import MAX_BLOCK_BYTES_DEFAULT
from kvcached.block import check_digest, checksum
from kvcached.errors import BadRequest, CorruptBlock, KvcachedConfigError, KvcachedError
from kvcached.ram import RamTier
from kvcached.ssd import SsdTier

log = logging.getLogger(__name__)

TIER_RAM = "ram"
TIER_SSD = "ssd"
"""Tier names, as in ``contracts.events.TIERS``."""

COUNTERS = ("hits", "misses", "evictions", "demotions", "promotions", "corrupt")


class StoreListener(Protocol):
    """Hears what the tiers start and stop holding (after the fact, batched per tier)."""

    def on_stored(self, tier: str, digests: list[bytes]) -> None: ...

    def on_removed(self, tier: str, digests: list[bytes]) -> None: ...


class TieredStore:
    """RAM (``ram_bytes`` of payload) over an optional SSD tier at ``ssd_path`` (``ssd_bytes`` of records).

    Opening the SSD tier rebuilds its index from RocksDB; :class:`KvcachedError` when it cannot be
    opened (another process holds it, IO error).

    ``max_block_bytes``: the largest payload a put accepts. Counters per tier, see :meth:`stats`:
    ``hits``/``misses`` (a get that reached the tier), ``evictions`` (blocks that left the tier for its
    budget), ``demotions`` (RAM evictions written to the SSD; counted under both tiers), ``promotions``
    (SSD hits copied into RAM; both tiers), ``corrupt`` (SSD records that failed verification).
    """

    def __init__(
        self,
        ram_bytes: int,
        ssd_path: Path | None,
        ssd_bytes: int,
        *,
        max_block_bytes: int = MAX_BLOCK_BYTES_DEFAULT,
        listener: StoreListener | None = None,
    ) -> None:
        if ram_bytes < 0 or ssd_bytes < 0:
            raise KvcachedConfigError("ram_bytes and ssd_bytes must be >= 0")
        if max_block_bytes <= 0:
            raise KvcachedConfigError("max_block_bytes must be positive")
        self.max_block_bytes = max_block_bytes
        self._listener = listener
        self._ram = RamTier(ram_bytes)
        self._ssd: SsdTier | None = None
        if ssd_path is not None:
            try:
                self._ssd = SsdTier(ssd_path, ssd_bytes)
            except Exception as exc:  # rocksdict raises bare Exception (lock held, IO error, ...)
                raise KvcachedError(f"cannot open the SSD tier at {ssd_path}: {exc}") from exc
        self._counts = {tier: dict.fromkeys(COUNTERS, 0) for tier in (TIER_RAM, TIER_SSD)}
        if self._ssd is not None and self._ssd.evicted_on_open:
            self._counts[TIER_SSD]["evictions"] += len(self._ssd.evicted_on_open)

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
        if digest in self._ram or (self._ssd is not None and digest in self._ssd):
            self._ram.touch(digest)
            if self._ssd is not None:
                self._ssd.touch(digest)
            return
        if self._ram.fits(len(data)):
            self._put_ram(digest, data)
        elif self._ssd is not None and self._ssd.fits(len(data)):
            self._put_ssd([(digest, data)], data_checksum=summed)
        else:
            raise BadRequest(f"block of {len(data)} bytes is larger than every tier's budget")

    def _put_ram(self, digest: bytes, data: bytes) -> None:
        evicted = self._ram.put(digest, data)
        if evicted:
            self._counts[TIER_RAM]["evictions"] += len(evicted)
            self._emit_removed(TIER_RAM, [d for d, _ in evicted])
            self._demote(evicted)
        self._emit_stored(TIER_RAM, [digest])

    def _demote(self, evicted: list[tuple[bytes, bytes]]) -> None:
        """Write RAM evictions the SSD lacks to the SSD (dropped when there is none or they do not fit)."""
        if self._ssd is None:
            return
        moving = [(d, data) for d, data in evicted if d not in self._ssd and self._ssd.fits(len(data))]
        if moving:
            self._counts[TIER_RAM]["demotions"] += len(moving)
            self._counts[TIER_SSD]["demotions"] += len(moving)
            self._put_ssd(moving)

    def _put_ssd(self, blocks: list[tuple[bytes, bytes]], data_checksum: bytes | None = None) -> None:
        assert self._ssd is not None
        dropped: list[bytes] = []
        for digest, data in blocks:
            dropped.extend(self._ssd.put(digest, data, data_checksum=data_checksum))
        new = {digest for digest, _ in blocks}
        if dropped:
            # a block of this batch evicted by a later one was never announced: do not remove it
            self._counts[TIER_SSD]["evictions"] += len(dropped)
            self._emit_removed(TIER_SSD, [d for d in dropped if d not in new])
        self._emit_stored(TIER_SSD, [d for d, _ in blocks if d in self._ssd])

    def delete(self, digest: bytes) -> bool:
        """Remove block ``digest`` from every tier; whether any tier held it."""
        digest = check_digest(digest)
        in_ram = self._ram.pop(digest) is not None
        if in_ram:
            self._emit_removed(TIER_RAM, [digest])
        in_ssd = self._ssd is not None and self._ssd.delete(digest)
        if in_ssd:
            self._emit_removed(TIER_SSD, [digest])
        return in_ram or in_ssd

    # -- reads ----------------------------------------------------------------------------------------

    def get(self, digest: bytes) -> bytes | None:
        """The block's bytes: a RAM hit, or an SSD hit (verified, then promoted into RAM); ``None`` on a
        miss or when the SSD record was corrupt (it is dropped and counted)."""
        digest = check_digest(digest)
        data = self._ram.get(digest)
        if data is not None:
            self._counts[TIER_RAM]["hits"] += 1
            if self._ssd is not None:
                self._ssd.touch(digest)
            return data
        self._counts[TIER_RAM]["misses"] += 1
        if self._ssd is None:
            return None
        try:
            data = self._ssd.get(digest)
        except CorruptBlock as exc:
            self._counts[TIER_SSD]["corrupt"] += 1
            self._counts[TIER_SSD]["misses"] += 1
            log.warning("ssd tier: dropped corrupt block %s: %s", digest.hex(), exc)
            self._emit_removed(TIER_SSD, [digest])
            return None
        if data is None:
            self._counts[TIER_SSD]["misses"] += 1
            return None
        self._counts[TIER_SSD]["hits"] += 1
        if self._ram.fits(len(data)):
            self._counts[TIER_SSD]["promotions"] += 1
            self._counts[TIER_RAM]["promotions"] += 1
            self._put_ram(digest, data)
        return data

    def tier_of(self, digest: bytes) -> str | None:
        """The fastest tier holding ``digest``, or ``None``."""
        if digest in self._ram:
            return TIER_RAM
        if self._ssd is not None and digest in self._ssd:
            return TIER_SSD
        return None

    def longest_prefix(self, digests: Sequence[bytes]) -> tuple[int, list[str]]:
        """How many leading blocks of the chain ``digests`` are held, and the fastest tier of each.
        The matched prefix is refreshed tail first (its head ends most recently used), in both tiers."""
        tiers: list[str] = []
        for digest in digests:
            tier = self.tier_of(check_digest(digest))
            if tier is None:
                break
            tiers.append(tier)
        matched = [bytes(d) for d in digests[: len(tiers)]]
        self._ram.touch_chain(matched)
        if self._ssd is not None:
            for digest in reversed(matched):
                self._ssd.touch(digest)
        return len(tiers), tiers

    def contains(self, digests: Sequence[bytes]) -> list[bool]:
        """Whether each digest is held in any tier (recency unchanged)."""
        return [self.tier_of(check_digest(d)) is not None for d in digests]

    def held(self) -> dict[str, list[bytes]]:
        """Every digest each tier holds, least recently used first (for an index feed snapshot)."""
        return {TIER_RAM: list(self._ram), TIER_SSD: list(self._ssd) if self._ssd is not None else []}

    def stats(self) -> dict[str, int | float]:
        """Counters and gauges, flat: ``<tier>_<name>`` for the names in :data:`COUNTERS` and
        ``bytes`` (payload bytes for RAM, record + key bytes for the SSD), ``blocks`` and
        ``capacity_bytes``."""
        out: dict[str, int | float] = {}
        for tier, counts in self._counts.items():
            for name, value in counts.items():
                out[f"{tier}_{name}"] = value
        out["ram_bytes"] = self._ram.bytes
        out["ram_blocks"] = len(self._ram)
        out["ram_capacity_bytes"] = self._ram.capacity_bytes
        out["ssd_bytes"] = self._ssd.bytes if self._ssd is not None else 0
        out["ssd_blocks"] = len(self._ssd) if self._ssd is not None else 0
        out["ssd_capacity_bytes"] = self._ssd.capacity_bytes if self._ssd is not None else 0
        return out

    def close(self) -> None:
        """Close the SSD tier (idempotent). RAM contents are not written down: a cache loses them."""
        if self._ssd is not None:
            self._ssd.close()

    # -- events ---------------------------------------------------------------------------------------

    def _emit_stored(self, tier: str, digests: list[bytes]) -> None:
        if self._listener is not None and digests:
            self._listener.on_stored(tier, digests)

    def _emit_removed(self, tier: str, digests: list[bytes]) -> None:
        if self._listener is not None and digests:
            self._listener.on_removed(tier, digests)


_checksum = checksum  # ``put``'s parameter named ``checksum`` shadows the function
