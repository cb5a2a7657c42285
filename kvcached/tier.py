"""The interfaces of the block store, declared once: a :class:`Tier` of the chain, what a tier hands back
when it evicts (:class:`Evicted`), and the :class:`StoreListener` that hears what each tier holds.

A tier holds immutable blocks (opaque payloads keyed by their 16-byte chain digest) within a byte budget
and evicts its least recently used blocks to make room. :class:`~kvcached.tiers.TieredStore` drives an
ordered list of tiers, fastest first, and owns every policy *between* tiers (where a put lands, demotion,
promotion, counters, listener events); a tier only keeps its own blocks, recency and budget. Two tiers
satisfy the protocol: :class:`~kvcached.ram.RamTier` (``ram``) and :class:`~kvcached.ssd.SsdTier`
(``ssd``). Tier names are what the store's counters and the index feed carry, so a tier whose events reach
the feed must be named as in ``contracts.events.TIERS``; names are unique within a store.

Contract of a tier (the store relies on each point):

* ``put`` of a digest the tier already holds only refreshes it (first content wins) and evicts nothing;
  the store calls ``put`` only after :meth:`Tier.fits` said yes.
* ``get`` serves only verified bytes: a tier that can hold torn or damaged data verifies every read,
  deletes a record that fails and raises :class:`~kvcached.errors.CorruptBlock`; the store counts it and
  treats it as a miss in that tier.
* ``get`` refreshes recency, ``touch`` does too, membership tests, iteration, ``peek`` and
  ``victims_for`` do not; ``put`` evicts exactly what ``victims_for`` named just before.
* A write that fails (disk full, read-only, IO error) raises :class:`~kvcached.errors.KvcachedError` and
  leaves the tier as it was.
* Single-threaded: the store calls a tier from one thread at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

TIER_RAM = "ram"
TIER_SSD = "ssd"
"""The names of the node's two tiers, as in ``contracts.events.TIERS``."""


class Evicted(NamedTuple):
    """A block a tier dropped to make room for a put."""

    digest: bytes
    data: bytes | None
    """The payload, for demotion into a slower tier; ``None`` when the tier was not asked for it (``put``'s
    ``with_data``) and reading it would cost IO, or when it could not be read intact."""


class Tier(Protocol):
    """One tier of the block store: blocks within ``capacity_bytes``, least recently used evicted first."""

    @property
    def name(self) -> str:
        """The tier's name in counters and events (``ram``, ``ssd``)."""
        ...

    @property
    def capacity_bytes(self) -> int:
        """The budget, in bytes as :attr:`bytes` counts them."""
        ...

    @property
    def evicted_on_open(self) -> Sequence[bytes]:
        """Digests dropped while opening (a persistent tier trimmed to a smaller budget), least recently
        used first; the store counts them as evictions. Empty for a volatile tier."""
        ...

    def __len__(self) -> int:
        """Blocks held."""
        ...

    def __contains__(self, digest: bytes) -> bool:
        """Whether the block is held (recency unchanged)."""
        ...

    def __iter__(self) -> Iterator[bytes]:
        """Digests held, least recently used first (recency unchanged)."""
        ...

    def fits(self, payload_bytes: int) -> bool:
        """Whether a block of ``payload_bytes`` can be held at all (its charge is within the budget)."""
        ...

    def get(self, digest: bytes) -> bytes | None:
        """The verified payload, made most recently used; ``None`` when absent. A stored block that fails
        verification is deleted and :class:`~kvcached.errors.CorruptBlock` raised."""
        ...

    def touch(self, digest: bytes) -> None:
        """Make ``digest`` (if held) the most recently used."""
        ...

    def peek(self, digest: bytes) -> bytes | None:
        """The verified payload, recency unchanged; ``None`` when absent or not intact (read for a
        demotion: nothing is deleted)."""
        ...

    def victims_for(self, payload_bytes: int) -> list[bytes]:
        """The digests a :meth:`put` of a new block of ``payload_bytes`` would evict, least recently used
        first, in that order (nothing changes): the store demotes them before the put."""
        ...

    def put(
        self, digest: bytes, data: bytes, *, data_checksum: bytes | None = None, with_data: bool = False
    ) -> list[Evicted]:
        """Hold ``data`` as the most recently used block; return the blocks evicted to make room, least
        recently used first. ``data_checksum``: the payload's 16-byte BLAKE3 (:func:`kvcached.block.checksum`)
        when the caller already verified it, so a tier that stores checksums need not compute it again.
        ``with_data``: the caller wants the evicted payloads (it demotes them); a tier that holds them in
        memory returns them regardless. :class:`ValueError` when the block does not :meth:`fits`. A put
        that fails (:class:`~kvcached.errors.KvcachedError`: a full or read-only disk) changes nothing."""
        ...

    def delete(self, digest: bytes) -> bool:
        """Remove the block; whether it was held."""
        ...

    def close(self) -> None:
        """Release what the tier holds open (idempotent); a volatile tier's blocks are simply lost."""
        ...

    # Declared last: inside this class body a member named ``bytes`` hides the builtin type from the
    # annotations that follow it.
    @property
    def bytes(self) -> int:
        """Bytes held, as charged against :attr:`capacity_bytes` (payload for RAM, records and keys for
        the SSD)."""
        ...


class StoreListener(Protocol):
    """Hears what the tiers start and stop holding (after the fact, batched per tier and operation)."""

    def on_stored(self, tier: str, digests: list[bytes]) -> None: ...

    def on_removed(self, tier: str, digests: list[bytes]) -> None: ...
