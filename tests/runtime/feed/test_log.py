"""runtime.feed.log: numbering, the replay ring and snapshots (sans IO)."""

from __future__ import annotations

import pytest

from contracts.events import Batch, Cleared, Load, Stored, encode
from contracts.versions import DIGEST_VERSION, FEED_VERSION
from runtime.feed.log import FeedLog

D1, D2 = (bytes([i]) * 16 for i in (1, 2))


def stored(endpoint: str, *digests: bytes) -> Stored:
    return Stored(endpoint, list(digests))


def test_log_starts_with_an_empty_batch() -> None:
    log = FeedLog("node-a", epoch=7)
    assert (log.seq, log.held_batches, log.oldest_seq) == (1, 1, 1)
    assert log.replay_after(7, 0) == [Batch("node-a", 7, 1, [], version=FEED_VERSION, digest=DIGEST_VERSION)]
    assert 0 <= FeedLog("node-b").epoch < 2**63


def test_publish_numbers_batches() -> None:
    log = FeedLog("node-a", epoch=7)
    b = log.publish([stored("e1", D1)], ts=12.5)
    assert (b.source, b.epoch, b.seq, b.ts, b.snapshot) == ("node-a", 7, 2, 12.5, False)
    assert log.publish([], ts=13.0).seq == 3


# 10 batches in all (seq 1..10) with a ring of 4: seqs 7..10 held.
@pytest.mark.parametrize(
    ("epoch", "after", "expected"),
    [
        (7, 10, []),  # up to date
        (7, 9, [10]),
        (7, 6, [7, 8, 9, 10]),  # exactly what the ring covers
        (7, 5, None),  # batch 6 dropped: snapshot
        (7, 0, None),
        (7, 11, None),  # a position this log never reached
        (7, -1, None),
        (8, 9, None),  # another epoch (the agent restarted)
        (None, 0, None),  # a new subscriber
    ],
)
def test_replay_coverage(epoch: int | None, after: int, expected: list[int] | None) -> None:
    log = FeedLog("node-a", epoch=7, max_batches=4)
    for _ in range(9):
        log.publish([stored("e1", D1)], ts=1.0)
    replay = log.replay_after(epoch, after)
    assert (None if replay is None else [b.seq for b in replay]) == expected


def test_ring_bounded_by_bytes() -> None:
    one = len(encode(Batch("node-a", 7, 2, [stored("e1", D1, D2)], ts=1.0)))
    log = FeedLog("node-a", epoch=7, max_bytes=3 * one)
    for _ in range(10):
        log.publish([stored("e1", D1, D2)], ts=1.0)
    assert log.held_bytes <= 3 * one
    assert log.held_batches == 3
    assert log.oldest_seq == 9
    assert log.replay_after(7, 8) is not None and log.replay_after(7, 7) is None


def test_batch_larger_than_the_ring_is_not_kept() -> None:
    log = FeedLog("node-a", epoch=7, max_bytes=64)
    log.publish([stored("e1", *[bytes([i]) * 16 for i in range(10)])], ts=1.0)
    assert log.held_batches == 0 and log.held_bytes == 0
    assert log.replay_after(7, 2) == []  # up to date needs nothing
    assert log.replay_after(7, 1) is None


def test_ring_bounds_are_validated() -> None:
    with pytest.raises(ValueError, match="max_batches"):
        FeedLog("node-a", max_batches=0)


def test_snapshot_at_last_seq_clears_every_endpoint_then_holds_then_loads() -> None:
    log = FeedLog("node-a", epoch=7)
    log.publish([stored("e1", D1), Load("e1", 1, 2, 0.5)], ts=1.0)
    log.publish([Cleared("e0"), Load("e1", 3, 4, 0.25)], ts=2.0)
    snap = log.snapshot([stored("e2", D2)], ts=3.0)
    assert (snap.seq, snap.epoch, snap.snapshot, snap.ts) == (3, 7, True, 3.0)
    assert snap.events == [
        Cleared("e0"),
        Cleared("e1"),
        Cleared("e2"),
        stored("e2", D2),
        Load("e1", 3, 4, 0.25),
    ]
    assert log.held_batches == 3  # the snapshot is not part of the ring
    log.forget("e0")
    log.forget("e1")
    assert log.snapshot([], ts=4.0).events == [Cleared("e2")]
