"""Traces of the agent and kvcached, exported to a real OTLP/gRPC receiver (:mod:`tests.otlp`): the agent's
admin/slot API (a real :class:`agent.main.Agent`, no engines) and kvcached's fetch path (the real gRPC
API over a unix socket, a peer stand-in), each joining the caller's trace."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import aiohttp
import pytest

from agent.config import AgentSection, NodeConfig
from agent.main import Agent
from agent.slot_api import RESTORE_CHAIN_PATH
from contracts.tracing import TracingSettings
from kvcached.service import ApiServer, KvcachedService
from kvcached.tiers import TieredStore
from runtime.kvcached import KvcachedClient
from runtime.tracing.tracer import Tracer, active
from tests.otlp import Collector, ReceivedSpan

DIGEST = "ab" * 16


@pytest.fixture
def collector() -> Iterator[Collector]:
    receiver = Collector().start()
    yield receiver
    receiver.stop()


def settings(collector: Collector, service: str) -> TracingSettings:
    return TracingSettings(True, 1.0, collector.endpoint, service, flush_interval_s=0.05)


def named(name: str) -> object:
    return lambda spans: any(s.name == name for s in spans)


@pytest.fixture
async def agent(tmp_path: Path, collector: Collector) -> AsyncIterator[Agent]:
    state, sock = str(tmp_path / "state"), f"unix:{tmp_path}/kv.sock"
    section = AgentSection(id="node-a", state_dir=state, kvcached=sock)
    node = NodeConfig(section, (), tracing=settings(collector, "kvgate-agent"))
    running = Agent(node, index_block_size=16)
    try:
        await running.start()
        yield running
    finally:
        await running.aclose()


async def test_agent_traces_its_slot_api_under_the_callers_trace(agent: Agent, collector: Collector) -> None:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    base = f"http://127.0.0.1:{agent.admin_port}"
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/healthz") as resp:  # a probe: never traced
            assert resp.status == 200
        headers = {"traceparent": f"00-{trace_id}-{parent}-01", "authorization": "Bearer sk-never-traced"}
        body = {"engine": "llama-0", "digests": [DIGEST]}
        async with session.post(base + RESTORE_CHAIN_PATH, json=body, headers=headers) as resp:
            assert resp.status == 404  # no such engine: the handler ran and answered
    spans = collector.wait_for(named(f"POST {RESTORE_CHAIN_PATH}"), 10, "the agent's span")
    span = next(s for s in spans if s.name == f"POST {RESTORE_CHAIN_PATH}")
    assert (span.service, span.kind, span.trace_id, span.parent) == ("kvgate-agent", 2, trace_id, parent)
    assert span.attributes == {
        "http.request.method": "POST",
        "http.route": RESTORE_CHAIN_PATH,
        "http.response.status_code": 404,
    }
    assert not any("healthz" in s.name for s in collector.snapshot())


class FakePeers:
    """Stands in for the QUIC PeerClient: one peer holding one block."""

    def __init__(self, held: dict[bytes, bytes]) -> None:
        self.held = held

    async def fetch(self, address: str, digests: Sequence[bytes]) -> dict[bytes, bytes]:
        return {d: self.held[d] for d in digests if d in self.held}


async def test_kvcached_get_and_its_peer_fetch_join_the_callers_trace(
    tmp_path: Path, collector: Collector
) -> None:
    digest = bytes.fromhex(DIGEST)
    store = TieredStore(1 << 20, None, 0)
    tracer = Tracer(settings(collector, "kvgate-kvcached"))
    service = KvcachedService(
        store,
        peer_client=FakePeers({digest: b"block"}),
        peers=lambda: ["peer:1"],
        tracer=tracer,  # type: ignore[arg-type]
    )
    server = ApiServer(service, listen_unix=str(tmp_path / "api.sock"))
    await server.start()
    caller = Tracer(settings(collector, "kvgate-agent"))  # as the agent's slot handler
    client = KvcachedClient(f"unix:{tmp_path / 'api.sock'}", timeout_s=5.0)
    try:
        outer = caller.start("POST /slots/restore-chain")
        with active(outer):
            assert await client.get(digest) == b"block"
        outer.end()
        spans: list[ReceivedSpan] = collector.wait_for(named("kvcached.peer_fetch"), 10, "kvcached's spans")
    finally:
        await client.aclose()
        await server.aclose()
        store.close()
        tracer.shutdown()
        caller.shutdown()
    get = next(s for s in spans if s.name == "kvcached.Get")
    fetch = next(s for s in spans if s.name == "kvcached.peer_fetch")
    assert get.service == "kvgate-kvcached" and get.kind == 2
    assert get.trace_id == format(outer.get_span_context().trace_id, "032x")
    assert get.parent == format(outer.get_span_context().span_id, "016x")
    assert get.attributes["kvcached.source"] == "peer"
    assert fetch.parent == get.span_id and fetch.attributes["kvcached.hit"] is True
