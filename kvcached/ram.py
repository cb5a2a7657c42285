"""The RAM tier: a byte-budgeted LRU of verified blocks (sans-IO, no clock); a :class:`~kvcached.tier.Tier`.

Policy: LRU, kept in one ``OrderedDict`` (O(1) hit, insert and eviction). Why LRU and not S3-FIFO or
SLRU: the RAM tier sits in front of the SSD tier, and what it evicts is *demoted*, not lost, so a wrong
eviction costs one SSD read (~0.1-1 ms), not a recompute; reuse of KV prefixes is dominated by recency
(a session's next turn, a system prompt shared by every request of a model), which LRU captures; and
scan resistance (the gain of S3-FIFO) matters less when the scan's victims stay one tier down.

Chains: a block is only useful when every block before it in its chain is held, so engines evict a
chain tail first. Blocks arrive head first (a prefix is saved in order), which under plain LRU would make
the head the oldest block. :meth:`~kvcached.tiers.TieredStore.longest_prefix` therefore refreshes a
matched chain tail first in every tier, leaving its head the most recently used: a chain that is being
asked for loses its tail before its head and a partly evicted chain keeps a usable head.

Blocks held here were checked when they were put and memory is never torn, so reads are not verified
again. Accounting counts payload bytes only (the per-entry overhead of about 200 bytes is not charged:
blocks are 16 KiB and up). Single-threaded use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvcached.tier import TIER_RAM, Evicted


class RamTier:
    """Blocks in memory, at most ``capacity_bytes`` of payload; least recently used evicted first.
    ``name``: the tier's name in counters and events (a chain of several RAM tiers names each apart)."""

    __slots__ = ("_blocks", "bytes", "capacity_bytes", "name")

    evicted_on_open: tuple[bytes, ...] = ()
    """Nothing survives a restart in memory, so nothing is trimmed on open."""

    def __init__(self, capacity_bytes: int, *, name: str = TIER_RAM) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.bytes = 0
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._blocks

    def __iter__(self) -> Iterator[bytes]:
        """Digests from least to most recently used."""
        return iter(list(self._blocks))

    def fits(self, payload_bytes: int) -> bool:
        """Whether a block of ``payload_bytes`` can be held at all (it is not larger than the budget)."""
        return payload_bytes <= self.capacity_bytes

    def get(self, digest: bytes) -> bytes | None:
        """The block, made most recently used; ``None`` when absent."""
        data = self._blocks.get(digest)
        if data is not None:
            self._blocks.move_to_end(digest)
        return data

    def touch(self, digest: bytes) -> None:
        """Make ``digest`` (if held) the most recently used."""
        if digest in self._blocks:
            self._blocks.move_to_end(digest)

    def peek(self, digest: bytes) -> bytes | None:
        """The block, recency unchanged; ``None`` when absent."""
        return self._blocks.get(digest)

    def victims_for(self, n_bytes: int) -> list[bytes]:
        """The least recently used digests to evict so that ``n_bytes`` more fit (not yet evicted)."""
        over = self.bytes + n_bytes - self.capacity_bytes
        out: list[bytes] = []
        for digest, data in self._blocks.items():
            if over <= 0:
                break
            out.append(digest)
            over -= len(data)
        return out

    def put(
        self, digest: bytes, data: bytes, *, data_checksum: bytes | None = None, with_data: bool = False
    ) -> list[Evicted]:
        """Hold ``data`` as the most recently used block; return the blocks evicted to make room, least
        recently used first, always with their payloads (``with_data`` costs nothing here). The caller
        checks :meth:`fits` first; an already held digest is only refreshed (blocks are immutable).
        ``data_checksum`` is not needed: memory holds no checksums."""
        if digest in self._blocks:
            self._blocks.move_to_end(digest)
            return []
        if not self.fits(len(data)):
            raise ValueError(f"block of {len(data)} bytes exceeds the RAM budget of {self.capacity_bytes}")
        evicted = [Evicted(victim, self._pop(victim)) for victim in self.victims_for(len(data))]
        self._blocks[digest] = data
        self.bytes += len(data)
        return evicted

    def delete(self, digest: bytes) -> bool:
        """Remove the block; whether it was held."""
        if digest not in self._blocks:
            return False
        self._pop(digest)
        return True

    def close(self) -> None:
        """Nothing to release: the blocks go with the process (a cache loses them)."""

    def _pop(self, digest: bytes) -> bytes:
        data = self._blocks.pop(digest)
        self.bytes -= len(data)
        return data
