"""extproc.control.cluster: the flow policy in force follows the policy store, from the gateway config's
[flow] through a real etcd's policy/flow/... and objectives/<name> keys, and reaches flow_listener."""

from __future__ import annotations

import dataclasses

import etcd3aio

from contracts.etcd import EtcdSettings, encode_value, policy_key
from extproc.config import parse_config
from extproc.control.cluster import Cluster
from extproc.control.policy import PolicyStore, pd_policy, routing_policy
from extproc.disagg.plan import PdPolicy
from extproc.disagg.policy import PdSpec
from extproc.fleet import Fleet
from extproc.flow.policy import FlowPolicy, Objective, Saturation
from extproc.index.hybrid import HybridIndex
from extproc.models.registry import ModelRegistry
from extproc.routing.router import Router
from tests.polling import until

pytest_plugins = ("tests.etcd_fixtures",)


def _cluster(settings: EtcdSettings) -> Cluster:
    config = dataclasses.replace(
        parse_config({"flow": {"waiting_room_s": 5}, "objectives": {"batch": {"priority": -1}}}),
        etcd=settings,
    )
    store = PolicyStore.from_config(config)
    fleet, index = Fleet([]), HybridIndex()
    router = Router(fleet, ModelRegistry([]), index, routing_policy(store.policy, max_fallbacks=2))
    return Cluster(config, fleet, index, router, store)


async def test_flow_policy_follows_etcd_and_reaches_the_listener(
    etcd_settings: EtcdSettings, etcd_client: etcd3aio.Etcd3Client
) -> None:
    cluster = _cluster(etcd_settings)
    assert cluster.flow_listener is None
    assert cluster.flow_policy.waiting_room_s == 5.0  # the config's [flow], in force from the start
    assert cluster.flow_policy.objectives["batch"] == Objective("batch", -1)
    seen: list[FlowPolicy] = []
    cluster.flow_listener = seen.append
    await cluster.start()
    try:
        assert etcd_client.kv is not None
        prefix = etcd_settings.prefix
        await etcd_client.kv.put(policy_key(prefix, "flow/saturation"), encode_value({"max_waiting": 4}))
        await until(lambda: bool(seen) and seen[-1].saturation == Saturation(max_waiting=4.0), 5.0)
        await etcd_client.kv.put(f"{prefix}objectives/chat", encode_value({"priority": 2}))
        await until(lambda: "chat" in seen[-1].objectives, 5.0)
        count = len(seen)
        await etcd_client.kv.put(f"{prefix}objectives/chat", b'{"priority": "high"}')  # refused
        await etcd_client.kv.put(policy_key(prefix, "flow/fairness"), encode_value("requests"))
        await until(lambda: seen[-1].fairness == "requests", 5.0)
        assert len(seen) == count + 1  # the refused value put nothing in force
        assert seen[-1].objectives["chat"] == Objective("chat", 2)  # the last good value stays
        assert seen[-1].waiting_room_s == 5.0 and seen[-1].objectives["batch"].priority == -1
        assert cluster.flow_policy is seen[-1]
        assert "objectives/chat" in cluster.store.rejected
    finally:
        await cluster.aclose()


async def test_a_models_serving_mode_follows_etcd_and_reaches_the_pd_listener(
    etcd_settings: EtcdSettings, etcd_client: etcd3aio.Etcd3Client
) -> None:
    cluster = _cluster(etcd_settings)
    seen: list[PdPolicy] = []
    cluster.pd_listener = lambda policy: seen.append(pd_policy(policy, max_fallbacks=None))
    await cluster.start()
    try:
        assert etcd_client.kv is not None
        key = policy_key(etcd_settings.prefix, "models/m")
        await etcd_client.kv.put(key, encode_value({"disaggregation": {"mode": "conditional"}}))
        await until(lambda: bool(seen) and "m" in seen[-1].routes, 5.0)
        assert seen[-1].routes["m"].spec == PdSpec("conditional")
        count = len(seen)
        await etcd_client.kv.put(key, encode_value({"disaggregation": {"mode": "often"}}))  # refused
        await until(lambda: "models/m" in cluster.store.rejected, 5.0)
        assert len(seen) == count and seen[-1].routes["m"].spec.mode == "conditional"
        await etcd_client.kv.put(key, encode_value({"disaggregation": {"mode": "aggregated"}}))
        await until(lambda: "m" not in seen[-1].routes, 5.0)
    finally:
        await cluster.aclose()
