"""The status snapshot, its JSON form and its HTML and text renderings, in memory (no IO, ``now`` given)."""

from __future__ import annotations

import html.parser
import json

import pytest

from contracts.digest import Digest
from contracts.events import EndpointId, Stored, node_store_endpoint
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics
from extproc.control.feeds import FeedView
from extproc.control.policy import PolicyStore
from extproc.fleet import Fleet
from extproc.flow.control import FlowControl, FlowRequest, Room
from extproc.index.hybrid import HybridIndex
from extproc.status.render import render_html, render_text
from extproc.status.snapshot import SCHEMA, Status, StatusError, decode, encode, snapshot

M = "SmolLM2-135M-Instruct"
NOW = 1000.0
WALL = 1_764_000_000.0
A = Endpoint(EndpointId("sim-0"), "127.0.0.1:8001", frozenset({M}), engine="sim", node="n0", kv_events=True)
B = Endpoint(EndpointId("sim-1"), "127.0.0.1:8002", frozenset({M}), role="decode")
C = Endpoint(EndpointId("pf-<0>"), "127.0.0.1:8003", frozenset({M, "other"}), role="prefill")
D = [Digest(bytes([i]) * 16) for i in range(6)]


def world() -> tuple[Fleet, HybridIndex, FlowControl[str], PolicyStore, list[FeedView]]:
    fleet = Fleet([A, B, C])
    fleet.record_scrape(A.id, EngineMetrics(waiting=2.0, running=3.0, kv_usage=0.25, at=NOW))
    fleet.set_state(B.id, draining=True)
    fleet.eject(C.id, until=NOW + 7.0)
    a, b = fleet.get(A.id), fleet.get(B.id)
    assert a is not None and b is not None
    a.count_routed(NOW, 3.0)
    b.count_routed(NOW, 1.0)
    a.in_flight, a.outstanding = 1, 2
    index = HybridIndex()
    index.set_precise(A.id, True)
    index.apply([Stored(str(A.id), list(D[:4]))], NOW)
    index.record(B.id, D[:2], NOW)
    store_id = EndpointId(node_store_endpoint("n0"))
    index.set_precise(store_id, True)
    index.apply([Stored(str(store_id), list(D[:3]), tier="ram")], NOW)
    flow = FlowControl[str]()
    for priority, n in ((0, 2), (1, 1)):
        for i in range(n):
            request = FlowRequest(model=M, priority=priority, flow="f", cost=1.0, size=10)
            assert flow.offer(request, f"r{priority}{i}", Room.FULL, NOW).held is not None
    policy = PolicyStore()
    assert policy.put("weights/prefix", b"5") is not None
    assert policy.put("weights/queue", b"-1") is None  # refused: kept, and shown as refused
    feeds = [
        FeedView("127.0.0.1:7001", True, ("sim-0",), 0.4, 0.01, ""),
        FeedView("127.0.0.1:7002", False, (), None, None, "UNAVAILABLE: down"),
    ]
    return fleet, index, flow, policy, feeds


def take() -> Status:
    fleet, index, flow, policy, feeds = world()
    return snapshot(fleet, index, flow, policy, feeds, NOW, WALL)


def test_every_endpoint_with_its_state_load_and_share() -> None:
    status = take()
    assert (
        status.at == WALL and status.schema == SCHEMA and status.models == ("SmolLM2-135M-Instruct", "other")
    )
    by_id = {e.id: e for e in status.endpoints}
    assert list(by_id) == ["pf-<0>", "sim-0", "sim-1"]  # sorted by id
    a, b, c = by_id["sim-0"], by_id["sim-1"], by_id["pf-<0>"]
    assert (a.state, b.state, c.state) == ("ready", "draining", "ejected")
    assert c.ejected_for_s == pytest.approx(7.0) and a.ejected_for_s == 0.0
    assert (a.role, b.role, c.role) == ("both", "decode", "prefill")
    assert (a.engine, a.node, a.address, a.models) == ("sim", "n0", "127.0.0.1:8001", (M,))
    assert (a.running, a.waiting, a.kv_usage, a.load) == (3.0, 2.0, 0.25, 5.0)
    assert (b.running, b.kv_usage) == (None, None)  # never scraped
    assert (a.in_flight, a.outstanding) == (1, 2)
    assert a.routed_share == pytest.approx(0.75) and b.routed_share == pytest.approx(0.25)
    assert c.routed_share == 0.0
    assert (a.index_blocks, a.precise, b.index_blocks, b.precise) == (4, True, 2, False)


def test_index_queues_and_policy() -> None:
    status = take()
    assert status.index.mode == "precise"
    assert status.index.blocks == 4 + 2 + 3
    assert status.index.stores == {node_store_endpoint("n0"): {"ram": 3}}
    assert [f.address for f in status.index.feeds] == ["127.0.0.1:7001", "127.0.0.1:7002"]
    assert status.index.feeds[1].last_error == "UNAVAILABLE: down" and not status.index.feeds[1].connected
    assert [(q.model, q.priority, q.queued) for q in status.queues] == [(M, 1, 1), (M, 0, 2)]
    assert status.queued == 3
    assert status.policy.values["weights/prefix"] == 5
    assert status.policy.overridden == ("weights/prefix",)
    assert "weights/queue" in status.policy.rejected
    assert set(PolicyStore().effective()) <= set(status.policy.values)  # what `kvgate policy list` shows


def test_an_empty_gateway() -> None:
    status = snapshot(Fleet(), HybridIndex(events=False), FlowControl[str](), PolicyStore(), [], NOW, WALL)
    assert status.endpoints == () and status.queues == () and status.index.mode == "approximate"
    assert decode(encode(status)) == status
    assert "no endpoints" in render_html(status)
    assert "0/0 endpoints ready" in render_text(status, "http://x")


def test_json_round_trip_and_no_secret_fields() -> None:
    status = take()
    raw = encode(status)
    assert decode(raw) == status
    doc = json.loads(raw)
    assert doc["schema"] == SCHEMA
    assert {"metrics_url", "slot_restore", "labels"}.isdisjoint(doc["endpoints"][0])
    doc["extra"] = {"from": "a newer gateway"}
    assert decode(json.dumps(doc).encode()) == status  # unknown keys are skipped


@pytest.mark.parametrize(
    "raw",
    [b"not json", b"[]", b'{"at": 1}', json.dumps({**json.loads(encode(take())), "schema": 99}).encode()],
)
def test_decode_refuses_what_is_not_a_status(raw: bytes) -> None:
    with pytest.raises(StatusError):
        decode(raw)


class _Text(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def test_the_page_names_every_endpoint_escaped_and_loads_nothing_external() -> None:
    status = take()
    page = render_html(status, refresh_s=3)
    parser = _Text()
    parser.feed(page)
    text = "".join(parser.text)
    for e in status.endpoints:
        assert e.id in text and e.address in text
    assert "pf-&lt;0&gt;" in page and "pf-<0>" not in page  # escaped
    assert '<meta http-equiv="refresh" content="3">' in page
    assert not {"script", "img", "link", "iframe"} & set(parser.tags)
    assert "http://" not in page and "https://" not in page
    assert "1/3 endpoints ready" in text and "3 held" in text and "weights/prefix" in text
    assert "UNAVAILABLE: down" in text


def test_the_text_tables() -> None:
    out = render_text(take(), "http://127.0.0.1:9090")
    lines = out.splitlines()
    assert lines[0].startswith("gateway http://127.0.0.1:9090 at 2025-11-24 ")
    assert "1/3 endpoints ready" in lines[0]
    fleet = lines[lines.index("FLEET") + 1 :]
    assert fleet[0].split() == [
        "endpoint",
        "address",
        "models",
        "role",
        "state",
        "load",
        "run",
        "wait",
        "kv",
        "share",
        "blocks",
    ]
    row = next(line for line in fleet if line.startswith("sim-0 ")).split()
    assert row == ["sim-0", "127.0.0.1:8001", M, "both", "ready", "5", "3", "2", "25%", "75%", "4"]
    assert next(line for line in fleet if line.startswith("sim-1 ")).split()[-1] == "2~"  # learned
    assert "ejected 7s" in out and "draining" in out
    assert "INDEX  precise, 9 blocks, store kvcached:n0 ram 3" in out
    assert "QUEUES  3 held" in out
    assert any(line.split() == ["weights/prefix", "5.0", "set"] for line in lines)
    assert any(line.startswith("refused: weights/queue: ") for line in lines)


def test_a_tripped_drift_alarm_is_a_warning_naming_model_and_endpoint() -> None:
    from extproc.drift.monitor import DriftMonitor, DriftPolicy

    monitor = DriftMonitor(DriftPolicy(window=8, min_samples=2))
    for _ in range(2):
        monitor.observe(M, "sim-1", 64, 0, NOW)
        monitor.observe(M, "sim-0", 64, 64, NOW)
    fleet, index, flow, policy, feeds = world()
    status = snapshot(fleet, index, flow, policy, feeds, NOW, WALL, monitor.views(NOW))
    assert [(d.endpoint, d.tripped, d.ratio, d.error) for d in status.drift] == [
        ("sim-0", False, 1.0, 0.0),
        ("sim-1", True, 0.0, 1.0),
    ]
    assert decode(encode(status)) == status
    text = render_text(status, "http://x").splitlines()
    warnings = [line for line in text if line.startswith("WARNING: drift")]
    assert len(warnings) == 1 and f"model {M} at endpoint sim-1" in warnings[0]
    assert text.index(warnings[0]) == 1  # under the headline
    assert "sim-1" in next(line for line in text if "TRIPPED" in line)
    page = render_html(status)
    assert f"WARNING: drift: model {M} at endpoint sim-1" in page and "TRIPPED" in page
