"""The SSD tier: block records in RocksDB (rocksdict), bounded in bytes, verified on every read; a
:class:`~kvcached.tier.Tier` (the store's slowest, in the node's RAM -> SSD chain).

Two key spaces in one database, always written together in one atomic ``WriteBatch``:

* ``b"r" + digest`` (17 bytes) -> the :mod:`kvcached.block` record;
* ``b"i" + seq + digest + record bytes`` (33 bytes; ``seq`` and size 8 bytes big-endian) -> empty: the
  index entry. ``seq`` is the write order.

Opening the store rebuilds the in-memory index (digest -> index key, least recently used first, bytes
held) by iterating the ``i`` range only, which reads kilobytes where the records are gigabytes: the write
order is the recency a restart starts from, the size is what the budget counts. Eviction is LRU over
that index (hits refresh it in memory only; after a restart it falls back to write order) and removes
whole records with their index entries, so the logical size never exceeds ``capacity_bytes`` (record,
both keys counted).

RocksDB options, and why:

* **WAL on, ``sync=False`` by default.** Each put is one RocksDB write, atomic through the WAL. The WAL
  write reaches the OS before ``put`` returns, so a ``kill -9`` at any point loses nothing acknowledged
  and never leaves half a record; only a power loss can drop the last unsynced writes, which a cache can
  afford (``sync=True`` fsyncs every write, ~ms each). Recovery mode ``point_in_time`` replays the WAL up
  to its last whole entry and drops a torn tail. Every record is verified on read anyway.
* **No blob files** (measured): BlobDB would keep payloads out of the LSM tree (compaction rewriting
  only keys), but a 1 MiB get from a blob file took ~1.0 ms p50 here against ~0.17 ms inline, and the
  SSD-hit budget is 2.5 ms p99 with verification. Payloads stay inline: compaction rewrites them once
  per level (the write amplification we pay for the read path). Deleted records' space returns as
  compaction proceeds, so disk usage can exceed the logical size held by that lag.
* **Compression off**: KV tensors (fp16/bf16/quantized) barely compress and every SSD hit
  would pay the decompression on the read path.
* **Block cache 8 MiB** with index and filter blocks cached, bloom filters (10 bits/key): lookups of
  absent keys skip data blocks; payload blocks are large and read once per hit, so they are left to the
  OS page cache rather than competing with the RAM tier for process memory.
* Level compaction with dynamic level bytes (space amplification ~1.1); memtable
  64 MiB (a 64 MiB block fits), WAL total bounded at 256 MiB.

Opening translates RocksDB's errors (lock held by another process, IO error) into
:class:`~kvcached.errors.KvcachedError`. Evicted records are not read back unless ``put`` is asked for
their payloads (``with_data``: a tier below wants them); the last tier of a chain never is, so its
evictions cost only the deletes.

Single-threaded use (the store is driven by one event loop).
"""

from __future__ import annotations

import logging
import struct
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

from rocksdict import (
    BlockBasedOptions,
    Cache,
    DBCompactionStyle,
    DBCompressionType,
    DBRecoveryMode,
    Options,
    Rdict,
    WriteBatch,
    WriteOptions,
)

from contracts.digest import DIGEST_BYTES
from kvcached.block import decode_record, encode_record, record_bytes
from kvcached.errors import CorruptBlock, KvcachedError
from kvcached.tier import TIER_SSD, Evicted

log = logging.getLogger(__name__)

RECORD_PREFIX = b"r"
INDEX_PREFIX = b"i"
_INDEX = struct.Struct(f">c Q{DIGEST_BYTES}sQ".replace(" ", ""))
KEY_BYTES = len(RECORD_PREFIX) + DIGEST_BYTES + _INDEX.size
"""Key bytes charged to each block on top of its record (both keys)."""
BLOCK_CACHE_BYTES = 8 * 1024 * 1024
MEMTABLE_BYTES = 64 * 1024 * 1024
MAX_WAL_BYTES = 256 * 1024 * 1024


def db_options() -> Options:
    """The RocksDB options of the SSD tier (see the module docstring for each choice)."""
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.set_wal_recovery_mode(DBRecoveryMode.point_in_time())
    opts.set_compression_type(DBCompressionType.none())
    opts.set_compaction_style(DBCompactionStyle.level())
    opts.set_level_compaction_dynamic_level_bytes(True)
    opts.set_write_buffer_size(MEMTABLE_BYTES)
    opts.set_max_total_wal_size(MAX_WAL_BYTES)
    table = BlockBasedOptions()
    table.set_block_cache(Cache(BLOCK_CACHE_BYTES))
    table.set_cache_index_and_filter_blocks(True)
    table.set_bloom_filter(10, False)
    opts.set_block_based_table_factory(table)
    opts.set_keep_log_file_num(4)
    return opts


def record_key(digest: bytes) -> bytes:
    return RECORD_PREFIX + digest


def index_key(seq: int, digest: bytes, size: int) -> bytes:
    return _INDEX.pack(INDEX_PREFIX, seq, digest, size)


def decode_index_key(key: bytes) -> tuple[int, bytes, int]:
    """``(seq, digest, record bytes)`` of an index key; ``ValueError`` when it is not one."""
    if len(key) != _INDEX.size or not key.startswith(INDEX_PREFIX):
        raise ValueError(f"not an index key ({len(key)} bytes)")
    _, seq, digest, size = _INDEX.unpack(key)
    return int(seq), bytes(digest), int(size)


def _charge(key: bytes) -> int:
    """Bytes charged for the block of index key ``key``: its record and both keys."""
    return decode_index_key(key)[2] + KEY_BYTES


class SsdTier:
    """Block records in a RocksDB at ``path``, at most ``capacity_bytes`` charged (records and keys).

    ``sync``: fsync every write (see the module docstring). ``name``: the tier's name in counters and
    events. :class:`KvcachedError` when the database cannot be opened; :attr:`evicted_on_open` lists what
    opening trimmed to the budget."""

    def __init__(self, path: Path, capacity_bytes: int, *, sync: bool = False, name: str = TIER_SSD) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.bytes = 0
        self._write = WriteOptions()
        self._write.sync = sync
        self._index: OrderedDict[bytes, bytes] = OrderedDict()  # digest -> index key, LRU first
        self._seq = 0
        try:
            path.mkdir(parents=True, exist_ok=True)
            self._db: Rdict | None = Rdict(str(path), db_options())
            self.evicted_on_open: list[bytes] = self._rebuild()
        except Exception as exc:  # rocksdict raises bare Exception (lock held, IO error, ...)
            raise KvcachedError(f"cannot open the SSD tier at {path}: {exc}") from exc

    def _rebuild(self) -> list[bytes]:
        """Index every index entry, drop entries that do not parse and older entries of a digest, then
        trim to the budget (it may have shrunk since the last run). Returns the digests trimmed."""
        db = self._live()
        junk = WriteBatch(raw_mode=True)
        n_junk = 0
        for raw_key in db.keys(from_key=INDEX_PREFIX):
            key = bytes(raw_key)  # type: ignore[arg-type]
            if not key.startswith(INDEX_PREFIX):
                break
            try:
                seq, digest, size = decode_index_key(key)
            except ValueError:
                junk.delete(key)
                n_junk += 1
                continue
            old = self._index.pop(digest, None)
            if old is not None:  # keys iterate in seq order: the later entry wins, the record is shared
                junk.delete(old)
                n_junk += 1
                self.bytes -= _charge(old)
            self._index[digest] = key
            self.bytes += size + KEY_BYTES
            self._seq = max(self._seq, seq + 1)
        if n_junk:
            log.warning("ssd tier: dropping %d stray or duplicate index entries", n_junk)
            db.write(junk, self._write)
        victims = self._victims_over(0)
        self._evict(victims)
        log.info("ssd tier: %d blocks, %d bytes held after open", len(self._index), self.bytes)
        return victims

    def _live(self) -> Rdict:
        if self._db is None:
            raise RuntimeError("ssd tier is closed")
        return self._db

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._index

    def __iter__(self) -> Iterator[bytes]:
        """Digests from least to most recently used."""
        return iter(list(self._index))

    def fits(self, payload_bytes: int) -> bool:
        """Whether a block with ``payload_bytes`` can be held at all."""
        return record_bytes(payload_bytes) + KEY_BYTES <= self.capacity_bytes

    def touch(self, digest: bytes) -> None:
        """Make ``digest`` (if held) the most recently used (in memory: a restart falls back to write
        order)."""
        if digest in self._index:
            self._index.move_to_end(digest)

    def get(self, digest: bytes) -> bytes | None:
        """The verified payload (made most recently used); ``None`` when absent. A record that fails
        verification (or vanished) is deleted with its index entry; :class:`CorruptBlock` is raised for
        a failed one (the caller counts and reports it)."""
        if digest not in self._index:
            return None
        raw = self._read(digest)
        if not isinstance(raw, bytes):
            self.delete(digest)
            raise CorruptBlock("index entry without a record")
        try:
            data = decode_record(digest, raw)
        except CorruptBlock:
            self.delete(digest)
            raise
        self._index.move_to_end(digest)
        return data

    def put(
        self, digest: bytes, data: bytes, *, data_checksum: bytes | None = None, with_data: bool = False
    ) -> list[Evicted]:
        """Write the block's record and index entry, and delete the records evicted to make room (one
        atomic batch); return the evicted blocks, least recently used first, with their verified payloads
        when ``with_data`` (read before they are deleted; ``None`` for one that fails verification) and
        without otherwise. ``data_checksum``: the payload's checksum when the caller verified it. The
        caller checks :meth:`fits` first; a held digest is only refreshed."""
        if digest in self._index:
            self._index.move_to_end(digest)
            return []
        record = encode_record(digest, data, data_checksum=data_checksum)
        charge = len(record) + KEY_BYTES
        if charge > self.capacity_bytes:
            raise ValueError(f"record of {len(record)} bytes exceeds the SSD budget of {self.capacity_bytes}")
        victims = self._victims_over(charge)
        evicted = [Evicted(v, self._read_intact(v) if with_data else None) for v in victims]
        batch = self._evict_batch(victims)
        key = index_key(self._seq, digest, len(record))
        batch.put(record_key(digest), record)
        batch.put(key, b"")
        self._commit(batch, f"write block {digest.hex()}")
        self._drop_index(victims)  # only now: a failed write changed nothing
        self._seq += 1
        self._index[digest] = key
        self.bytes += charge
        return evicted

    def victims_for(self, payload_bytes: int) -> list[bytes]:
        """The least recently used digests a put of a new block of ``payload_bytes`` would evict (nothing
        changes)."""
        return self._victims_over(record_bytes(payload_bytes) + KEY_BYTES)

    def peek(self, digest: bytes) -> bytes | None:
        """The verified payload of a held block, recency unchanged; ``None`` when absent or not intact (a
        record that fails verification is left for its eviction to delete)."""
        return self._read_intact(digest) if digest in self._index else None

    def _commit(self, batch: WriteBatch, what: str) -> None:
        """Write ``batch`` (atomic); :class:`KvcachedError` when RocksDB refuses it (disk full, read-only
        file system, IO error), with nothing written."""
        db = self._live()
        try:
            db.write(batch, self._write)
        except Exception as exc:  # rocksdict raises bare Exception
            raise KvcachedError(f"{self.name} tier: cannot {what}: {exc}") from exc

    def _read_intact(self, digest: bytes) -> bytes | None:
        """The verified payload of a held block about to be evicted (recency unchanged); ``None`` when
        its record is missing or fails verification (it is being deleted anyway)."""
        raw = self._read(digest)
        if not isinstance(raw, bytes):
            return None
        try:
            return decode_record(digest, raw)
        except CorruptBlock as exc:
            log.warning("%s tier: evicted corrupt block %s undemoted: %s", self.name, digest.hex(), exc)
            return None

    def delete(self, digest: bytes) -> bool:
        """Remove the block's record and index entry; whether it was held."""
        if digest not in self._index:
            return False
        self._evict([digest])
        return True

    def _read(self, digest: bytes) -> object:
        """The raw record of ``digest`` (``None`` when missing); :class:`KvcachedError` on an IO error."""
        db = self._live()
        try:
            return db.get(record_key(digest))
        except Exception as exc:  # rocksdict raises bare Exception
            raise KvcachedError(f"{self.name} tier: cannot read block {digest.hex()}: {exc}") from exc

    def _victims_over(self, n_bytes: int) -> list[bytes]:
        """The least recently used digests to evict so that ``n_bytes`` more are within the budget."""
        over = self.bytes + n_bytes - self.capacity_bytes
        out: list[bytes] = []
        for digest, key in self._index.items():
            if over <= 0:
                break
            out.append(digest)
            over -= _charge(key)
        return out

    def _evict_batch(self, digests: list[bytes]) -> WriteBatch:
        """A batch deleting the blocks ``digests`` (the index is unchanged: :meth:`_drop_index` after the
        write succeeded)."""
        batch = WriteBatch(raw_mode=True)
        for digest in digests:
            batch.delete(record_key(digest))
            batch.delete(self._index[digest])
        return batch

    def _drop_index(self, digests: list[bytes]) -> None:
        for digest in digests:
            self.bytes -= _charge(self._index.pop(digest))

    def _evict(self, digests: list[bytes]) -> None:
        if digests:
            self._commit(self._evict_batch(digests), f"delete {len(digests)} blocks")
            self._drop_index(digests)

    def close(self) -> None:
        """Flush the memtable and close the database (idempotent). A failed flush is logged (what it
        lost is in the WAL, replayed at the next open) and the database is closed anyway; a failed close
        raises :class:`KvcachedError`, and the tier counts as closed either way."""
        db = self._db
        if db is None:
            return
        try:
            db.flush()
        except Exception as exc:  # rocksdict raises bare Exception
            log.warning("%s tier: flush at close failed (the WAL keeps the writes): %s", self.name, exc)
        self._db = None
        try:
            db.close()
        except Exception as exc:
            raise KvcachedError(f"{self.name} tier: cannot close the database: {exc}") from exc
