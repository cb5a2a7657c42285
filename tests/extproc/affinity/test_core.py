"""The response id -> endpoint store: per-scope keys, LRU bound, TTL (extproc/affinity/core.py)."""

from __future__ import annotations

import pytest

from contracts.errors import ConfigError
from extproc.affinity.core import (
    LRU,
    MAX_ID,
    OPEN_SCOPE,
    TTL,
    AffinityConfig,
    ResponseAffinity,
    parse_affinity,
    scope_of,
)


def test_a_tenant_never_sees_another_tenants_ids() -> None:
    a = ResponseAffinity()
    a.learn(scope_of("acme"), "resp_1", "e0", 0.0)
    assert a.lookup(scope_of("acme"), "resp_1", 1.0) == "e0"
    assert a.lookup(scope_of("other"), "resp_1", 1.0) is None  # guessing another tenant's id gets nothing
    assert a.lookup(OPEN_SCOPE, "resp_1", 1.0) is None
    assert scope_of(None) == OPEN_SCOPE != scope_of("open")


def test_least_recently_used_entries_leave_first_at_the_bound() -> None:
    a = ResponseAffinity(AffinityConfig(max_entries=2))
    a.learn("s", "r1", "e0", 0.0)
    a.learn("s", "r2", "e1", 1.0)
    assert a.lookup("s", "r1", 2.0) == "e0"  # r1 used: r2 is now the least recent
    a.learn("s", "r3", "e2", 3.0)
    assert a.lookup("s", "r2", 4.0) is None and a.lookup("s", "r1", 4.0) == "e0"
    assert len(a.entries) == 2 and a.evicted[LRU] == 1 and a.learned == 3


def test_entries_expire_ttl_after_their_last_use() -> None:
    a = ResponseAffinity(AffinityConfig(ttl_s=10.0))
    a.learn("s", "r1", "e0", 0.0)
    assert a.lookup("s", "r1", 9.0) == "e0"  # renewed to 19
    assert a.lookup("s", "r1", 18.0) == "e0"
    assert a.lookup("s", "r1", 28.5) is None and a.evicted[TTL] == 1
    a.learn("s", "r2", "e0", 0.0)
    a.learn("s", "r3", "e1", 20.0)  # r2 expired at 10: swept when learning
    assert list(a.entries) == [("s", "r3")] and a.evicted[TTL] == 2


def test_a_relearned_id_moves_to_its_new_endpoint_and_odd_ids_are_not_kept() -> None:
    a = ResponseAffinity()
    a.learn("s", "r1", "e0", 0.0)
    a.learn("s", "r1", "e1", 1.0)
    assert a.lookup("s", "r1", 2.0) == "e1" and len(a.entries) == 1
    assert not a.learn("s", "", "e0", 0.0) and not a.learn("s", "x" * (MAX_ID + 1), "e0", 0.0)


def test_config() -> None:
    assert parse_affinity(None) == AffinityConfig()
    assert parse_affinity({"max_entries": 5, "ttl_s": 2}) == AffinityConfig(True, 5, 2.0)
    assert not parse_affinity({"enabled": False}).enabled
    for bad in ({"max_entries": 0}, {"ttl_s": 0}, {"unknown": 1}, {"enabled": "yes"}):
        with pytest.raises(ConfigError):
            parse_affinity(bad)
