"""extproc.inferencepool's sans-IO part: pool and pod objects -> endpoints, the watch protocol's state,
the merge rule with registered endpoints, and the sync into a Fleet beside the etcd control core."""

from __future__ import annotations

import pytest

from contracts.errors import ConfigError
from contracts.etcd import Change
from contracts.events import EndpointId
from engines.endpoint import Endpoint, encode_endpoint
from extproc.config import parse_config
from extproc.control.plane import ControlCore
from extproc.control.policy import PolicyStore
from extproc.fleet import Fleet
from extproc.inferencepool.config import PoolSettings, parse_pool_settings
from extproc.inferencepool.core import (
    Collection,
    Outcome,
    PoolCore,
    ProtocolError,
    decode_line,
    parse_pod,
    parse_pool,
    pool_endpoints,
)
from extproc.inferencepool.merge import MAX_REFUSED_CLAIMS, PoolSync, merge
from tests.extproc.inferencepool.objects import LABELS, pod, pool

SETTINGS = PoolSettings(name="kvgate-pool", models=frozenset({"m"}))


def endpoints(*pods: dict[str, object], spec: dict[str, object] | None = None) -> dict[EndpointId, Endpoint]:
    view = pool_endpoints(parse_pool(spec or pool()), [parse_pod(p) for p in pods], SETTINGS)
    return dict(view.endpoints)


def test_a_ready_selected_pod_is_one_endpoint_per_target_port() -> None:
    (only,) = endpoints(pod("a", "10.0.0.1")).values()
    assert only == Endpoint(
        EndpointId("a"),
        "10.0.0.1:8000",
        frozenset({"m"}),
        engine="vllm",
        metrics_url="http://10.0.0.1:8000/metrics",
        labels=(("inference-pool", "kvgate-pool"),),
        role="both",
    )
    two = endpoints(pod("a", "10.0.0.1"), spec=pool(ports=(8000, 8001)))
    assert {e.id: e.address for e in two.values()} == {"a:8000": "10.0.0.1:8000", "a:8001": "10.0.0.1:8001"}
    v6 = endpoints(pod("b", "fd00::5"))
    assert [e.address for e in v6.values()] == ["[fd00::5]:8000"]


@pytest.mark.parametrize(
    "left_out",
    [
        pod("a", "10.0.0.1", ready=False),
        pod("a", "10.0.0.1", deleting=True),  # terminating: Ready may still say True
        pod("a", "10.0.0.1", labels={"app.kubernetes.io/name": "something-else"}),
        pod("a", "10.0.0.1", labels={}),
        pod("a", None),
    ],
    ids=["not-ready", "terminating", "other-label", "no-labels", "no-ip"],
)
def test_pods_not_serving_the_pool_are_left_out(left_out: dict[str, object]) -> None:
    assert endpoints(left_out) == {}
    assert endpoints(left_out, pod("b", "10.0.0.2")).keys() == {"b"}


def test_engine_and_models_from_annotations_then_pool_then_config() -> None:
    annotated = pod("a", "10.0.0.1", annotations={"kvgate.io/engine": "sglang", "kvgate.io/models": "x, y"})
    (e,) = endpoints(annotated).values()
    assert (e.engine, e.models) == ("sglang", frozenset({"x", "y"}))
    spec = pool(annotations={"kvgate.io/engine": "llama_cpp", "kvgate.io/models": "p"})
    (e,) = endpoints(pod("a", "10.0.0.1"), spec=spec).values()
    assert (e.engine, e.models) == ("llama_cpp", frozenset({"p"}))
    # a bad annotation leaves that pod out, with the reason, and the others in
    bad = pod("a", "10.0.0.1", annotations={"kvgate.io/engine": "tgi"})
    view = pool_endpoints(parse_pool(pool()), [parse_pod(bad), parse_pod(pod("b", "10.0.0.2"))], SETTINGS)
    assert view.endpoints.keys() == {"b"} and "kvgate.io/engine" in view.refused["a"]


def test_pool_objects_that_cannot_be_used_are_refused() -> None:
    spec = parse_pool(pool())
    assert spec.label_selector == ",".join(f"{k}={v}" for k, v in sorted(LABELS.items()))
    assert spec.target_ports == (8000,)
    for broken in (
        {**pool(), "spec": {**pool()["spec"], "targetPorts": []}},
        {**pool(), "spec": {**pool()["spec"], "selector": {"matchLabels": {}}}},
        {**pool(), "spec": {**pool()["spec"], "targetPorts": [{"number": 0}]}},
        {"metadata": {}, "spec": pool()["spec"]},
    ):
        with pytest.raises(ConfigError):
            parse_pool(broken)


def test_collection_follows_list_events_bookmarks_and_410() -> None:
    pods = Collection("Pod")
    assert pods.listed(
        {"kind": "PodList", "metadata": {"resourceVersion": "10"}, "items": [pod("a", "1.1.1.1")]}
    )
    assert pods.resource_version == "10" and set(pods.objects) == {"a"}
    added = decode_line(b'{"type":"ADDED","object":' + _json(pod("b", "1.1.1.2", rv=11)) + b"}")
    assert pods.event(added) is Outcome.CHANGED and pods.resource_version == "11"
    assert pods.event(added) is Outcome.UNCHANGED  # the same object again
    bookmark = {"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": "15"}}}
    assert pods.event(bookmark) is Outcome.UNCHANGED and pods.resource_version == "15"
    deleted = {"type": "DELETED", "object": pod("a", "1.1.1.1", rv=16)}
    assert pods.event(deleted) is Outcome.CHANGED and set(pods.objects) == {"b"}
    gone = {
        "type": "ERROR",
        "object": {"kind": "Status", "status": "Failure", "code": 410, "reason": "Expired"},
    }
    assert pods.event(gone) is Outcome.RELIST and pods.resource_version is None
    other = {"type": "ERROR", "object": {"kind": "Status", "code": 500, "message": "etcd leader changed"}}
    assert pods.event(other) is Outcome.ERROR and "etcd leader" in pods.last_error
    for line in (b"not json", b'{"type":"ADDED"}', b"[1]"):
        with pytest.raises(ProtocolError):
            decode_line(line)
    with pytest.raises(ProtocolError):
        pods.event({"type": "RENAMED", "object": pod("a", "1.1.1.1")})
    with pytest.raises(ProtocolError):
        pods.listed({"items": []})  # no resourceVersion to watch from


def test_pool_core_keeps_the_last_good_pool_and_drops_pods_when_the_pool_goes() -> None:
    core = PoolCore(SETTINGS)
    core.pool.listed({"metadata": {"resourceVersion": "1"}, "items": [pool()]})
    assert core.pool_changed() and core.spec is not None
    core.pods.listed({"metadata": {"resourceVersion": "2"}, "items": [pod("a", "10.0.0.1")]})
    assert core.view().endpoints.keys() == {"a"}
    broken = {**pool(rv=3), "spec": {"selector": {"matchLabels": LABELS}, "targetPorts": []}}
    core.pool.event({"type": "MODIFIED", "object": broken})
    assert not core.pool_changed() and core.refused_pool and core.view().endpoints.keys() == {"a"}
    core.pool.event({"type": "DELETED", "object": pool(rv=4)})
    assert core.pool_changed() and core.spec is None and core.view().endpoints == {}


def test_merge_an_agent_record_at_the_same_address_wins() -> None:
    pod_ep = Endpoint(EndpointId("pod-a"), "10.0.0.1:8000", frozenset({"m"}))
    other = Endpoint(EndpointId("pod-b"), "10.0.0.2:8000", frozenset({"m"}))
    agent = Endpoint(
        EndpointId("node-1-vllm"), "10.0.0.1:8000", frozenset({"m"}), node="node-1", feed="10.0.0.1:9500",
        kv_events=True, block_size=16,
    )  # fmt: skip
    merged = merge({pod_ep.id: pod_ep, other.id: other}, [agent])
    assert merged == {agent.id: agent, other.id: other}
    same_id = Endpoint(EndpointId("pod-b"), "10.0.0.9:8000", frozenset({"m"}))
    assert merge({other.id: other}, [same_id]) == {same_id.id: same_id}  # a registered id is kept
    assert merge({pod_ep.id: pod_ep}, []) == {pod_ep.id: pod_ep}


def _ep(name: str, address: str) -> Endpoint:
    return Endpoint(EndpointId(name), address, frozenset({"m"}))


def test_pool_sync_beside_etcd_agent_takes_over_and_gives_back_its_pod() -> None:
    static = _ep("static-0", "127.0.0.1:9000")
    fleet = Fleet([static])
    sync = PoolSync(fleet)
    core = ControlCore("/kvgate/", fleet, PolicyStore({}))
    core.yields = sync.owns
    pod_a, pod_b = _ep("pod-a", "10.0.0.1:8000"), _ep("pod-b", "10.0.0.2:8000")
    shadow = _ep("pod-s", "127.0.0.1:9000")  # a pod at the static endpoint's address: the config wins
    assert sync.set_pool({pod_a.id: pod_a, pod_b.id: pod_b, shadow.id: shadow})
    assert {s.id for s in fleet} == {"static-0", "pod-a", "pod-b"} and sync.joined == {"pod-a", "pod-b"}
    assert not sync.reconcile()  # nothing to do
    agent = Endpoint(
        EndpointId("node-1-vllm"),
        "10.0.0.1:8000",
        frozenset({"m"}),
        node="node-1",
        feed="10.0.0.1:9500",
        kv_events=True,
    )
    key = "/kvgate/endpoints/node-1/node-1-vllm"
    assert core.apply([Change(key, encode_endpoint(agent))], 2).fleet_changed
    sync.reconcile()
    assert {s.id for s in fleet} == {"static-0", "node-1-vllm", "pod-b"}
    assert fleet.by_address("10.0.0.1:8000") is fleet.get(EndpointId("node-1-vllm"))
    assert fleet.get(EndpointId("node-1-vllm")).endpoint.kv_events  # type: ignore[union-attr]
    # a registration at a pod's address that is not the pool's stays refused (no yield)
    refused = Endpoint(EndpointId("x"), "127.0.0.1:9000", frozenset({"m"}), node="n")
    assert not core.apply([Change("/kvgate/endpoints/n/x", encode_endpoint(refused))], 3).fleet_changed
    # the agent leaves (its lease ended): the pod is the pool's endpoint again
    assert core.apply([Change(key, None)], 4).fleet_changed
    assert sync.reconcile()
    assert {s.id for s in fleet} == {"static-0", "pod-a", "pod-b"}
    # the pod leaves the pool
    assert sync.set_pool({pod_b.id: pod_b})
    assert {s.id for s in fleet} == {"static-0", "pod-b"}


def test_pool_sync_follows_a_pod_moving_to_a_freed_address() -> None:
    fleet = Fleet()
    sync = PoolSync(fleet)
    a, b = _ep("a", "10.0.0.1:8000"), _ep("b", "10.0.0.2:8000")
    sync.set_pool({a.id: a, b.id: b})
    a2, b2 = _ep("a", "10.0.0.3:8000"), _ep("b", "10.0.0.1:8000")  # b takes a's old address
    sync.set_pool({a2.id: a2, b2.id: b2})
    assert fleet.by_address("10.0.0.1:8000") is fleet.get(EndpointId("b"))
    assert fleet.by_address("10.0.0.3:8000") is fleet.get(EndpointId("a"))
    assert fleet.by_address("10.0.0.2:8000") is None


def test_inference_pool_settings_are_validated() -> None:
    config = parse_config({"inference_pool": {"name": "kvgate-pool", "models": ["m"], "kubeconfig": "~/k"}})
    assert config.inference_pool is not None and config.inference_pool.name == "kvgate-pool"
    assert not config.inference_pool.kubeconfig.startswith("~")  # type: ignore[union-attr]
    assert parse_config({}).inference_pool is None
    with pytest.raises(ConfigError, match=r"inference_pool\.models"):
        parse_config({"inference_pool": {"name": "kvgate-pool"}})  # no [[models]] either
    ok = parse_pool_settings({"name": "kvgate-pool", "namespace": "kvgate"}, "inference_pool", ("m",))
    assert (ok.models, ok.engine, ok.kubeconfig, ok.metrics_path) == (
        frozenset({"m"}),
        "vllm",
        None,
        "/metrics",
    )
    for raw, message in (
        ({}, "name: required"),
        ({"name": "Bad_Name"}, "not a Kubernetes object name"),
        ({"name": "p", "namespace": "a.b"}, "namespace"),
        ({"name": "p", "context": "c"}, "needs kubeconfig"),
        ({"name": "p", "engine": "tgi"}, "engine"),
        ({"name": "p", "metrics_path": "metrics"}, "metrics_path"),
        ({"name": "p", "timeout_s": 0}, "timeout_s"),
        ({"name": "p", "watch": True}, "unknown key"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_pool_settings(raw, "inference_pool", ("m",))
    with pytest.raises(ConfigError, match="models: required"):
        parse_pool_settings({"name": "p"}, "inference_pool", ())


def _json(obj: object) -> bytes:
    import json

    return json.dumps(obj).encode()


def test_agents_records_are_admitted_only_at_a_ready_pods_address() -> None:
    """The deploy's layout: the agent registers its engine under the pod's name at the pod's address."""
    fleet = Fleet()
    sync = PoolSync(fleet)
    core = ControlCore("/kvgate/", fleet, PolicyStore({}))
    core.yields, core.admits = sync.owns, sync.admits
    agent = Endpoint(
        EndpointId("pod-a"),
        "10.0.0.1:8000",
        frozenset({"m"}),
        node="pod-a",
        feed="10.0.0.1:9500",
        kv_events=True,
    )
    outsider = Endpoint(EndpointId("elsewhere"), "192.168.1.5:8000", frozenset({"m"}), node="n9")
    # before the pool is known every record is admitted (an API server down at start is no outage)
    core.apply([Change("/kvgate/endpoints/pod-a/pod-a", encode_endpoint(agent))], 1)
    core.apply([Change("/kvgate/endpoints/n9/elsewhere", encode_endpoint(outsider))], 2)
    assert {s.id for s in fleet} == {"pod-a", "elsewhere"}
    pod_a = _ep("pod-a", "10.0.0.1:8000")
    sync.set_pool({pod_a.id: pod_a})
    assert core.readmit()
    sync.reconcile()
    assert [s.endpoint for s in fleet] == [agent]  # the agent's record, not the pod's; the outsider held
    sync.set_pool({})  # pod-a is not Ready (or terminating, or left the selector)
    assert core.readmit() and len(fleet) == 0
    sync.set_pool({pod_a.id: pod_a})
    assert core.readmit() and [s.endpoint for s in fleet] == [agent]
    assert not sync.reconcile()
    core.apply([Change("/kvgate/endpoints/n9/elsewhere", None)], 3)  # a held record's key is deleted
    assert not core.readmit()
    # agents_outside_pool: every record is admitted
    open_sync = PoolSync(Fleet(), agents_outside_pool=True)
    open_sync.set_pool({})
    assert open_sync.admits(outsider)


def test_with_agent_node_is_pod_an_agent_cannot_claim_another_pods_engine() -> None:
    """Each agent writes only endpoints/<its pod>/ (its etcd identity), but chooses the record inside:
    agent-a registering pod-b's address (under any id) is held out, and pod-b's own agent is admitted."""
    fleet = Fleet()
    sync = PoolSync(fleet, agent_node_is_pod=True)
    core = ControlCore("/kvgate/", fleet, PolicyStore({}))
    core.yields, core.admits = sync.owns, sync.admits
    pod_a, pod_b = _ep("pod-a", "10.0.0.1:8000"), _ep("pod-b", "10.0.0.2:8000")
    sync.set_pool({pod_a.id: pod_a, pod_b.id: pod_b})
    claim = Endpoint(EndpointId("pod-b"), pod_b.address, frozenset({"m"}), node="pod-a", feed="10.0.0.1:9500")
    core.apply([Change("/kvgate/endpoints/pod-a/pod-b", encode_endpoint(claim))], 1)
    sync.reconcile()
    assert fleet.get(EndpointId("pod-b")).endpoint == pod_b  # type: ignore[union-attr]  # still the pod's
    assert sync.refused_claims == {(EndpointId("pod-b"), pod_b.address)}
    own = Endpoint(EndpointId("pod-b"), pod_b.address, frozenset({"m"}), node="pod-b", feed="10.0.0.2:9500")
    core.apply([Change("/kvgate/endpoints/pod-a/pod-b", None)], 2)
    core.apply([Change("/kvgate/endpoints/pod-b/pod-b", encode_endpoint(own))], 3)
    assert fleet.get(EndpointId("pod-b")).endpoint == own  # type: ignore[union-attr]
    # several target ports: the pod's endpoints are <pod>:<port>, and the pod is still named
    ports = PoolSync(Fleet(), agent_node_is_pod=True)
    on_port = _ep("pod-c:8001", "10.0.0.3:8001")
    ports.set_pool({on_port.id: on_port})
    mine = Endpoint(EndpointId("x"), on_port.address, frozenset({"m"}), node="pod-c")
    assert ports.admits(mine) and not ports.admits(Endpoint(mine.id, mine.address, mine.models, node="pod-d"))
    # without the flag (agents named otherwise): any agent at a ready pod's address
    plain = PoolSync(Fleet())
    plain.set_pool({pod_b.id: pod_b})
    assert plain.admits(claim)


def test_a_drain_reaches_pool_endpoints_present_and_to_come() -> None:
    fleet = Fleet()
    sync = PoolSync(fleet)
    core = ControlCore("/kvgate/", fleet, PolicyStore({}))
    core.yields, core.admits, sync.draining = sync.owns, sync.admits, core.draining
    a, b = _ep("pod-a", "10.0.0.1:8000"), _ep("pod-b", "10.0.0.2:8000")
    sync.set_pool({a.id: a})
    core.apply([Change("/kvgate/drain/pod-a", b"1"), Change("/kvgate/drain/pod-b", b"1")], 1)
    assert fleet.get(a.id).draining  # type: ignore[union-attr]
    sync.set_pool({a.id: a, b.id: b})  # b becomes Ready after its drain was ordered
    assert fleet.get(b.id).draining  # type: ignore[union-attr]
    core.apply([Change("/kvgate/drain/pod-b", None)], 2)
    assert not fleet.get(b.id).draining  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("pod_address", "claimed"),
    [
        ("[fd00::2]:8000", "[FD00::2]:8000"),  # the same IPv6 address, upper case
        ("[fd00::2]:8000", "[fd00:0:0:0:0:0:0:2]:8000"),  # written in full
        ("10.0.0.2:8000", "[::ffff:10.0.0.2]:8000"),  # an IPv4 pod by its IPv4-mapped IPv6 address
        ("10.0.0.2:8000", "[10.0.0.2]:8000"),  # brackets around an IPv4 address
    ],
)
def test_with_agent_node_is_pod_another_spelling_of_a_pods_address_is_no_way_around(
    pod_address: str, claimed: str
) -> None:
    """EDS gives Envoy the socket address, not the text: another spelling of pod-b's address reaches
    pod-b's engine, so with agents_outside_pool too it is still pod-b's address, refused to agent-a."""
    sync = PoolSync(Fleet(), agents_outside_pool=True, agent_node_is_pod=True)
    pod_b = _ep("pod-b", pod_address)
    sync.set_pool({pod_b.id: pod_b})
    claim = Endpoint(EndpointId("b2"), claimed, frozenset({"m"}), node="pod-a", feed="10.0.0.1:9500")
    assert not sync.admits(claim)
    assert sync.refused_claims == {(EndpointId("b2"), claimed)}
    own = Endpoint(EndpointId("b2"), claimed, frozenset({"m"}), node="pod-b")
    assert sync.admits(own)
    elsewhere = Endpoint(EndpointId("o"), "192.168.1.5:8000", frozenset({"m"}), node="pod-a")
    assert sync.admits(elsewhere)  # agents_outside_pool: a machine outside the cluster
    # without agents_outside_pool a record is admitted at a pool endpoint's address as written, as before
    strict = PoolSync(Fleet(), agent_node_is_pod=True)
    strict.set_pool({pod_b.id: pod_b})
    assert not strict.admits(claim) and not strict.admits(own)
    assert strict.admits(Endpoint(EndpointId("b2"), pod_address, frozenset({"m"}), node="pod-b"))


def test_refused_claims_are_remembered_within_a_bound() -> None:
    """An agent writing ever new ids at another pod's address is refused each time; the memory of what
    was logged stays bounded."""
    sync = PoolSync(Fleet(), agent_node_is_pod=True)
    pod_b = _ep("pod-b", "10.0.0.2:8000")
    sync.set_pool({pod_b.id: pod_b})
    for i in range(3 * MAX_REFUSED_CLAIMS):
        claim = Endpoint(EndpointId(f"x{i}"), pod_b.address, frozenset({"m"}), node="pod-a")
        assert not sync.admits(claim)
    assert 0 < len(sync.refused_claims) <= MAX_REFUSED_CLAIMS


def test_a_pod_that_does_not_parse_is_left_out_with_the_reason() -> None:
    """A pod whose annotations or labels are not strings is left out like a pod with a bad annotation:
    with its reason in the view's ``refused`` (which the watcher logs once), the others stay."""
    core = PoolCore(SETTINGS)
    core.pool.listed({"metadata": {"resourceVersion": "1"}, "items": [pool()]})
    assert core.pool_changed()
    bad = pod("a", "10.0.0.1")
    bad["metadata"]["annotations"] = {"kvgate.io/engine": 5}
    core.pods.listed({"metadata": {"resourceVersion": "2"}, "items": [bad, pod("b", "10.0.0.2")]})
    view = core.view()
    assert view.endpoints.keys() == {"b"} and "annotations" in view.refused["a"]
