"""etcd tenants/<id> and usage/<tenant>/<replica> through the control plane: the core hands them to their
sinks; against a real etcd a tenant put is admitted live (a bad value refused, a delete removing it), and
two replicas (Cluster + Gate each) sharing one etcd drain one token budget."""

from __future__ import annotations

import dataclasses
import json
import time

import etcd3aio
import pytest

from contracts.etcd import TENANTS, USAGE, Change, EtcdSettings, decode_usage, tenant_key, usage_key
from extproc.admission.gate import AuthConfig, Gate, Principal
from extproc.admission.keys import ApiKey, KeyStore, hash_key, new_key
from extproc.admission.shared import SharedAdmission
from extproc.admission.tenants import Tenant, Tenants
from extproc.config import parse_config
from extproc.control.cluster import Cluster
from extproc.control.plane import ControlCore
from extproc.control.policy import PolicyStore, routing_policy
from extproc.control.usage import UsageSync
from extproc.errors import Forbidden, TooManyRequests
from extproc.fleet import Fleet
from extproc.index.hybrid import HybridIndex
from extproc.models.registry import ModelRegistry
from extproc.routing.request import Kind, ParsedRequest
from extproc.routing.router import Router
from tests.polling import until

pytest_plugins = ("tests.etcd_fixtures",)

P = "/kvgate/"
KEY = new_key()
KEYS = KeyStore([ApiKey("k1", "t", hash_key(KEY), 1)])


class Recorder:
    """A FamilySink that records what it is handed."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes | None, bool]] = []

    def put(self, name: str, value: bytes, *, backlog: bool) -> bool:
        self.calls.append((name, value, backlog))
        return True

    def delete(self, name: str) -> bool:
        self.calls.append((name, None, False))
        return True


def test_core_hands_followed_families_to_their_sinks() -> None:
    core = ControlCore(P, Fleet([]), PolicyStore())
    tenants, usage = Recorder(), Recorder()
    core.follow(TENANTS, tenants)
    core.follow(USAGE, usage)
    with pytest.raises(ValueError):
        core.follow("policy", Recorder())
    core.snapshot([(f"{P}tenants/a", b"1"), (f"{P}usage/t/r1", b"5")], 1)
    core.apply([Change(f"{P}usage/t/r1", b"7"), Change(f"{P}tenants/a", None)], 2)
    core.apply([Change(f"{P}usage/t/r1", b"7")], 3)  # the same value again: not handed on
    core.snapshot([(f"{P}usage/t/r1", b"9")], 4)  # a resync: changed keys, as backlog
    assert tenants.calls == [("a", b"1", True), ("a", None, False)]
    assert usage.calls == [("t/r1", b"5", True), ("t/r1", b"7", False), ("t/r1", b"9", True)]
    assert core.counters["ignored"] == 0


def test_usage_sync_skips_its_own_counters() -> None:
    seen: list[tuple[str, str, bytes | None, bool]] = []

    class Ledger:
        def due(self) -> dict[str, int]:
            return {}

        def observe(
            self, tenant_id: str, replica: str, value: bytes | None, *, backlog: bool, now: float
        ) -> int:
            seen.append((tenant_id, replica, value, backlog))
            return 1

    sync = UsageSync(Ledger(), sync_s=1.0, replica="me")
    assert not sync.put("t/me", b"5", backlog=False)
    assert not sync.put("not-a-usage-name", b"5", backlog=False)
    assert sync.put("t/other", b"5", backlog=True) and sync.delete("t/other")
    assert seen == [("t", "other", b"5", True), ("t", "other", None, False)]


# -- against a real etcd ---------------------------------------------------------------------------------


def _replica(settings: EtcdSettings, sync_s: float = 0.02) -> tuple[Cluster, Gate, SharedAdmission]:
    config = dataclasses.replace(parse_config({}), etcd=settings)
    store = PolicyStore.from_config(config)
    fleet, index = Fleet([]), HybridIndex()
    router = Router(fleet, ModelRegistry([]), index, routing_policy(store.policy, max_fallbacks=2))
    cluster = Cluster(config, fleet, index, router, store)
    gate = Gate(AuthConfig(api_keys_file="-"), Tenants([Tenant("file", ("*",))]), KEYS)
    shared = SharedAdmission(gate)
    cluster.share_admission(shared.tenants, shared.usage, sync_s)
    return cluster, gate, shared


def _who(gate: Gate) -> Principal:
    return gate.identify(f"Bearer {KEY}", None, None)


def _admit(gate: Gate, tokens: int) -> None:
    """Admit a request of ``tokens`` (prompt tokens + max_tokens) on ``gate``; raises 403/429."""
    body = {"model": "m", "max_tokens": 1}
    gate.admit(
        _who(gate), ParsedRequest(Kind.CHAT, "m", body, False, messages=[]), tokens - 1, time.monotonic()
    )


async def test_tenants_follow_etcd_live(
    etcd_settings: EtcdSettings, etcd_client: etcd3aio.Etcd3Client
) -> None:
    assert etcd_client.kv is not None
    kv, key = etcd_client.kv, tenant_key(etcd_settings.prefix, "t")
    cluster, gate, shared = _replica(etcd_settings)
    await cluster.start()
    try:
        with pytest.raises(Forbidden):  # the key's tenant exists nowhere yet
            _who(gate)
        await kv.put(key, json.dumps({"models": ["m"]}).encode())
        await until(lambda: gate.tenants.get("t") is not None, 5.0)
        _admit(gate, 10)  # admitted at once, unlimited

        await kv.put(key, b'{"models": "m"}')  # refused: models must be a list
        await until(lambda: shared.tenants.rejected == 1, 5.0)
        assert _who(gate).tenant == Tenant("t", ("m",))  # the last good value stays
        assert [t.id for t in gate.tenants] == ["file", "t"]

        await kv.delete(key)
        await until(lambda: gate.tenants.get("t") is None, 5.0)
        with pytest.raises(Forbidden) as err:
            _who(gate)
        assert err.value.status == 403 and err.value.code == "no_tenant"
        assert gate.tenants.get("file") is not None
    finally:
        await cluster.aclose()


async def test_two_replicas_drain_one_budget(
    etcd_settings: EtcdSettings, etcd_client: etcd3aio.Etcd3Client
) -> None:
    """Burst 100, refill 1 token a minute: A spends 60, B is then refused 60 but admits 40, after which
    both refuse even 2 tokens: the fleet admitted exactly the one budget, not 100 per replica."""
    assert etcd_client.kv is not None
    prefix = etcd_settings.prefix
    limited = {"models": ["*"], "tokens": {"per_minute": 1, "burst": 100}}
    await etcd_client.kv.put(tenant_key(prefix, "t"), json.dumps(limited).encode())
    (cluster_a, a, _), (cluster_b, b, _) = _replica(etcd_settings), _replica(etcd_settings)
    await cluster_a.start()
    await cluster_b.start()
    try:
        assert _who(a).tenant.tokens is not None and _who(b).tenant.tokens is not None

        def level(gate: Gate) -> float:
            value = gate.budgets.level(_who(gate).tenant, time.monotonic())
            assert value is not None
            return value

        _admit(a, 60)
        await until(lambda: level(b) < 41, 5.0)  # B was charged A's 60
        assert 40 <= level(b) < 41
        with pytest.raises(TooManyRequests) as err:
            _admit(b, 60)  # a replica of its own would have admitted it
        assert err.value.status == 429 and err.value.code == "tokens_exceeded"
        _admit(b, 40)
        await until(lambda: level(a) < 1, 5.0)  # A was charged B's 40
        for gate in (a, b):
            with pytest.raises(TooManyRequests):
                _admit(gate, 2)
        assert cluster_a.usage is not None and cluster_b.usage is not None
        raw_a = await etcd_client.kv.get(usage_key(prefix, "t", cluster_a.usage.replica))
        assert decode_usage(raw_a.kvs[0].value) == 60  # what A charged, under A's lease

        await cluster_a.aclose()  # A's lease is revoked: its counter vanishes at once
        response = await etcd_client.kv.get(usage_key(prefix, "t", cluster_a.usage.replica))
        assert not response.kvs
    finally:
        await cluster_a.aclose()
        await cluster_b.aclose()
