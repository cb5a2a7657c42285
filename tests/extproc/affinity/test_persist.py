"""The response affinity table across restarts (extproc/affinity/persist.py and ResponseAffinity.restore):
round trip, expiry in wall time, bad files ignored, file modes, the bound, moved endpoints."""

from __future__ import annotations

import logging
import os
import random
import stat
from collections import OrderedDict
from pathlib import Path
from typing import Any

import orjson
import pytest

from contracts.errors import ConfigError
from extproc.affinity import persist
from extproc.affinity.core import AffinityConfig, ResponseAffinity, parse_affinity, to_records
from extproc.affinity.persist import FORMAT, VERSION, AffinityState, encode, state_path

FLEET = {"e0": "10.0.0.1:8000", "e1": "10.0.0.2:8000"}


class Clocks:
    """A process's two clocks: monotonic (restarts at an arbitrary value) and wall."""

    def __init__(self, mono: float, wall: float) -> None:
        self.mono, self.wall = mono, wall

    def tick(self, s: float) -> None:
        self.mono += s
        self.wall += s


def state(
    affinity: ResponseAffinity, path: Path, clocks: Clocks, fleet: dict[str, str] | None = None
) -> AffinityState:
    got = FLEET if fleet is None else fleet
    return AffinityState(affinity, path, 30.0, lambda: got, lambda: clocks.mono, lambda: clocks.wall)


async def started(affinity: ResponseAffinity, path: Path, clocks: Clocks) -> AffinityState:
    """A process's state once started: its file (none yet) read first, as the gateway does."""
    kept = state(affinity, path, clocks)
    assert await kept.load() == 0
    return kept


async def test_a_restarted_table_answers_as_before_in_the_same_use_order(tmp_path: Path) -> None:
    path = state_path(tmp_path / "state", "extproc-0")
    before, clocks = ResponseAffinity(), Clocks(100.0, 1_000_000.0)
    kept = await started(before, path, clocks)
    assert not await kept.save()  # nothing learned: nothing written
    before.learn("open", "resp_a", "e0", clocks.mono)
    before.learn("tenant:acme", "resp_b", "e1", clocks.mono)
    before.learn("open", "resp_c", "e1", clocks.mono)
    assert before.lookup("open", "resp_a", clocks.mono) == "e0"  # used last now
    assert await kept.save()

    after, later = ResponseAffinity(), Clocks(7.0, clocks.wall + 60)  # a new process: monotonic restarts
    assert await state(after, path, later).load() == 3
    assert list(after.entries) == [("tenant:acme", "resp_b"), ("open", "resp_c"), ("open", "resp_a")]
    assert after.lookup("open", "resp_a", later.mono) == "e0"
    assert after.lookup("tenant:acme", "resp_b", later.mono) == "e1"
    assert after.lookup("open", "resp_b", later.mono) is None  # scopes survive too
    assert after.restored == 3 and after.learned == 0


async def test_the_ttl_counts_in_wall_time_across_the_restart(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    before, clocks = ResponseAffinity(AffinityConfig(ttl_s=100.0)), Clocks(5000.0, 1_000_000.0)
    kept = await started(before, path, clocks)
    before.learn("open", "resp_old", "e0", clocks.mono)
    clocks.tick(60)
    before.learn("open", "resp_new", "e1", clocks.mono)
    assert await kept.save()

    after, down = ResponseAffinity(AffinityConfig(ttl_s=100.0)), Clocks(3.0, clocks.wall + 50)  # 50 s down
    assert await state(after, path, down).load() == 1  # resp_old: 110 s since its last use
    assert after.lookup("open", "resp_old", down.mono) is None
    down.tick(49)
    assert after.lookup("open", "resp_new", down.mono) == "e1"  # 99 s old: kept, and renewed by the use
    # A lower ttl_s after the restart caps what is left.
    short = ResponseAffinity(AffinityConfig(ttl_s=10.0))
    assert await state(short, path, Clocks(0.0, clocks.wall)).load() == 2
    assert all(expires <= 10.0 for _, expires in short.entries.values())


async def test_only_the_most_recent_max_entries_are_loaded(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    before, clocks = ResponseAffinity(), Clocks(0.0, 1_000_000.0)
    kept = await started(before, path, clocks)
    for i in range(10):
        before.learn("open", f"resp_{i}", "e0", clocks.mono)
    assert await kept.save()
    after = ResponseAffinity(AffinityConfig(max_entries=4))
    assert await state(after, path, clocks).load() == 4
    assert [r for _, r in after.entries] == ["resp_6", "resp_7", "resp_8", "resp_9"]


async def test_an_endpoint_now_at_another_address_loses_its_entries(tmp_path: Path) -> None:
    """A replaced engine (same id, new address) lost its response store; an endpoint the fleet does not
    know yet (etcd names it later) keeps its entries."""
    path = tmp_path / "a.json"
    before, clocks = ResponseAffinity(), Clocks(0.0, 1_000_000.0)
    kept = await started(before, path, clocks)
    before.learn("open", "resp_0", "e0", clocks.mono)
    before.learn("open", "resp_1", "e1", clocks.mono)
    assert await kept.save()
    after = ResponseAffinity()
    assert await state(after, path, clocks, {"e0": "10.0.0.9:8000"}).load() == 1
    assert list(after.entries) == [("open", "resp_1")]


def good_snapshot() -> bytes:
    return encode([("open", "resp_secret", "e0", "", 2e9)], 1e9)


@pytest.mark.parametrize(
    "data",
    [
        good_snapshot()[:-7],  # truncated
        b"\x00\xff garbage",
        b"",
        orjson.dumps({"format": "kvgate.response_affinity", "version": 2, "entries": []}),
        orjson.dumps({"format": "something else", "version": 1, "entries": []}),
        orjson.dumps({"format": "kvgate.response_affinity", "version": 1, "entries": [["resp_secret", 1]]}),
        orjson.dumps({"format": "kvgate.response_affinity", "version": 1, "entries": {}}),
        orjson.dumps(["resp_secret"]),
    ],
    ids=["truncated", "garbage", "empty", "version", "format", "entry", "entries", "shape"],
)
async def test_a_bad_file_is_logged_without_ids_and_ignored(
    tmp_path: Path, data: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "a.json"
    path.write_bytes(data)
    affinity, clocks = ResponseAffinity(), Clocks(0.0, 1e9)
    kept = state(affinity, path, clocks)
    with caplog.at_level(logging.INFO, logger="extproc.affinity.persist"):
        assert await kept.load() == 0
    assert not affinity.entries and kept.errors["load"] == 1
    assert "ignoring" in caplog.text and "resp_" not in caplog.text
    affinity.learn("open", "resp_new", "e0", 0.0)
    assert await kept.save()  # and the next snapshot replaces it
    assert await state(ResponseAffinity(), path, clocks).load() == 1


async def test_an_unreadable_or_oversized_file_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "dir.json").mkdir()  # reading it fails (as a file without read permission would)
    unreadable = state(ResponseAffinity(), tmp_path / "dir.json", Clocks(0.0, 1e9))
    assert await unreadable.load() == 0 and unreadable.errors["load"] == 1
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (2048 + 64 * 1024 + 1))  # over the bound for max_entries = 1
    oversized = state(ResponseAffinity(AffinityConfig(max_entries=1)), big, Clocks(0.0, 1e9))
    assert await oversized.load() == 0 and oversized.errors["load"] == 1
    missing = state(ResponseAffinity(), tmp_path / "none.json", Clocks(0.0, 1e9))
    assert await missing.load() == 0 and missing.errors["load"] == 0  # the first start: nothing to say


async def test_the_file_is_private_and_written_whole(tmp_path: Path) -> None:
    directory = tmp_path / "state"
    path = state_path(directory, "extproc-0")
    affinity, clocks = ResponseAffinity(), Clocks(0.0, 1e9)
    kept = await started(affinity, path, clocks)
    affinity.learn("open", "resp_a", "e0", 0.0)
    old = os.umask(0)  # even under a permissive umask
    try:
        assert await kept.save()
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert os.listdir(directory) == [path.name]  # no temp file left behind
    doc = orjson.loads(path.read_bytes())
    assert doc["format"] == "kvgate.response_affinity" and doc["version"] == 1
    assert doc["entries"] == [["open", "resp_a", "e0", "10.0.0.1:8000", 1e9 + 3600.0]]
    assert not await kept.save() and kept.saves == 1  # unchanged: not written again
    affinity.lookup("open", "resp_a", 1.0)  # a use renews the TTL: written again
    assert await kept.save() and kept.saves == 2


async def test_a_failed_write_is_counted_not_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    affinity = ResponseAffinity()
    kept = state(affinity, blocker / "a.json", Clocks(0.0, 1e9))
    assert not await kept.save() and kept.saves == 0  # never loaded: never writes over a file it did not read
    assert await kept.load() == 0 and kept.errors["load"] == 1  # its directory is a file
    affinity.learn("open", "resp_a", "e0", 0.0)
    assert not await kept.save() and kept.errors["save"] == 1
    await kept.aclose()  # tries once more at shutdown, quietly
    assert kept.errors["save"] == 2


def test_worker_names_become_safe_file_names(tmp_path: Path) -> None:
    assert state_path(tmp_path, "extproc-1") == tmp_path / "affinity-extproc-1.json"
    assert state_path(tmp_path, "../x/y") == tmp_path / "affinity-_x_y.json"


def test_the_config_names_a_directory_and_an_interval() -> None:
    assert parse_affinity(None).state_dir is None
    got = parse_affinity({"state_dir": "/var/lib/kvgate/affinity", "snapshot_interval_s": 5})
    assert got.state_dir == "/var/lib/kvgate/affinity" and got.snapshot_interval_s == 5.0
    assert parse_affinity({"state_dir": ""}).state_dir is None  # "": not kept
    for bad, where in [
        ({"snapshot_interval_s": 0}, "snapshot_interval_s"),
        ({"snapshot_interval_s": "often"}, "snapshot_interval_s"),
        ({"state_dir": 7}, "state_dir"),
        ({"state_dir": "a\0b"}, "state_dir"),
    ]:
        with pytest.raises(ConfigError, match=where):
            parse_affinity(bad)


class _Unwalkable(OrderedDict[tuple[str, str], tuple[str, float]]):
    """A table that fails any walk over all of it (a copy of it) once ``armed``."""

    armed = False

    def items(self) -> Any:
        assert not self.armed, "the whole table was walked"
        return super().items()

    def __iter__(self) -> Any:
        assert not self.armed, "the whole table was walked"
        return super().__iter__()


def _file_records(path: Path) -> list[list[object]]:
    return list(orjson.loads(path.read_bytes())["entries"])


def _expected(affinity: ResponseAffinity, clocks: Clocks) -> list[list[object]]:
    items = list(OrderedDict.items(affinity.entries))
    return [list(r) for r in to_records(items, clocks.mono, clocks.wall, FLEET)]


async def test_a_snapshot_copies_no_table_on_the_event_loop(tmp_path: Path) -> None:
    """The loop's part of a snapshot hands over the changes since the last one; the whole table (a walk of
    50,000 entries took 16 ms to far more on the loop, every round) is replayed on the writing thread."""
    path = tmp_path / "a.json"
    affinity, clocks = ResponseAffinity(entries=_Unwalkable()), Clocks(0.0, 1e9)
    kept = await started(affinity, path, clocks)
    for i in range(100):
        affinity.learn("open", f"resp_{i}", "e0", clocks.mono)
        clocks.tick(1)
    assert isinstance(affinity.entries, _Unwalkable)
    affinity.entries.armed = True
    encode_on_thread = kept._capture()  # what Snapshots.save runs on the loop
    affinity.entries.armed = False
    encode_on_thread()
    assert await kept.save()
    assert _file_records(path) == _expected(affinity, clocks)


async def test_snapshots_from_replayed_changes_match_the_table(tmp_path: Path) -> None:
    """Learns, uses, expiries and LRU evictions between snapshots, a journal that outgrew its bound, and a
    capture whose thread ran after a newer one's: each file holds the table as it was, in use order."""
    path = tmp_path / "a.json"
    affinity = ResponseAffinity(AffinityConfig(max_entries=40, ttl_s=50.0))
    clocks = Clocks(0.0, 1e9)
    kept = await started(affinity, path, clocks)
    rng = random.Random(7)
    overflowed = 0
    for round_ in range(30):
        for _ in range(rng.choice([0, 5, 30, 120, 300])):  # 300: more than 2 x max_entries changes
            clocks.tick(rng.choice([0.0, 0.5, 3.0]))
            scope = rng.choice(["open", "tenant:a"])
            rid = f"resp_{rng.randrange(90)}"
            if rng.random() < 0.5:
                affinity.learn(scope, rid, rng.choice(["e0", "e1"]), clocks.mono)
            else:
                affinity.lookup(scope, rid, clocks.mono)
        overflowed += affinity.journal is None
        if round_ % 7 == 3:  # an older capture's thread runs after a newer one's
            first = kept._capture()
            affinity.learn("open", f"late_{round_}", "e1", clocks.mono)
            second = kept._capture()
            assert orjson.loads(second())["entries"] == _expected(affinity, clocks)
            assert orjson.loads(first())["entries"] == _expected(affinity, clocks)
        if await kept.save():
            assert _file_records(path) == _expected(affinity, clocks)
    assert kept.saves >= 20 and overflowed


@pytest.mark.parametrize("n", [0, 1, persist.CHUNK, persist.CHUNK + 1, 3 * persist.CHUNK + 7])
def test_the_snapshot_is_serialized_in_chunks_as_one_document(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot's bytes are those of one ``orjson.dumps`` of the document, but no serialization call
    covers more than ``CHUNK`` records: orjson holds the GIL for a whole call, so the event loop waited
    for the whole table's (a save of 50,000 entries stalled it 44-72 ms, 8-17 ms in chunks)."""
    records = [("tenant:a", f"resp_{i}", "e0", "10.0.0.1:8000", 1e9 + i) for i in range(n)]
    whole = orjson.dumps({"format": FORMAT, "version": VERSION, "written_at": 5.0, "entries": records})
    calls: list[int] = []
    dumps = orjson.dumps

    def counting(value: Any) -> bytes:
        calls.append(len(value["entries"]) if isinstance(value, dict) else len(value))
        return dumps(value)

    monkeypatch.setattr(persist.orjson, "dumps", counting)
    assert encode(records, 5.0) == whole
    assert max(calls) <= persist.CHUNK and sum(calls) == n
