"""extproc.admission.shared: etcd tenants/<id> values over the file's tenants, and the usage ledger that
makes replicas drain one token budget (pure; the etcd side is tests/extproc/control/test_usage.py)."""

from __future__ import annotations

import json

import pytest

from contracts.errors import ConfigError
from extproc.admission.budget import TokenBudgets
from extproc.admission.config import parse_auth
from extproc.admission.gate import AuthConfig, Gate
from extproc.admission.keys import ApiKey, KeyStore, hash_key, new_key
from extproc.admission.shared import SharedAdmission, TenantDirectory, UsageLedger, decode_tenant
from extproc.admission.tenants import Tenant, TenantMatch, Tenants, TokenLimit
from extproc.errors import Forbidden
from extproc.routing.request import Kind, ParsedRequest

FILE_A = Tenant("a", ("*",), TenantMatch(groups=frozenset({"g"})))
FILE_B = Tenant("b", ("m",))
LIMITED = Tenant("t", ("*",), tokens=TokenLimit(per_minute=60, burst=100))


def _json(doc: object) -> bytes:
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("acme", _json({"models": ["m"]}), Tenant("acme", ("m",))),
        ("acme", _json({"id": "acme", "models": ["m"], "priority": 2}), Tenant("acme", ("m",), priority=2)),
        (
            "acme",
            _json({"models": ["*"], "tokens": {"per_minute": 60, "burst": 10}}),
            Tenant("acme", ("*",), tokens=TokenLimit(60, 10)),
        ),
        ("acme", _json({"id": "other", "models": ["m"]}), "does not match the key"),
        ("acme", b"{not json", "not valid JSON"),
        ("acme", _json(["m"]), "expected a JSON object"),
        ("acme", _json({"models": []}), "tenants/acme.models"),
        ("acme", _json({"models": ["m"], "colour": "red"}), "colour"),
        ("ac me", _json({"models": ["m"]}), "not a valid tenant id"),
        # integers past any float: refused with the key named (a ConfigError, not an OverflowError)
        ("acme", b'{"models": ["m"], "rate": {"requests_per_s": 1' + b"0" * 400 + b"}}", "requests_per_s"),
        ("acme", b'{"models": ["m"], "tokens": {"per_minute": 1' + b"0" * 400 + b"}}", "per_minute"),
    ],
)
def test_decode_tenant(name: str, value: bytes, expected: Tenant | str) -> None:
    if isinstance(expected, Tenant):
        assert decode_tenant(name, value) == expected
        return
    with pytest.raises(ConfigError, match=expected):
        decode_tenant(name, value)


def test_directory_overlays_the_file_and_keeps_the_last_good_value() -> None:
    seen: list[Tenants] = []
    directory = TenantDirectory((FILE_A, FILE_B), seen.append)
    assert [t.id for t in directory.tenants] == ["a", "b"] and not seen

    assert directory.put("z", _json({"models": ["m"]}), backlog=True)
    assert directory.put("c", _json({"models": ["m"]}), backlog=False)
    assert directory.put("a", _json({"models": ["only"]}), backlog=False)  # replaces the file's, in place
    assert [t.id for t in seen[-1]] == ["a", "b", "c", "z"]
    assert seen[-1].get("a") == Tenant("a", ("only",))

    assert not directory.put("a", _json({"models": ["only"]}), backlog=False)  # same tenant: no change
    count = len(seen)
    assert not directory.put("c", _json({"models": "m"}), backlog=False)  # refused
    assert not directory.put("a", _json({"id": "b", "models": ["m"]}), backlog=False)  # refused
    assert len(seen) == count and directory.rejected == 2
    assert seen[-1].get("c") == Tenant("c", ("m",))  # the last good value stays

    assert directory.delete("a")  # the file's tenant comes back
    assert seen[-1].get("a") == FILE_A
    assert directory.delete("c") and seen[-1].get("c") is None
    assert not directory.delete("c")
    assert [t.id for t in directory.tenants] == ["a", "b", "z"]


def test_gate_follows_the_directory_and_keys_reach_etcd_tenants() -> None:
    """An API key of a tenant only etcd defines works once the tenant is put, and is 403 once removed."""
    key = new_key()
    keys = KeyStore([ApiKey("k1", "e", hash_key(key), 1)])
    gate = Gate(AuthConfig(api_keys_file="-"), Tenants([FILE_A]), keys)
    shared = SharedAdmission(gate)
    with pytest.raises(Forbidden):
        gate.identify(f"Bearer {key}", None, None)
    limit = {"per_minute": 60, "burst": 100}
    shared.tenants.put("e", _json({"models": ["m"], "tokens": limit}), backlog=False)
    principal = gate.identify(f"Bearer {key}", None, None)
    assert principal.tenant.id == "e"
    request = ParsedRequest(Kind.CHAT, "m", {"model": "m", "max_tokens": 10}, False, messages=[])
    gate.admit(principal, request, 30, now=0.0)
    assert gate.budgets.level(principal.tenant, 0.0) == 60
    # a change that keeps the limit keeps the bucket's level
    shared.tenants.put("e", _json({"models": ["m", "n"], "tokens": limit}), backlog=False)
    assert gate.budgets.level(gate.identify(f"Bearer {key}", None, None).tenant, 0.0) == 60
    shared.tenants.delete("e")
    with pytest.raises(Forbidden):
        gate.identify(f"Bearer {key}", None, None)


def test_budgets_count_their_own_charges_only() -> None:
    budgets = TokenBudgets()
    assert budgets.reserve(LIMITED, 40, 0.0) is None
    budgets.settle(LIMITED, 40, 25, 0.0)  # refund 15
    assert budgets.reserve(LIMITED, 30, 0.0) is None
    budgets.settle(LIMITED, 30, 35, 0.0)  # charge 5 more
    assert budgets.reserve(LIMITED, 500, 0.0) is not None  # refused: not charged
    budgets.charge(LIMITED, 20, 0.0)  # another replica's: not counted
    assert budgets.charged == {"t": 60}
    assert budgets.level(LIMITED, 0.0) == 100 - 60 - 20
    budgets.reserve(Tenant("free", ("*",)), 10, 0.0)  # unlimited: nothing to count
    assert "free" not in budgets.charged


@pytest.mark.parametrize(
    ("events", "charges"),
    [
        # (replica, value, backlog) -> tokens charged here
        ([("r1", 10, False), ("r1", 25, False)], [10, 15]),  # a new replica's first counter: all of it
        ([("r1", 500, True), ("r1", 530, False)], [0, 30]),  # first seen in a full read: a baseline
        ([("r1", 500, True), ("r1", 540, True)], [0, 40]),  # a resync charges what was missed
        ([("r1", 50, False), ("r1", 20, False)], [50, -30]),  # a refund there gives back here
        # gone: no refund; back under a new lease (same process, same counter): only what it spent since
        ([("r1", 50, False), ("r1", None, False), ("r1", 70, False)], [50, 0, 20]),
        ([("r1", 50, False), ("r1", None, False), ("r1", 50, True)], [50, 0, 0]),
        ([("r1", 5, False), ("r2", 7, False), ("r1", 9, False)], [5, 7, 4]),  # per replica
        ([("r1", "x", False), ("r1", 8, False)], [0, 8]),  # a bad value is ignored
    ],
)
def test_ledger_charges_other_replicas_spending(
    events: list[tuple[str, int | str | None, bool]], charges: list[int]
) -> None:
    budgets = TokenBudgets()
    ledger = UsageLedger(budgets, {"t": LIMITED}.get)
    got = []
    for replica, value, backlog in events:
        raw = None if value is None else str(value).encode()
        got.append(ledger.observe("t", replica, raw, backlog=backlog, now=0.0))
    assert got == charges
    assert budgets.level(LIMITED, 0.0) == min(100, 100 - sum(charges))
    assert budgets.charged == {}  # none of it is this replica's own


def test_ledger_ignores_unknown_and_unlimited_tenants() -> None:
    budgets = TokenBudgets()
    ledger = UsageLedger(budgets, {"free": Tenant("free", ("*",))}.get)
    assert ledger.observe("free", "r1", b"50", backlog=False, now=0.0) == 0
    assert ledger.observe("gone", "r1", b"50", backlog=False, now=0.0) == 0


def test_ledger_publishes_each_change_once() -> None:
    budgets = TokenBudgets()
    ledger = UsageLedger(budgets, {"t": LIMITED}.get)
    assert ledger.due() == {}
    budgets.reserve(LIMITED, 30, 0.0)
    assert ledger.due() == {"t": 30}
    assert ledger.due() == {}
    budgets.settle(LIMITED, 30, 30, 0.0)  # settled as reserved: the counter did not move
    assert ledger.due() == {}
    budgets.settle(LIMITED, 30, 10, 0.0)
    assert ledger.due() == {"t": 10}


def test_auth_usage_sync_s() -> None:
    assert parse_auth({"api_keys_file": "k"}) == AuthConfig(api_keys_file="k", usage_sync_s=0.25)
    assert parse_auth({"api_keys_file": "k", "usage_sync_s": 1}) == AuthConfig(
        api_keys_file="k", usage_sync_s=1
    )
    with pytest.raises(ConfigError, match="usage_sync_s"):
        parse_auth({"api_keys_file": "k", "usage_sync_s": 0})
