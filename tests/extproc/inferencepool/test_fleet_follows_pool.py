"""The router's fleet follows the InferencePool: in memory (the sans-IO core fed watch events, the sync,
a real Router deciding), then the gateway's Cluster with a real etcd beside the stand-in API server
(tests/extproc/inferencepool/apiserver.py): an agent's registration takes over its pod's address and
gives it back when its lease ends."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncIterator
from pathlib import Path

import etcd3aio
import orjson
import pytest
from prometheus_client import generate_latest

from contracts.etcd import EtcdSettings, endpoint_key
from contracts.events import EndpointId
from engines.endpoint import Endpoint, encode_endpoint
from extproc.config import parse_config
from extproc.control.cluster import Cluster
from extproc.control.policy import PolicyStore, routing_policy
from extproc.errors import GatewayError
from extproc.fleet import Fleet
from extproc.index.approximate import ApproximateIndex
from extproc.index.hybrid import HybridIndex
from extproc.inferencepool.config import PoolSettings
from extproc.inferencepool.core import PoolCore
from extproc.inferencepool.merge import PoolSync
from extproc.metrics import GatewayMetrics
from extproc.models.registry import ModelRegistry
from extproc.routing.request import Kind, parse_body
from extproc.routing.router import Router, RoutingPolicy
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile
from tests.extproc.inferencepool.apiserver import FakeApiServer
from tests.extproc.inferencepool.objects import NAMESPACE, pod, pool
from tests.polling import until

pytest_plugins = ("tests.etcd_fixtures",)

MODEL = "m"


def picks(router: Router, n: int, tag: str) -> list[list[str]]:
    """``n`` decisions of distinct prompts: each one's pick then fallbacks."""
    out = []
    for i in range(n):
        body = orjson.dumps({"model": MODEL, "prompt": f"{tag} request {i} " * 4})
        decision = router.decide(parse_body(Kind.COMPLETION, body), request_id=f"{tag}-{i}", now=float(i))
        router.finish(decision)
        out.append([s.id for s in decision.endpoints])
    return out


def test_the_router_routes_to_a_pod_once_ready_and_never_to_a_deleted_one() -> None:
    fleet = Fleet()
    router = Router(
        fleet, ModelRegistry([]), ApproximateIndex(),
        RoutingPolicy(build_profile(DEFAULT_SCHEDULING), block_size=16), rng=random.Random(0),
    )  # fmt: skip
    core = PoolCore(PoolSettings(name="kvgate-pool", models=frozenset({MODEL})))
    sync = PoolSync(fleet)

    def changed() -> None:
        sync.set_pool(core.view().endpoints)

    core.pool.listed({"metadata": {"resourceVersion": "1"}, "items": [pool()]})
    core.pool_changed()
    items = [pod("a", "10.0.0.1"), pod("b", "10.0.0.2", ready=False)]
    core.pods.listed({"metadata": {"resourceVersion": "2"}, "items": items})
    changed()
    assert {p[0] for p in picks(router, 10, "one")} == {"a"}
    assert all("b" not in p for p in picks(router, 10, "one-more"))

    core.pods.event({"type": "MODIFIED", "object": pod("b", "10.0.0.2", rv=3)})  # b is Ready
    changed()
    assert "b" in {p[0] for p in picks(router, 20, "two")}

    core.pods.event({"type": "DELETED", "object": pod("a", "10.0.0.1", rv=4)})
    changed()
    after = picks(router, 20, "three")
    assert all(p == ["b"] for p in after)  # a is neither picked nor a fallback
    core.pods.event({"type": "MODIFIED", "object": pod("b", "10.0.0.2", deleting=True, rv=5)})
    changed()
    with pytest.raises(GatewayError):
        picks(router, 1, "none")


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer(NAMESPACE)
    await server.start()
    try:
        yield server
    finally:
        await server.aclose()


async def test_the_gateway_merges_the_pool_with_agents_registrations(
    api: FakeApiServer, etcd_settings: EtcdSettings, etcd_client: etcd3aio.Etcd3Client, tmp_path: Path
) -> None:
    api.put("inferencepools", pool())
    api.put("pods", pod("a", "127.0.0.11"))
    api.put("pods", pod("b", "127.0.0.12"))
    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
    raw = {"inference_pool": {"name": "kvgate-pool", "namespace": NAMESPACE, "kubeconfig": str(kubeconfig),
                              "models": [MODEL], "max_backoff_s": 0.2}}  # fmt: skip
    config = dataclasses.replace(parse_config(raw), etcd=etcd_settings)
    store = PolicyStore.from_config(config)
    fleet, index = Fleet(), HybridIndex()
    router = Router(fleet, ModelRegistry([]), index, routing_policy(store.policy, max_fallbacks=2))
    cluster = Cluster(config, fleet, index, router, store)
    await cluster.start()
    assert cluster.pool_watcher is not None and cluster.control is not None
    try:
        assert {s.id for s in fleet} == {"a", "b"}  # start waited for the first list
        metrics = GatewayMetrics(fleet)
        metrics.watch_pool(cluster.pool_counters)
        text = generate_latest(metrics.registry).decode()
        for line in ("synced 1.0", "endpoints 2.0", "lists_total 2.0", "relists_total 0.0"):
            assert f"kvgate_inference_pool_{line}" in text
        agent = Endpoint(
            EndpointId("node-1-vllm"), "127.0.0.11:8000", frozenset({MODEL}), node="node-1",
            block_size=16, capacity_blocks=4096, labels=(("zone", "z1"),),
        )  # fmt: skip
        assert etcd_client.kv is not None
        key = endpoint_key(etcd_settings.prefix, agent.id, agent.node)
        await etcd_client.kv.put(key, encode_endpoint(agent))
        await until(lambda: {s.id for s in fleet} == {"node-1-vllm", "b"}, 10.0)
        assert fleet.by_address("127.0.0.11:8000").endpoint == agent  # type: ignore[union-attr]
        assert cluster.control.core.counters["refused"] == 0
        # the pod changes while the agent holds its address: the agent's record stays
        api.put("pods", pod("a", "127.0.0.11", annotations={"kvgate.io/models": "m, other"}))
        await until(
            lambda: cluster.pool is not None and cluster.pool.pool["a"].models == {"m", "other"}, 10.0
        )
        assert {s.id for s in fleet} == {"node-1-vllm", "b"}
        # the pod stops being Ready: the agent's record leaves with it, and comes back with it
        api.put("pods", pod("a", "127.0.0.11", ready=False, annotations={"kvgate.io/models": "m, other"}))
        await until(lambda: {s.id for s in fleet} == {"b"}, 10.0)
        api.put("pods", pod("a", "127.0.0.11", annotations={"kvgate.io/models": "m, other"}))
        await until(lambda: {s.id for s in fleet} == {"node-1-vllm", "b"}, 10.0)
        # an agent's record at no pod's address is held out of the fleet
        outsider = Endpoint(EndpointId("outsider"), "127.0.0.99:8000", frozenset({MODEL}), node="node-9")
        await etcd_client.kv.put(
            endpoint_key(etcd_settings.prefix, outsider.id, outsider.node), encode_endpoint(outsider)
        )
        await until(lambda: cluster.control is not None and "outsider" in cluster.control.core.held, 10.0)
        assert {s.id for s in fleet} == {"node-1-vllm", "b"}
        # the agent's lease ends: the pod is the pool's endpoint again
        await etcd_client.kv.delete(key)
        await until(lambda: {s.id for s in fleet} == {"a", "b"}, 10.0)
        assert fleet.get(EndpointId("a")).endpoint.models == {"m", "other"}  # type: ignore[union-attr]
        # a pod deleted in Kubernetes is not routed to
        api.delete("pods", "b")
        await until(lambda: {s.id for s in fleet} == {"a"}, 10.0)
        assert all(p == ["a"] for p in picks(router, 5, "cluster"))
    finally:
        await cluster.aclose()


async def test_a_gateway_on_a_pool_alone_is_ready_once_a_pod_is(api: FakeApiServer, tmp_path: Path) -> None:
    """The whole ext_proc (``Gateway``) with ``[inference_pool]`` and nothing else: its gRPC readiness is
    NOT_SERVING while no pod of the pool is Ready, SERVING once one is, NOT_SERVING after it is deleted."""
    from grpc import aio
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from extproc.server import Gateway

    api.put("inferencepools", pool())
    api.put("pods", pod("a", "127.0.0.21", ready=False))
    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
    config = parse_config(
        {
            "extproc": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "metrics_listen": ""},
            "scrape": {"interval_s": 0.05},
            "inference_pool": {
                "name": "kvgate-pool", "namespace": NAMESPACE, "kubeconfig": str(kubeconfig),
                "models": [MODEL], "metrics_path": "",
            },
        }
    )  # fmt: skip
    gw = Gateway(config)
    await gw.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{gw.ports['health']}") as channel:
            health = health_pb2_grpc.HealthStub(channel)

            async def readiness() -> str:
                reply = await health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
                return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

            serving: list[str] = []

            async def poll(expected: str) -> None:
                for _ in range(400):
                    serving.append(await readiness())
                    if serving[-1] == expected:
                        return
                    await asyncio.sleep(0.025)
                raise AssertionError(f"readiness never {expected}: {serving[-3:]}")

            assert len(gw.fleet) == 0
            await poll("NOT_SERVING")
            api.put("pods", pod("a", "127.0.0.21"))
            await poll("SERVING")
            assert [s.address for s in gw.fleet] == ["127.0.0.21:8000"]
            api.delete("pods", "a")
            await poll("NOT_SERVING")
            assert len(gw.fleet) == 0
    finally:
        await gw.aclose(grace_s=0)
