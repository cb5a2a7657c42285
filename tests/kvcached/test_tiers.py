"""TieredStore: round trips through both tiers, eviction, demotion, promotion, listener events,
bad input, longest-prefix lookups and corruption injection into the RocksDB values."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from rocksdict import Options, Rdict

from kvcached.block import HEADER_BYTES, checksum
from kvcached.errors import BadRequest, KvcachedConfigError, KvcachedError
from kvcached.ssd import KEY_BYTES
from kvcached.tiers import TIER_RAM, TIER_SSD, TieredStore

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


@pytest.fixture
def store(tmp_path: Path, rec: Recorder) -> Iterator[TieredStore]:
    s = TieredStore(3 * BLOCK, tmp_path / "ssd", 5 * RECORD, listener=rec)
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
        ("removed", TIER_RAM, [d(0)]),
        ("stored", TIER_SSD, [d(0)]),
        ("stored", TIER_RAM, [d(3)]),
    ]
    assert store.tier_of(d(0)) == TIER_SSD
    assert store.get(d(0)) == data(0)  # SSD hit, verified, promoted; d(1) is demoted for room
    assert rec.take() == [
        ("removed", TIER_RAM, [d(1)]),
        ("stored", TIER_SSD, [d(1)]),
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
        ("removed", TIER_RAM, [d(5)]),
        ("removed", TIER_SSD, [d(0)]),
        ("stored", TIER_SSD, [d(5)]),
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
