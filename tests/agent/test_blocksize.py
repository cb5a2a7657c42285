"""agent.blocksize: the gateways' index block size as the agent follows it (a table of etcd states)."""

from __future__ import annotations

import logging

import pytest

from agent.blocksize import DEFAULT_INDEX_BLOCK_SIZE, IndexBlockSize
from contracts.etcd import Change, encode_value, policy_key

KEY = policy_key("/kvgate/", "index/block_size")


@pytest.mark.parametrize(
    ("kvs", "expected"),
    [
        ([], DEFAULT_INDEX_BLOCK_SIZE),
        ([(KEY, encode_value(32))], 32),
        ([(KEY + "_other", encode_value(64))], DEFAULT_INDEX_BLOCK_SIZE),  # a key beside it, not it
        ([(KEY, b"not json")], DEFAULT_INDEX_BLOCK_SIZE),
        ([(KEY, encode_value(0))], DEFAULT_INDEX_BLOCK_SIZE),
        ([(KEY, encode_value(16.0))], DEFAULT_INDEX_BLOCK_SIZE),
        ([(KEY, encode_value(True))], DEFAULT_INDEX_BLOCK_SIZE),
    ],
)
def test_snapshot(kvs: list[tuple[str, bytes]], expected: int) -> None:
    assert IndexBlockSize(KEY).snapshot(kvs, 1) == expected


def test_changes_follow_the_key_and_a_bad_value_keeps_the_last_good(caplog: pytest.LogCaptureFixture) -> None:
    core = IndexBlockSize(KEY)
    assert core.snapshot([(KEY, encode_value(32))], 1) == 32
    assert core.apply([Change(KEY, encode_value(64))], 2) == 64
    with caplog.at_level(logging.WARNING, logger="agent.blocksize"):
        assert core.apply([Change(KEY, encode_value(-1))], 3) == 64
    assert core.rejected == 1 and "keeping block size 64" in caplog.text
    assert core.apply([Change("/kvgate/policy/weights/prefix", encode_value(2.0))], 4) == 64
    assert core.apply([Change(KEY, None)], 5) == DEFAULT_INDEX_BLOCK_SIZE  # deleted: the default
