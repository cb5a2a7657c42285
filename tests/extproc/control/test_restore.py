"""extproc.control.restore: when a decision calls for a llama.cpp slot restore (plan, a table), and the
restorer against a stand-in agent on 127.0.0.1:0 (each outcome, the deadline, the metrics), over plaintext and
over mTLS (the agent's HTTPS admin listener, :mod:`agent.admin`, with dev-CA certificates)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from agent.admin import client_cert_required, server_context
from agent.config import TLSFiles
from certs.store import dev_bundle
from contracts.digest import Digest
from contracts.errors import ConfigError
from contracts.events import EndpointId, Stored, node_store_endpoint
from engines.endpoint import Endpoint
from extproc.config import SlotRestoreConfig
from extproc.control.restore import SlotRestorer, plan
from extproc.fleet import EndpointState, Fleet
from extproc.index.approximate import ApproximateIndex
from extproc.index.hybrid import HybridIndex
from extproc.index.precise import PreciseIndex
from extproc.metrics import GatewayMetrics
from extproc.models.registry import ModelRegistry
from extproc.routing.request import Kind, parse_body
from extproc.routing.router import Decision, Router, RoutingPolicy
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile
from runtime.tls import ClientTlsFiles, ReloadingClientCerts, client_context, client_tls
from tests.extproc.migration.test_identity import copy_of, rotate

URL = "http://127.0.0.1:1/slots/restore-chain"
CHAIN = [Digest(bytes([i]) * 16) for i in range(100)]


def decision(*, matched: int, lead: int, url: str | None = URL, blocks: int = 100) -> Decision:
    pick = EndpointState(
        Endpoint(EndpointId("b"), "127.0.0.1:8002", frozenset({"m"}), "llama_cpp", slot_restore=url)
    )
    other = EndpointState(Endpoint(EndpointId("a"), "127.0.0.1:8001", frozenset({"m"}), "llama_cpp"))
    return Decision("r1", "m", [pick, other], CHAIN[:blocks], blocks * 16, matched, kv_lead_blocks=lead)


@pytest.mark.parametrize(
    ("matched", "lead", "url", "blocks", "config", "asked"),
    [
        (0, 80, URL, 100, SlotRestoreConfig(), 80),  # kvcached leads by 80 blocks: restore its 80
        (50, 80, URL, 100, SlotRestoreConfig(), None),  # 30 more is under min_blocks (32)
        (48, 80, URL, 100, SlotRestoreConfig(), 80),  # exactly 32 more
        (0, 80, None, 100, SlotRestoreConfig(), None),  # the agent offers no restore
        (0, 80, URL, 100, SlotRestoreConfig(enabled=False), None),
        (0, 0, URL, 100, SlotRestoreConfig(min_blocks=1), None),  # no kvcached lead at all
        (0, 120, URL, 100, SlotRestoreConfig(), 100),  # never more than the request's own chain
        (0, 20, URL, 100, SlotRestoreConfig(min_blocks=8), 20),
    ],
)
def test_plan(
    matched: int, lead: int, url: str | None, blocks: int, config: SlotRestoreConfig, asked: int | None
) -> None:
    wanted = plan(decision(matched=matched, lead=lead, url=url, blocks=blocks), config)
    if asked is None:
        assert wanted is None
        return
    assert wanted is not None and wanted.url == URL and wanted.engine == "b"
    assert list(wanted.digests) == CHAIN[:asked] and wanted.gain_blocks == asked - matched
    assert json.loads(wanted.body()) == {"engine": "b", "digests": [d.hex() for d in CHAIN[:asked]]}


class Agent:
    """A stand-in agent route: answers with ``status``/``body`` after ``delay_s``; records requests."""

    def __init__(self) -> None:
        self.status, self.body, self.delay_s = 200, b'{"restored": true}', 0.0
        self.seen: list[dict[str, object]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append(await request.json())
        await asyncio.sleep(self.delay_s)
        return web.Response(status=self.status, body=self.body, content_type="application/json")


async def serve(stand_in: Agent, tls: TLSFiles | None = None) -> tuple[web.AppRunner, str]:
    """``stand_in`` on 127.0.0.1:0: plaintext, or HTTPS requiring a client certificate as the agent does."""
    app = web.Application(middlewares=[] if tls is None else [client_cert_required])
    app.add_routes([web.post("/slots/restore-chain", stand_in.handle)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=None if tls is None else server_context(tls))
    await site.start()
    scheme = "http" if tls is None else "https"
    return runner, f"{scheme}://127.0.0.1:{runner.addresses[0][1]}/slots/restore-chain"


@pytest.fixture
async def agent() -> AsyncIterator[tuple[Agent, str]]:
    stand_in = Agent()
    runner, url = await serve(stand_in)
    try:
        yield stand_in, url
    finally:
        await runner.cleanup()


def restore_counts(metrics: GatewayMetrics) -> dict[str, float]:
    """``kvgate_slot_restores_total`` by outcome."""
    return {
        s.labels["outcome"]: s.value
        for m in metrics.registry.collect()
        if m.name == "kvgate_slot_restores"
        for s in m.samples
        if s.name.endswith("_total")
    }


async def test_outcomes_deadline_and_metrics(agent: tuple[Agent, str]) -> None:
    stand_in, url = agent
    metrics = GatewayMetrics(Fleet())
    restorer = SlotRestorer(SlotRestoreConfig(timeout_s=0.3), metrics)
    wanted = decision(matched=0, lead=64, url=url)
    pick = wanted.endpoints[0]
    try:
        assert await restorer.before_routing(wanted) == "restored"
        assert stand_in.seen[-1] == {"engine": "b", "digests": [d.hex() for d in CHAIN[:64]]}
        stand_in.body = b'{"restored": false, "outcome": "miss"}'
        assert await restorer.before_routing(wanted) == "miss"
        stand_in.status, stand_in.body = 409, b'{"error": {"code": 409, "message": "no idle slot"}}'
        assert await restorer.before_routing(wanted) == "busy"
        stand_in.status = 502
        assert await restorer.before_routing(wanted) == "failed"
        stand_in.status, stand_in.body = 200, b"not json"
        assert await restorer.before_routing(wanted) == "failed"
        stand_in.body, stand_in.delay_s = b'{"restored": true}', 1.0
        started = asyncio.get_running_loop().time()
        assert await restorer.before_routing(wanted) == "timeout"
        assert asyncio.get_running_loop().time() - started < 0.9  # the deadline, not the agent's pace
        assert await restorer.before_routing(decision(matched=60, lead=64)) is None  # nothing to gain
        pick.endpoint = dataclasses.replace(pick.endpoint, slot_restore="http://127.0.0.1:9/none")
        assert await restorer.before_routing(wanted) == "failed"  # nobody listens there
    finally:
        await restorer.aclose()
    counted = restore_counts(metrics)
    assert counted == {"restored": 1.0, "miss": 1.0, "busy": 1.0, "failed": 3.0, "timeout": 1.0}
    (histogram,) = [m for m in metrics.registry.collect() if m.name == "kvgate_slot_restore_seconds"]
    assert [s.value for s in histogram.samples if s.name.endswith("_count")] == [7.0]


def test_router_decision_carries_the_kvcached_lead() -> None:
    """The core path end to end without IO: node-0's kvcached holds a prompt's first 40 blocks, the request
    is pinned to the replica on node-1 (nothing on its GPU): the decision's lead is 40, and the plan asks
    node-1's agent for those 40 blocks."""
    restore_url = "http://127.0.0.1:7401/slots/restore-chain"
    fleet = Fleet(
        [
            Endpoint(EndpointId("a"), "127.0.0.1:8001", frozenset({"m"}), "llama_cpp", node="node-0"),
            Endpoint(EndpointId("b"), "127.0.0.1:8002", frozenset({"m"}), "llama_cpp", node="node-1",
                     slot_restore=restore_url),
        ]
    )  # fmt: skip
    index = HybridIndex(PreciseIndex(), ApproximateIndex())
    policy = RoutingPolicy(build_profile(DEFAULT_SCHEDULING), block_size=16)
    router = Router(fleet, ModelRegistry([]), index, policy)
    router.node_stores = frozenset({"node-0", "node-1"})
    request = parse_body(Kind.COMPLETION, orjson.dumps({"model": "m", "prompt": list(range(50 * 16))}))
    chain = router.digests(request, router.tokens(request))
    store = EndpointId(node_store_endpoint("node-0"))
    index.set_precise(store, True)
    index.apply([Stored(store, [bytes(d) for d in chain[:40]], tier="ram")], 0.0)

    decided = router.decide(request, request_id="r", now=1.0, pinned=["127.0.0.1:8002"])
    assert decided.endpoints[0].id == "b" and (decided.matched_blocks, decided.kv_lead_blocks) == (0, 40)
    wanted = plan(decided, SlotRestoreConfig())
    assert wanted is not None and wanted.url == restore_url and list(wanted.digests) == chain[:40]
    elsewhere = router.decide(request, request_id="s", now=1.0, pinned=["127.0.0.1:8001"])
    assert plan(elsewhere, SlotRestoreConfig()) is None  # a's agent offers no restore


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, ClientTlsFiles | TLSFiles]:
    """The agent's server files, the gateway's ``[feeds]`` files, and the CA alone (no client cert)."""
    bundle = dev_bundle(tmp_path / "pki", ["agent-node-1", "extproc"], dt.datetime.now(dt.UTC))
    agent, gateway = bundle["agent-node-1"], bundle["extproc"]
    return {
        "agent": TLSFiles(str(agent.cert), str(agent.key), str(agent.ca)),
        "feeds": ClientTlsFiles(ca=gateway.ca, cert=gateway.cert, key=gateway.key),
        "ca_only": ClientTlsFiles(ca=gateway.ca),
    }


async def test_https_agent_with_the_gateways_client_certificate(
    pki: dict[str, ClientTlsFiles | TLSFiles], agent: tuple[Agent, str]
) -> None:
    """mTLS: the ``[feeds]`` client certificate gets the restore; the same restorer still reaches a
    plaintext agent; no client certificate is a 401 (``failed``); no TLS at all never dials an https URL."""
    agent_files, feeds, ca_only = pki["agent"], pki["feeds"], pki["ca_only"]
    assert isinstance(agent_files, TLSFiles)
    assert isinstance(feeds, ClientTlsFiles) and isinstance(ca_only, ClientTlsFiles)
    stand_in = Agent()
    runner, url = await serve(stand_in, agent_files)
    plain_agent, plain_url = agent
    assert url.startswith("https://")
    config = SlotRestoreConfig(timeout_s=5.0)
    mtls = SlotRestorer(config, tls=client_context(feeds, where="feeds"))
    anonymous = SlotRestorer(config, tls=client_context(ca_only, where="feeds"))
    metrics = GatewayMetrics(Fleet())
    no_tls = SlotRestorer(config, metrics)
    try:
        assert await mtls.before_routing(decision(matched=0, lead=64, url=url)) == "restored"
        assert stand_in.seen == [{"engine": "b", "digests": [d.hex() for d in CHAIN[:64]]}]
        assert await mtls.before_routing(decision(matched=0, lead=64, url=plain_url)) == "restored"
        assert len(plain_agent.seen) == 1
        assert await anonymous.before_routing(decision(matched=0, lead=64, url=url)) == "failed"  # 401
        assert await no_tls.before_routing(decision(matched=0, lead=64, url=url)) == "failed"
        assert len(stand_in.seen) == 1  # neither got past the agent's certificate check
    finally:
        for restorer in (mtls, anonymous, no_tls):
            await restorer.aclose()
        await runner.cleanup()
    counted = restore_counts(metrics)
    assert counted == {"failed": 1.0}


async def test_server_certificate_from_another_ca_is_refused(
    pki: dict[str, ClientTlsFiles | TLSFiles], tmp_path: Path
) -> None:
    """The restorer verifies the agent: a server certificate from another CA fails the handshake."""
    feeds = pki["feeds"]
    assert isinstance(feeds, ClientTlsFiles)
    rogue = dev_bundle(tmp_path / "rogue", ["agent-node-1"], dt.datetime.now(dt.UTC))["agent-node-1"]
    stand_in = Agent()
    runner, url = await serve(stand_in, TLSFiles(str(rogue.cert), str(rogue.key), str(feeds.ca)))
    restorer = SlotRestorer(SlotRestoreConfig(timeout_s=5.0), tls=client_context(feeds, where="feeds"))
    try:
        assert await restorer.before_routing(decision(matched=0, lead=64, url=url)) == "failed"
        assert stand_in.seen == []
    finally:
        await restorer.aclose()
        await runner.cleanup()


def test_unusable_feeds_files_name_the_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="feeds TLS: cannot load certificates"):
        client_context(ClientTlsFiles(ca=tmp_path / "missing.pem"), where="feeds")


async def test_a_rotated_feeds_certificate_is_presented_by_the_next_connection(tmp_path: Path) -> None:
    """The restorer follows ``[feeds]`` rotation (``runtime.tls.ReloadingClientCerts``): rotated to an
    identity that may not change agent state (another agent's), the next restore gets the agent's 403
    (``failed``); rotated back to a gateway's, the next one is restored, without a restart."""
    bundle = dev_bundle(tmp_path / "pki", ["agent-node-1", "extproc"], dt.datetime.now(dt.UTC))
    agent = bundle["agent-node-1"]
    mine = copy_of(bundle["extproc"], tmp_path)
    tls = client_tls(mine, where="feeds")
    assert isinstance(tls, ReloadingClientCerts)
    stand_in = Agent()
    runner, url = await serve(stand_in, TLSFiles(str(agent.cert), str(agent.key), str(agent.ca)))
    restorer = SlotRestorer(SlotRestoreConfig(timeout_s=10.0), tls=tls)
    try:
        assert await restorer.before_routing(decision(matched=0, lead=64, url=url)) == "restored"
        rotate(mine, "agent-node-2")
        assert await restorer.before_routing(decision(matched=0, lead=64, url=url)) == "failed"  # 403
        assert len(stand_in.seen) == 1 and tls.reloads == 1
        rotate(mine, "extproc-2")
        assert await restorer.before_routing(decision(matched=0, lead=64, url=url)) == "restored"
        assert len(stand_in.seen) == 2 and tls.reloads == 2
    finally:
        await restorer.aclose()
        await runner.cleanup()


async def test_an_agents_redirect_is_not_followed(agent: tuple[Agent, str]) -> None:
    """The endpoint record names the agent to ask: an answer redirecting to another agent (which would
    restore into its own engine, and be counted for this one) is a failed restore, not followed."""
    other, other_url = agent

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(other_url)

    app = web.Application()
    app.add_routes([web.post("/slots/restore-chain", moved)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    restorer = SlotRestorer(SlotRestoreConfig(timeout_s=2.0), GatewayMetrics(Fleet()))
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/slots/restore-chain"
        assert await restorer.before_routing(decision(matched=0, lead=64, url=url)) == "failed"
        assert other.seen == []
    finally:
        await restorer.aclose()
        await runner.cleanup()
