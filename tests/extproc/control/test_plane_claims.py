"""The gateway's control plane: an endpoint id belongs to the node whose key claimed it first. An agent
writing only under its own ``endpoints/<node>/`` cannot take over another node's endpoint (its address,
its feed) by registering the same id; its claim waits and takes over when the holder's key goes. In
memory and from a real etcd (the order of etcd's create revisions, not of key names, decides)."""

from __future__ import annotations

import etcd3aio
import pytest

from contracts.etcd import Change, EtcdSettings, endpoint_key
from contracts.events import EndpointId
from engines.endpoint import Endpoint, encode_endpoint
from extproc.control.plane import ControlCore, ControlPlane
from extproc.control.policy import PolicyStore
from extproc.fleet import Fleet
from tests.polling import until

pytest_plugins = ("tests.etcd_fixtures",)

P = "/kvgate/"


def _ep(name: str, port: int, node: str) -> Endpoint:
    return Endpoint(
        EndpointId(name),
        f"127.0.0.1:{port}",
        frozenset({"m"}),
        node=node,
        kv_events=True,
        feed=f"127.0.0.1:{port + 1}",
    )


def _put(endpoint: Endpoint, node: str | None = None) -> Change:
    return Change(endpoint_key(P, endpoint.id, node or endpoint.node), encode_endpoint(endpoint))


def _core() -> tuple[ControlCore, Fleet]:
    fleet = Fleet([])
    return ControlCore(P, fleet, PolicyStore()), fleet


def _address(fleet: Fleet, endpoint_id: str) -> str | None:
    state = fleet.get(EndpointId(endpoint_id))
    return None if state is None else state.endpoint.address


def test_another_nodes_claim_of_an_id_waits_until_the_holders_key_goes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core, fleet = _core()
    mine, theirs = _ep("e2", 8001, "node-b"), _ep("e2", 9001, "node-a")
    assert core.apply([_put(mine)], 3).fleet_changed
    assert not core.apply([_put(theirs)], 5).fleet_changed  # node-a's key, written last: refused
    state = fleet.get(mine.id)
    assert state is not None and state.endpoint == mine  # node-b's address and feed stay
    assert core.counters["claims_refused"] == 1
    moved = _ep("e2", 9003, "node-a")
    assert not core.apply([_put(moved)], 6).fleet_changed  # still waiting, counted again
    assert core.counters["claims_refused"] == 2 and _address(fleet, "e2") == mine.address
    assert sum("endpoints/node-a/e2 refused" in r.getMessage() for r in caplog.records) == 1  # logged once

    assert core.apply([Change(endpoint_key(P, "e2", "node-b"), None)], 7).fleet_changed  # lease ended
    state = fleet.get(mine.id)
    assert state is not None and state.endpoint == moved  # the waiting claim holds the id now
    assert not core.apply([_put(mine)], 8).fleet_changed  # node-b back: it waits in turn
    assert _address(fleet, "e2") == moved.address and core.counters["claims_refused"] == 3
    assert core.apply([Change(endpoint_key(P, "e2", "node-a"), None)], 9).fleet_changed
    assert _address(fleet, "e2") == mine.address
    assert core.apply([Change(endpoint_key(P, "e2", "node-b"), None)], 10).fleet_changed
    assert fleet.get(mine.id) is None and core.etcd_endpoints == frozenset()


def test_a_node_re_registers_its_own_id_and_an_older_agent_moves_its_key() -> None:
    core, fleet = _core()
    old = _ep("e3", 8001, "node-b")
    assert core.apply([Change(endpoint_key(P, "e3"), encode_endpoint(old))], 1).fleet_changed  # endpoints/e3
    new = _ep("e3", 8003, "node-b")
    assert core.apply([_put(new)], 2).fleet_changed  # the same node's key in the new layout takes over
    assert _address(fleet, "e3") == new.address
    core.apply([_put(_ep("e3", 9001, "node-a"))], 3)  # another node: refused
    assert _address(fleet, "e3") == new.address and core.counters["claims_refused"] == 1
    again = _ep("e3", 8005, "node-b")
    assert core.apply([_put(again)], 4).fleet_changed  # the node re-registers its own id
    assert not core.apply([Change(endpoint_key(P, "e3"), None)], 5).fleet_changed  # the old key's lease
    assert _address(fleet, "e3") == again.address and core.counters["claims_refused"] == 1


def test_the_oldest_create_revision_holds_whatever_order_the_keys_come_in() -> None:
    first, second = _ep("e4", 8001, "node-z"), _ep("e4", 9001, "node-a")
    kvs = [
        (endpoint_key(P, "e4", "node-a"), encode_endpoint(second)),  # sorts first, created later
        (endpoint_key(P, "e4", "node-z"), encode_endpoint(first)),
    ]
    created = {kvs[0][0]: 12, kvs[1][0]: 10}
    core, fleet = _core()
    core.snapshot(kvs, 20, created=created)
    assert _address(fleet, "e4") == first.address
    core, fleet = _core()
    core.apply([Change(k, v, created[k]) for k, v in kvs], 20)
    assert _address(fleet, "e4") == first.address
    # While this gateway was away from etcd, node-z's key went and came back (the same value): node-a's
    # claim is the older now, as a gateway started after it would read.
    assert core.snapshot(kvs, 30, created={kvs[0][0]: 12, kvs[1][0]: 25}).fleet_changed
    assert _address(fleet, "e4") == second.address


async def test_an_agent_cannot_take_over_another_nodes_endpoint_in_etcd(
    etcd_settings: EtcdSettings, etcd_client: etcd3aio.Etcd3Client
) -> None:
    kv, p = etcd_client.kv, etcd_settings.prefix
    assert kv is not None
    b, a = _ep("e5", 8101, "node-b"), _ep("e5", 8201, "node-a")
    await kv.put(endpoint_key(p, "e5", "node-b"), encode_endpoint(b))
    fleet = Fleet([])
    plane = ControlPlane(etcd_settings, fleet, PolicyStore(), probe_interval_s=0.2)
    await plane.start()
    try:
        assert await plane.wait_synced(5.0)
        assert _address(fleet, "e5") == b.address
        await kv.put(endpoint_key(p, "e5", "node-a"), encode_endpoint(a))
        await until(lambda: plane.counters["claims_refused"] == 1, 2.0)
        state = fleet.get(b.id)
        assert state is not None and state.endpoint == b
    finally:
        await plane.aclose()

    # A gateway started now reads both keys at once (node-a's sorts first): node-b's, created first, holds.
    fleet = Fleet([])
    plane = ControlPlane(etcd_settings, fleet, PolicyStore(), probe_interval_s=0.2)
    await plane.start()
    try:
        assert await plane.wait_synced(5.0)
        assert _address(fleet, "e5") == b.address and plane.counters["claims_refused"] == 1
        await kv.delete(endpoint_key(p, "e5", "node-b"))  # node-b's lease ended
        await until(lambda: _address(fleet, "e5") == a.address, 2.0)
        state = fleet.get(a.id)
        assert state is not None and state.endpoint == a
    finally:
        await plane.aclose()
