"""TieredStore: round trips through both tiers, eviction, demotion, promotion, listener events,
bad input, longest-prefix lookups and corruption injection into the RocksDB values; the node's chain
built by either constructor, and chains of three tiers built from tier objects."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from rocksdict import Options, Rdict

from kvcached.block import HEADER_BYTES, checksum
from kvcached.errors import BadRequest, CorruptBlock, KvcachedConfigError, KvcachedError
from kvcached.ram import RamTier
from kvcached.ssd import KEY_BYTES, SsdTier
from kvcached.tier import TIER_RAM, TIER_SSD
from kvcached.tiers import TieredStore

BLOCK = 1000
RECORD = BLOCK + HEADER_BYTES + KEY_BYTES


def d(i: int) -> bytes:
    return i.to_bytes(16, "big")


def data(i: int, size: int = BLOCK) -> bytes:
    return bytes([i % 256]) * size


class Recorder:
    """A StoreListener that keeps every event in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, list[bytes]]] = []

    def on_stored(self, tier: str, digests: list[bytes]) -> None:
        self.events.append(("stored", tier, list(digests)))

    def on_removed(self, tier: str, digests: list[bytes]) -> None:
        self.events.append(("removed", tier, list(digests)))

    def take(self) -> list[tuple[str, str, list[bytes]]]:
        out, self.events = self.events, []
        return out


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


@pytest.fixture(params=["init", "of"])
def store(request: pytest.FixtureRequest, tmp_path: Path, rec: Recorder) -> Iterator[TieredStore]:
    """RAM of 3 blocks over an SSD of 5 records, from the daemon's constructor or from tier objects."""
    if request.param == "init":
        s = TieredStore(3 * BLOCK, tmp_path / "ssd", 5 * RECORD, listener=rec)
    else:
        s = TieredStore.of([RamTier(3 * BLOCK), SsdTier(tmp_path / "ssd", 5 * RECORD)], listener=rec)
    yield s
    s.close()


def test_ram_round_trip(store: TieredStore, rec: Recorder) -> None:
    store.put(d(1), data(1), checksum(data(1)))
    assert store.get(d(1)) == data(1)
    assert store.tier_of(d(1)) == TIER_RAM
    assert store.get(d(2)) is None
    stats = store.stats()
    assert (stats["ram_hits"], stats["ram_misses"], stats["ssd_misses"]) == (1, 1, 1)
    assert (stats["ram_blocks"], stats["ram_bytes"], stats["ssd_blocks"]) == (1, BLOCK, 0)
    assert rec.take() == [("stored", TIER_RAM, [d(1)])]


def test_eviction_demotes_and_hit_promotes(store: TieredStore, rec: Recorder) -> None:
    for i in range(4):
        store.put(d(i), data(i))
    assert rec.take() == [
        ("stored", TIER_RAM, [d(0)]),
        ("stored", TIER_RAM, [d(1)]),
        ("stored", TIER_RAM, [d(2)]),
        ("stored", TIER_SSD, [d(0)]),  # demoted before RAM drops it: never in neither tier
        ("removed", TIER_RAM, [d(0)]),
        ("stored", TIER_RAM, [d(3)]),
    ]
    assert store.tier_of(d(0)) == TIER_SSD
    assert store.get(d(0)) == data(0)  # SSD hit, verified, promoted; d(1) is demoted for room
    assert rec.take() == [
        ("stored", TIER_SSD, [d(1)]),
        ("removed", TIER_RAM, [d(1)]),
        ("stored", TIER_RAM, [d(0)]),
    ]
    assert store.tier_of(d(0)) == TIER_RAM
    assert store.held() == {TIER_RAM: [d(2), d(3), d(0)], TIER_SSD: [d(0), d(1)]}
    stats = store.stats()
    assert stats["ram_evictions"] == 2
    assert stats["ram_demotions"] == stats["ssd_demotions"] == 2
    assert stats["ssd_promotions"] == stats["ram_promotions"] == 1
    assert stats["ssd_hits"] == 1
    assert stats["ssd_bytes"] == 2 * RECORD
    # d(0) leaves RAM again: its SSD copy stays, nothing is written
    for i in (4, 5, 6):
        store.put(d(i), data(i))
    assert store.stats()["ssd_demotions"] == 2 + 2  # d(2), d(3); not d(0)
    assert store.tier_of(d(0)) == TIER_SSD


def test_ssd_eviction_is_lru_and_reported(store: TieredStore, rec: Recorder) -> None:
    for i in range(3 + 5):  # fills RAM (3) and SSD (5)
        store.put(d(i), data(i))
    assert store.stats()["ssd_blocks"] == 5
    rec.take()
    store.put(d(8), data(8))  # demotes d(5); the SSD drops its least recently used, d(0)
    assert rec.take() == [
        ("removed", TIER_SSD, [d(0)]),
        ("stored", TIER_SSD, [d(5)]),
        ("removed", TIER_RAM, [d(5)]),
        ("stored", TIER_RAM, [d(8)]),
    ]
    assert store.get(d(0)) is None
    assert store.stats()["ssd_evictions"] == 1
    assert store.stats()["ssd_bytes"] <= 5 * RECORD


def test_survives_reopen(tmp_path: Path) -> None:
    store = TieredStore(0, tmp_path / "ssd", 100 * RECORD)
    for i in range(5):
        store.put(d(i), data(i))  # RAM budget 0: straight to the SSD
    store.close()
    store.close()  # idempotent
    again = TieredStore(0, tmp_path / "ssd", 100 * RECORD)
    try:
        assert again.held()[TIER_SSD] == [d(i) for i in range(5)]
        assert [again.get(d(i)) for i in range(5)] == [data(i) for i in range(5)]
        assert again.stats()["ssd_bytes"] == 5 * RECORD
    finally:
        again.close()


def test_write_through_puts_into_both_tiers_so_a_reopen_loses_nothing(tmp_path: Path, rec: Recorder) -> None:
    """Without write-through a block only in RAM is gone after a restart (a cache: kvcached/README.md,
    Durability); with it every acknowledged block is in the SSD tier already."""
    for write_through in (False, True):
        path = tmp_path / f"ssd-{write_through}"
        store = TieredStore(3 * BLOCK, path, 100 * RECORD, listener=rec, write_through=write_through)
        rec.take()
        for i in range(5):
            store.put(d(i), data(i))
        if write_through:
            assert store.held() == {TIER_RAM: [d(2), d(3), d(4)], TIER_SSD: [d(i) for i in range(5)]}
            assert store.stats()["ram_demotions"] == 0  # RAM's evictions were on the SSD already
            assert ("stored", TIER_SSD, [d(4)]) in rec.take()
        else:
            assert store.held() == {TIER_RAM: [d(2), d(3), d(4)], TIER_SSD: [d(0), d(1)]}
        store.close()  # RAM is not written down at a stop either
        again = TieredStore(3 * BLOCK, path, 100 * RECORD)
        try:
            kept = [i for i in range(5) if again.get(d(i)) == data(i)]
            assert kept == ([0, 1, 2, 3, 4] if write_through else [0, 1])
        finally:
            again.close()


def test_reopen_with_smaller_budget_trims_oldest(tmp_path: Path) -> None:
    store = TieredStore(0, tmp_path / "ssd", 10 * RECORD)
    for i in range(6):
        store.put(d(i), data(i))
    store.close()
    small = TieredStore(0, tmp_path / "ssd", 4 * RECORD)
    try:
        assert small.held()[TIER_SSD] == [d(2), d(3), d(4), d(5)]
        assert small.stats()["ssd_evictions"] == 2
    finally:
        small.close()


def test_without_ssd_evictions_are_dropped(rec: Recorder) -> None:
    store = TieredStore(2 * BLOCK, None, 0, listener=rec)
    for i in range(3):
        store.put(d(i), data(i))
    assert rec.take()[-2:] == [("removed", TIER_RAM, [d(0)]), ("stored", TIER_RAM, [d(2)])]
    assert store.get(d(0)) is None
    assert store.held() == {TIER_RAM: [d(1), d(2)], TIER_SSD: []}
    store.close()


def test_block_larger_than_ram_goes_to_ssd(store: TieredStore, rec: Recorder) -> None:
    big = data(7, 4 * BLOCK)
    store.put(d(7), big)
    assert store.tier_of(d(7)) == TIER_SSD
    assert rec.take() == [("stored", TIER_SSD, [d(7)])]
    assert store.get(d(7)) == big  # served from the SSD, not promoted (it cannot fit)
    assert store.tier_of(d(7)) == TIER_SSD
    assert store.stats()["ssd_promotions"] == 0


@pytest.mark.parametrize(
    ("digest", "payload", "summed", "match"),
    [
        (b"short", b"x", None, "16 bytes"),
        (d(1), b"x" * 101, None, "exceeds the limit"),
        (d(1), b"x", checksum(b"y"), "checksum"),
        (d(1), b"x" * 100, None, "larger than every tier"),
    ],
)
def test_bad_input_stores_nothing(
    tmp_path: Path, rec: Recorder, digest: bytes, payload: bytes, summed: bytes | None, match: str
) -> None:
    store = TieredStore(10, tmp_path / "ssd", 60, max_block_bytes=100, listener=rec)
    try:
        with pytest.raises(BadRequest, match=match):
            store.put(digest, payload, summed)
        assert store.held() == {TIER_RAM: [], TIER_SSD: []}
        assert rec.events == []
    finally:
        store.close()


def test_ssd_held_by_another_store_is_refused(store: TieredStore, tmp_path: Path) -> None:
    with pytest.raises(KvcachedError, match="cannot open the SSD tier"):
        TieredStore(0, tmp_path / "ssd", RECORD)


def test_bad_config() -> None:
    with pytest.raises(KvcachedConfigError):
        TieredStore(-1, None, 0)
    with pytest.raises(KvcachedConfigError):
        TieredStore(1, None, 0, max_block_bytes=0)


def test_put_is_idempotent(store: TieredStore, rec: Recorder) -> None:
    store.put(d(1), data(1))
    store.put(d(1), data(2))  # first content wins: blocks are immutable
    assert store.get(d(1)) == data(1)
    assert rec.take() == [("stored", TIER_RAM, [d(1)])]
    assert store.stats()["ram_blocks"] == 1


def test_longest_prefix_contains_and_delete(store: TieredStore, rec: Recorder) -> None:
    for i in range(5):
        store.put(d(i), data(i))  # d(0), d(1) demoted to the SSD
    chain = [d(0), d(1), d(2), d(3), d(4), d(9), d(5)]
    assert store.longest_prefix(chain) == (5, [TIER_SSD, TIER_SSD, TIER_RAM, TIER_RAM, TIER_RAM])
    assert store.longest_prefix([d(9), d(0)]) == (0, [])
    assert store.longest_prefix([]) == (0, [])
    assert store.contains([d(0), d(9), d(4)]) == [True, False, True]
    with pytest.raises(BadRequest):
        store.contains([b"bad"])
    rec.take()
    assert store.delete(d(0)) is True
    assert store.delete(d(0)) is False
    assert rec.take() == [("removed", TIER_SSD, [d(0)])]
    store.get(d(1))  # promoted: held in both tiers
    rec.take()
    assert store.delete(d(1)) is True
    assert rec.take() == [("removed", TIER_RAM, [d(1)]), ("removed", TIER_SSD, [d(1)])]
    assert store.longest_prefix(chain) == (0, [])


def test_longest_prefix_makes_chains_lose_their_tail_first(tmp_path: Path) -> None:
    store = TieredStore(3 * BLOCK, None, 0)
    chain = [d(0), d(1), d(2)]
    for i, digest in enumerate(chain):
        store.put(digest, data(i))  # head first: the head is the oldest
    assert store.longest_prefix(chain)[0] == 3  # refreshed tail first: the head is now the newest
    store.put(d(9), data(9))
    assert store.longest_prefix(chain) == (2, [TIER_RAM, TIER_RAM])
    assert store.tier_of(d(2)) is None
    store.close()


def _flip_stored_value(path: Path, digest: bytes, damage: str) -> None:
    """Damage the RocksDB value holding ``digest``, opening the database with rocksdict directly."""
    db = Rdict(str(path), Options(raw_mode=True))
    try:
        key = b"r" + digest
        if damage == "missing":
            del db[key]
            return
        raw = bytearray(db[key])
        if damage == "flip":
            raw[len(raw) // 2] ^= 0x01
        elif damage == "torn":
            del raw[len(raw) // 2 :]
        else:
            raw[5] ^= 0xFF  # the stored digest
        db[key] = bytes(raw)
    finally:
        db.close()


def _raw_keys(path: Path) -> int:
    """Keys in the database, records and index entries alike."""
    db = Rdict(str(path), Options(raw_mode=True))
    try:
        return sum(1 for _ in db.keys())  # noqa: SIM118 - an Rdict is not iterable
    finally:
        db.close()


@pytest.mark.parametrize("damage", ["flip", "torn", "digest", "missing"])
def test_corrupt_values_are_detected_dropped_and_counted(tmp_path: Path, rec: Recorder, damage: str) -> None:
    path = tmp_path / "ssd"
    store = TieredStore(0, path, 100 * RECORD)
    store.put(d(1), data(1))
    store.put(d(2), data(2))
    store.close()
    _flip_stored_value(path, d(1), damage)
    store = TieredStore(BLOCK * 10, path, 100 * RECORD, listener=rec)
    try:
        assert store.get(d(1)) is None
        stats = store.stats()
        assert (stats["ssd_corrupt"], stats["ssd_misses"], stats["ssd_hits"]) == (1, 1, 0)
        assert rec.take() == [("removed", TIER_SSD, [d(1)])]
        assert store.tier_of(d(1)) is None
        assert store.get(d(2)) == data(2)  # the undamaged record is still served
    finally:
        store.close()
    assert _raw_keys(path) == 2  # d(2)'s record and index entry: the corrupt record is gone


def test_stray_keys_are_dropped_on_open(tmp_path: Path) -> None:
    path = tmp_path / "ssd"
    TieredStore(0, path, 10 * RECORD).close()
    db = Rdict(str(path), Options(raw_mode=True))
    db[b"i-not-an-index-key"] = b""
    db.close()
    store = TieredStore(0, path, 10 * RECORD)
    store.close()
    assert _raw_keys(path) == 0


# -- chains other than RAM -> SSD ---------------------------------------------------------------------


class DamagedRam(RamTier):
    """A RAM tier whose reads of ``damaged`` digests fail verification, as a torn SSD record would."""

    __slots__ = ("damaged",)

    def __init__(self, capacity_bytes: int, *, name: str) -> None:
        super().__init__(capacity_bytes, name=name)
        self.damaged: set[bytes] = set()

    def get(self, digest: bytes) -> bytes | None:
        if digest in self.damaged and self.delete(digest):
            raise CorruptBlock("damaged on purpose")
        return super().get(digest)


@pytest.fixture
def three(tmp_path: Path, rec: Recorder) -> Iterator[TieredStore]:
    """``ram1`` (2 blocks) in front of ``ram2`` (3 blocks) in front of the SSD (5 records)."""
    chain = [
        RamTier(2 * BLOCK, name="ram1"),
        RamTier(3 * BLOCK, name="ram2"),
        SsdTier(tmp_path / "ssd", 5 * RECORD),
    ]
    s = TieredStore.of(chain, listener=rec)
    yield s
    s.close()


def test_three_tiers_demote_one_step_at_a_time(three: TieredStore, rec: Recorder) -> None:
    for i in range(6):
        three.put(d(i), data(i))
    assert rec.take() == [
        ("stored", "ram1", [d(0)]),  # d(0), d(1) fill ram1
        ("stored", "ram1", [d(1)]),
        ("stored", "ram2", [d(0)]),  # d(2), d(3), d(4) each push ram1's oldest down into ram2
        ("removed", "ram1", [d(0)]),
        ("stored", "ram1", [d(2)]),
        ("stored", "ram2", [d(1)]),
        ("removed", "ram1", [d(1)]),
        ("stored", "ram1", [d(3)]),
        ("stored", "ram2", [d(2)]),
        ("removed", "ram1", [d(2)]),
        ("stored", "ram1", [d(4)]),
        ("stored", "ssd", [d(0)]),  # d(5): d(3) into a full ram2, which pushes d(0) into the SSD first
        ("removed", "ram2", [d(0)]),
        ("stored", "ram2", [d(3)]),
        ("removed", "ram1", [d(3)]),
        ("stored", "ram1", [d(5)]),
    ]
    assert three.held() == {"ram1": [d(4), d(5)], "ram2": [d(1), d(2), d(3)], "ssd": [d(0)]}
    assert three.longest_prefix([d(0), d(1), d(4), d(7)]) == (3, ["ssd", "ram2", "ram1"])
    stats = three.stats()
    assert (stats["ram1_evictions"], stats["ram2_evictions"], stats["ssd_evictions"]) == (4, 1, 0)
    assert (stats["ram1_demotions"], stats["ram2_demotions"], stats["ssd_demotions"]) == (4, 4 + 1, 1)
    assert (stats["ram2_blocks"], stats["ram2_bytes"], stats["ram2_capacity_bytes"]) == (
        3,
        3 * BLOCK,
        3 * BLOCK,
    )


def test_three_tiers_promote_into_the_fastest_and_keep_the_copy(three: TieredStore, rec: Recorder) -> None:
    for i in range(6):
        three.put(d(i), data(i))  # ram1 [d4, d5], ram2 [d1, d2, d3], ssd [d0]
    rec.take()
    assert three.get(d(0)) == data(0)  # SSD hit, promoted past ram2 into ram1; the cascade goes down again
    assert rec.take() == [
        ("stored", "ssd", [d(1)]),
        ("removed", "ram2", [d(1)]),
        ("stored", "ram2", [d(4)]),
        ("removed", "ram1", [d(4)]),
        ("stored", "ram1", [d(0)]),
    ]
    assert three.held() == {"ram1": [d(5), d(0)], "ram2": [d(2), d(3), d(4)], "ssd": [d(0), d(1)]}
    assert three.get(d(2)) == data(2)  # ram2 hit, promoted into ram1; d(5) goes down, pushing out d(3)
    assert rec.take() == [
        ("stored", "ssd", [d(3)]),
        ("removed", "ram2", [d(3)]),
        ("stored", "ram2", [d(5)]),
        ("removed", "ram1", [d(5)]),
        ("stored", "ram1", [d(2)]),
    ]
    assert three.held() == {"ram1": [d(0), d(2)], "ram2": [d(4), d(2), d(5)], "ssd": [d(0), d(1), d(3)]}
    stats = three.stats()
    assert (stats["ram1_misses"], stats["ram2_misses"], stats["ram2_hits"], stats["ssd_hits"]) == (2, 1, 1, 1)
    assert (stats["ram1_promotions"], stats["ram2_promotions"], stats["ssd_promotions"]) == (2, 1, 1)
    assert three.get(d(0)) == data(0)  # a ram1 hit: nothing moves
    assert rec.take() == []
    assert three.delete(d(0)) is True
    assert rec.take() == [("removed", "ram1", [d(0)]), ("removed", "ssd", [d(0)])]


def test_put_goes_to_the_fastest_tier_that_fits_and_demotion_skips_a_tier_too_small(
    tmp_path: Path, rec: Recorder
) -> None:
    chain = [
        RamTier(4 * BLOCK, name="ram1"),
        RamTier(BLOCK, name="ram2"),
        SsdTier(tmp_path / "ssd", 10 * RECORD),
    ]
    store = TieredStore.of(chain, listener=rec)
    try:
        store.put(d(1), data(1, 2 * BLOCK))  # fits ram1 only: when evicted, it skips ram2 for the SSD
        store.put(d(2), data(2, 3 * BLOCK))
        assert rec.take() == [
            ("stored", "ram1", [d(1)]),
            ("stored", "ssd", [d(1)]),
            ("removed", "ram1", [d(1)]),
            ("stored", "ram1", [d(2)]),
        ]
        stats = store.stats()
        assert (stats["ram1_demotions"], stats["ram2_demotions"], stats["ssd_demotions"]) == (1, 0, 1)
        big = data(7, 4 * BLOCK + 1)
        store.put(d(7), big)  # larger than both RAM tiers: straight to the SSD
        assert rec.take() == [("stored", "ssd", [d(7)])]
        assert store.get(d(7)) == big and store.tier_of(d(7)) == "ssd"  # not promoted: fits no RAM tier
    finally:
        store.close()


def test_ssd_in_the_middle_demotes_verified_payloads(tmp_path: Path, rec: Recorder) -> None:
    small = SsdTier(tmp_path / "fast", 2 * RECORD)
    chain = [RamTier(BLOCK), small, SsdTier(tmp_path / "slow", 5 * RECORD, name="ssd2")]
    store = TieredStore.of(chain, listener=rec)
    try:
        for i in range(4):
            store.put(d(i), data(i))  # ram [d3], ssd [d1, d2], ssd2 [d0] (read back from RocksDB)
        assert store.held() == {TIER_RAM: [d(3)], TIER_SSD: [d(1), d(2)], "ssd2": [d(0)]}
        assert store.stats()["ssd_demotions"] == 3 + 1
        rec.take()
        assert store.get(d(0)) == data(0)  # a hit two tiers down, promoted into RAM
        assert store.tier_of(d(0)) == TIER_RAM
        assert store.stats()["ssd2_hits"] == store.stats()["ssd2_promotions"] == 1
    finally:
        store.close()


def test_a_corrupt_copy_is_passed_over_for_a_slower_one(tmp_path: Path, rec: Recorder) -> None:
    hot = DamagedRam(BLOCK, name="ram1")
    store = TieredStore.of([hot, RamTier(3 * BLOCK, name="ram2")], listener=rec)
    store.put(d(1), data(1))
    store.put(d(2), data(2))  # d(1) demoted into ram2
    assert store.get(d(1)) == data(1)  # promoted back: held in both
    assert store.held() == {"ram1": [d(1)], "ram2": [d(1), d(2)]}
    rec.take()
    hot.damaged.add(d(1))
    assert store.get(d(1)) == data(1)  # ram1's copy fails, ram2's is served and promoted again
    assert rec.take() == [
        ("removed", "ram1", [d(1)]),
        ("stored", "ram1", [d(1)]),
    ]
    stats = store.stats()
    assert (stats["ram1_corrupt"], stats["ram1_misses"], stats["ram2_hits"]) == (1, 2, 2)


def test_chains_are_checked(tmp_path: Path) -> None:
    with pytest.raises(KvcachedConfigError, match="at least one tier"):
        TieredStore.of([])
    with pytest.raises(KvcachedConfigError, match="unique"):
        TieredStore.of([RamTier(BLOCK), RamTier(2 * BLOCK)])
    with pytest.raises(KvcachedConfigError, match="max_block_bytes"):
        TieredStore.of([RamTier(BLOCK)], max_block_bytes=0)
    ram_only = TieredStore.of([RamTier(BLOCK)])
    assert ram_only.held() == {TIER_RAM: []}  # no SSD named: none listed (the daemon's constructor lists it)
    assert "ssd_bytes" not in ram_only.stats()
    assert TieredStore(BLOCK, None, 0).stats()["ssd_bytes"] == 0


# -- a disk that refuses writes -------------------------------------------------------------------------


class FailingDb:
    """Stands in for an SSD tier's RocksDB handle: writes (and flushes) raise as RocksDB does on a full or
    read-only disk, with nothing written; everything else goes to the real database."""

    def __init__(self, db: Rdict) -> None:
        self.db = db
        self.fail_writes = self.fail_flush = False
        self.closed = False

    def write(self, batch: object, opts: object) -> None:
        if self.fail_writes:
            raise Exception("IO error: No space left on device")  # rocksdict raises a bare Exception
        self.db.write(batch, opts)  # type: ignore[arg-type]

    def flush(self) -> None:
        if self.fail_flush:
            raise Exception("IO error: Read-only file system")
        self.db.flush()

    def close(self) -> None:
        self.closed = True
        self.db.close()

    def __getattr__(self, name: str) -> object:
        return getattr(self.db, name)


def _failing(ssd: SsdTier) -> FailingDb:
    fake = FailingDb(ssd._live())
    ssd._db = fake  # type: ignore[assignment]
    return fake


def test_a_failed_demotion_leaves_both_tiers_as_they_were(tmp_path: Path, rec: Recorder) -> None:
    """RAM is full, the SSD refuses the demotion: the put fails with KvcachedError, RAM keeps its oldest
    block, the new one is not stored (nothing unannounced), nothing is announced."""
    ssd = SsdTier(tmp_path / "ssd", 5 * RECORD)
    store = TieredStore.of([RamTier(3 * BLOCK), ssd], listener=rec)
    try:
        for i in range(3):
            store.put(d(i), data(i))
        rec.take()
        disk = _failing(ssd)
        disk.fail_writes = True
        with pytest.raises(KvcachedError, match="No space left"):
            store.put(d(3), data(3))
        assert store.held() == {TIER_RAM: [d(0), d(1), d(2)], TIER_SSD: []}
        assert rec.take() == []
        stats = store.stats()
        assert (stats["ram_bytes"], stats["ram_evictions"], stats["ssd_bytes"], stats["ssd_blocks"]) == (
            3 * BLOCK,
            0,
            0,
            0,
        )
        disk.fail_writes = False  # the disk has room again: the same put goes through
        store.put(d(3), data(3))
        assert store.held() == {TIER_RAM: [d(1), d(2), d(3)], TIER_SSD: [d(0)]}
    finally:
        store.close()


def test_a_failed_ssd_write_keeps_its_victims(tmp_path: Path, rec: Recorder) -> None:
    """The SSD is full and its write fails: the records it would have evicted stay indexed, counted and
    readable (they are still on disk), and nothing is announced."""
    ssd = SsdTier(tmp_path / "ssd", 5 * RECORD)
    store = TieredStore.of([RamTier(3 * BLOCK), ssd], listener=rec)
    try:
        for i in range(8):
            store.put(d(i), data(i))
        rec.take()
        before = store.held(), store.stats()
        _failing(ssd).fail_writes = True
        with pytest.raises(KvcachedError):
            store.put(d(8), data(8))
        assert (store.held(), store.stats()) == before
        assert rec.take() == []
    finally:
        store.close()
    again = SsdTier(tmp_path / "ssd", 5 * RECORD)
    try:
        assert list(again) == [d(i) for i in range(5)]
        assert again.bytes == 5 * RECORD
    finally:
        again.close()


def test_a_failed_write_through_stores_nothing(tmp_path: Path, rec: Recorder) -> None:
    store = TieredStore(3 * BLOCK, tmp_path / "ssd", 100 * RECORD, listener=rec, write_through=True)
    try:
        ssd = store._tiers[1]
        assert isinstance(ssd, SsdTier)
        _failing(ssd).fail_writes = True
        with pytest.raises(KvcachedError):
            store.put(d(1), data(1))
        assert store.tier_of(d(1)) is None
        assert rec.take() == []
    finally:
        store.close()


def test_close_closes_the_database_when_the_flush_fails(tmp_path: Path) -> None:
    ssd = SsdTier(tmp_path / "ssd", 5 * RECORD)
    ssd.put(d(1), data(1))
    disk = _failing(ssd)
    disk.fail_flush = True
    ssd.close()  # logged, not raised
    assert disk.closed
    ssd.close()  # idempotent
    again = SsdTier(tmp_path / "ssd", 5 * RECORD)  # the lock was released; the WAL kept the write
    try:
        assert again.get(d(1)) == data(1)
    finally:
        again.close()


def test_a_hit_whose_promotion_fails_is_still_served(tmp_path: Path, rec: Recorder) -> None:
    """An SSD hit is promoted into a full RAM, whose oldest block must go down to the SSD: when the disk
    refuses that write the verified block is served all the same, unpromoted, and nothing moved."""
    ssd = SsdTier(tmp_path / "ssd", 5 * RECORD)
    store = TieredStore.of([RamTier(3 * BLOCK), ssd], listener=rec)
    try:
        for i in range(4):
            store.put(d(i), data(i))  # ram [d1, d2, d3], ssd [d0]
        rec.take()
        _failing(ssd).fail_writes = True
        assert store.get(d(0)) == data(0)
        assert store.held() == {TIER_RAM: [d(1), d(2), d(3)], TIER_SSD: [d(0)]}
        assert rec.take() == []
        stats = store.stats()
        assert (stats["ssd_hits"], stats["ssd_promotions"], stats["ram_evictions"]) == (1, 0, 1)
    finally:
        store.close()


class FailingAfter(FailingDb):
    """A disk that takes ``ok_writes`` more writes, then refuses every one."""

    def __init__(self, db: Rdict, ok_writes: int) -> None:
        super().__init__(db)
        self.ok_writes = ok_writes

    def write(self, batch: object, opts: object) -> None:
        if self.ok_writes <= 0:
            self.fail_writes = True
        self.ok_writes -= 1
        super().write(batch, opts)


def test_a_write_through_put_whose_ram_eviction_fails_is_kept_on_the_ssd(
    tmp_path: Path, rec: Recorder
) -> None:
    """With write_through the SSD copy is written first; when RAM must then evict a block the SSD no
    longer holds and the disk refuses that demotion, the put is not reported failed while its block sits
    on the SSD (announced there): it is acknowledged with the block in the SSD tier only, RAM as it was."""
    store = TieredStore(3 * BLOCK, tmp_path / "ssd", 3 * RECORD, listener=rec, write_through=True)
    try:
        for i in range(3):
            store.put(d(i), data(i))  # both tiers: [d0, d1, d2]
        rec.take()
        ssd = store._tiers[1]
        assert isinstance(ssd, SsdTier)
        ssd._db = FailingAfter(ssd._live(), ok_writes=1)  # type: ignore[assignment]
        store.put(d(3), data(3))  # the SSD copy evicts d0 there; RAM's demotion of d0 is refused
        assert store.held() == {TIER_RAM: [d(0), d(1), d(2)], TIER_SSD: [d(1), d(2), d(3)]}
        assert store.tier_of(d(3)) == TIER_SSD and store.get(d(3)) == data(3)
        assert rec.take()[:2] == [("removed", TIER_SSD, [d(0)]), ("stored", TIER_SSD, [d(3)])]
    finally:
        store.close()
