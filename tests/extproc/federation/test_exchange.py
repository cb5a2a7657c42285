"""The summary exchange over real gRPC with mTLS: two clusters' cores on loopback, each serving its
reports and following the other's; identities not linked are refused; a stopped peer stops being chosen
within seconds and comes back after it restarts."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from certs.store import LeafFiles, dev_bundle
from contracts.digest import Digest, block_digests, chain_seed
from contracts.federation import SUBSCRIBE_METHOD, Hello, Report, encode
from extproc.federation.decision import FORWARD, NO_PEER, SHORT
from extproc.federation.exchange import SummaryFollower, SummaryService
from extproc.federation.links import parse_federation
from extproc.federation.peers import Federation
from extproc.federation.summary import ModelLoad, SummaryBuilder
from extproc.federation.trust import CLIENT
from runtime.tls import ClientTlsFiles, channel_credentials
from tests.extproc.migration.test_identity import copy_of, rotate
from tests.polling import until

BS = 16
CHAIN = block_digests(chain_seed("m"), list(range(64 * BS)), BS)


@dataclass
class Side:
    fed: Federation
    builder: SummaryBuilder
    service: SummaryService
    follower: SummaryFollower

    def report(self) -> Report:
        summaries = self.builder.build(BS, {"m": ModelLoad(0.0, 1)}, lambda d: True)
        return Report(self.fed.cluster, time.time(), self.fed.config.ttl_s, summaries)


def section(name: str, leaf: LeafFiles, links: list[dict[str, Any]], port: int = 0) -> dict[str, Any]:
    return {
        "cluster": name,
        "listen": f"127.0.0.1:{port}",
        "tls_cert": str(leaf.cert),
        "tls_key": str(leaf.key),
        "tls_ca": str(leaf.ca),
        "refresh_s": 0.05,
        "ttl_s": 2.0,
        "down_base_s": 0.2,
        "down_max_s": 1.0,
        "prefill_s_per_token": 0.001,
        "links": links,
    }


def link(name: str, port: int) -> dict[str, Any]:
    return {
        "cluster": name,
        "ingress": "127.0.0.1:1",
        "service": f"127.0.0.1:{port}",
        "identity": f"spiffe://kvgate.local/federation-{name}",
        "rtt_ms": 5,
        "egress_requests_per_s": 1000,
        "egress_bytes_per_s": 1e9,
    }


async def start(config: dict[str, Any]) -> Side:
    fed = Federation(parse_federation(config))
    builder = SummaryBuilder()
    side = Side(fed, builder, SummaryService(fed, lambda: side.report()), SummaryFollower(fed))
    await side.service.start()
    return side


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, LeafFiles]:
    names = ["federation-a", "federation-b", "federation-c", "extproc"]
    return dev_bundle(tmp_path / "pki", names, dt.datetime.now(dt.UTC))


@pytest.fixture
async def pair(pki: dict[str, LeafFiles]) -> AsyncIterator[tuple[Side, Side]]:
    b = await start(section("b", pki["federation-b"], []))
    a = await start(section("a", pki["federation-a"], [link("b", b.service.port)]))
    # b links a back (both point at each other), now that a's port is known
    b.fed.links.put("a", encode_link(link("a", a.service.port)))
    a.follower.sync()
    b.follower.sync()
    yield a, b
    for side in (a, b):
        await side.follower.aclose()
        await side.service.aclose()


def encode_link(raw: dict[str, Any]) -> bytes:
    return json.dumps(raw).encode()


def decide(side: Side, chain: list[Digest] = CHAIN) -> str:
    return side.fed.decide("m", chain, 0, BS, 100, CLIENT, time.monotonic()).reason


async def test_a_summary_crosses_and_a_long_prefix_is_forwarded(pair: tuple[Side, Side]) -> None:
    a, b = pair
    assert decide(a) == NO_PEER
    b.builder.note("m", CHAIN)  # warm only in b
    await until(lambda: decide(a) == FORWARD, 5.0)
    (status,) = a.fed.status(time.monotonic())
    assert status.summary_bytes > 0 and status.summary_age_s is not None
    await until(lambda: decide(b) == SHORT, 5.0)  # a holds nothing of it: b never forwards to a
    await until(lambda: b.service.subscribers == 1 and a.service.subscribers == 1, 5.0)


async def test_a_stopped_peer_is_not_chosen_within_seconds_and_comes_back(
    pair: tuple[Side, Side], pki: dict[str, LeafFiles]
) -> None:
    a, b = pair
    b.builder.note("m", CHAIN)
    await until(lambda: decide(a) == FORWARD, 5.0)
    port = b.service.port
    await b.follower.aclose()
    await b.service.aclose(grace_s=0)
    # the lost stream marks b down at once, well before its last summary (TTL 2 s) would expire
    await until(lambda: not a.fed.up("b", time.monotonic()), 1.5)
    assert decide(a) == NO_PEER
    b2 = await start(section("b", pki["federation-b"], [], port=port))
    b2.builder.note("m", CHAIN)
    try:
        await until(lambda: decide(a) == FORWARD, 10.0)  # back after the retry's back-off
    finally:
        await b2.service.aclose()


async def report_status(address: str, leaf: LeafFiles) -> grpc.StatusCode:
    creds = channel_credentials(ClientTlsFiles(ca=leaf.ca, cert=leaf.cert, key=leaf.key))
    async with grpc.aio.secure_channel(address, creds) as channel:
        method = channel.unary_stream(SUBSCRIBE_METHOD, request_serializer=encode, response_deserializer=None)
        try:
            async for _ in method(Hello("x"), timeout=5):
                return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("who", ["federation-c", "extproc"])
async def test_an_identity_not_linked_gets_no_summary(
    pair: tuple[Side, Side], pki: dict[str, LeafFiles], who: str
) -> None:
    _, b = pair
    address = f"127.0.0.1:{b.service.port}"
    assert await report_status(address, pki[who]) == grpc.StatusCode.PERMISSION_DENIED
    assert await report_status(address, pki["federation-a"]) == grpc.StatusCode.OK


async def test_a_rotated_follower_certificate_is_presented_by_the_next_subscription(
    pki: dict[str, LeafFiles], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The follower's ``tls_*`` files follow rotation (``runtime.tls.ReloadingClientCerts``): its running
    subscription keeps going; after the peer restarts, the next subscription presents the new
    certificate: a cluster b does not link is refused, a renewed one of the linked identity is served."""
    b = await start(section("b", pki["federation-b"], []))
    files = copy_of(pki["federation-a"], tmp_path)
    assert files.cert is not None and files.key is not None
    mine = LeafFiles("federation-a", files.cert, files.key, pki["federation-a"].ca)
    a = await start(section("a", mine, [link("b", b.service.port)]))
    b.fed.links.put("a", encode_link(link("a", a.service.port)))
    port = b.service.port
    a.follower.sync()
    try:
        await until(lambda: a.follower.reports >= 1, 10.0)
        rotate(files, "federation-c")  # an identity b does not link
        seen = a.follower.reports
        await until(lambda: a.follower.reports > seen, 10.0)  # the subscription under way goes on
        await b.follower.aclose()
        await b.service.aclose(grace_s=0)
        caplog.set_level(logging.WARNING, logger="extproc.federation.exchange")
        b = await start(section("b", pki["federation-b"], [link("a", a.service.port)], port=port))
        await until(lambda: "PERMISSION_DENIED" in caplog.text, 10.0)
        seen = a.follower.reports
        rotate(files, "federation-a")  # renewed: the identity b links
        await until(lambda: a.follower.reports > seen, 15.0)
    finally:
        for side in (a, b):
            await side.follower.aclose()
            await side.service.aclose()


async def test_a_link_removed_ends_the_stream_already_open(pair: tuple[Side, Side]) -> None:
    """The caller is checked against the links in force before every report, not only when its stream
    opened: once b deletes its link to a, a's open subscription ends and a stops forwarding to b."""
    a, b = pair
    b.builder.note("m", CHAIN)
    await until(lambda: decide(a) == FORWARD and b.service.subscribers == 1, 5.0)
    b.fed.links.delete("a")
    await until(lambda: b.service.subscribers == 0, 5.0)
    await until(lambda: not a.fed.up("b", time.monotonic()), 5.0)
    assert decide(a) == NO_PEER


async def test_a_stream_that_goes_silent_without_closing_is_made_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer that sends one report and then nothing, its stream still open (died without a FIN, a
    blackholed path): after ``silent_s`` the follower drops it, marks the peer unreachable and subscribes
    again."""
    subscribed: list[asyncio.Event] = [asyncio.Event(), asyncio.Event()]
    forever = asyncio.Event()
    report = Report("b", time.time(), 3.0, [])

    async def subscribe(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        n = sum(e.is_set() for e in subscribed)
        if n < len(subscribed):
            subscribed[n].set()
        yield encode(report)
        await forever.wait()  # silent, never closed

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "kvgate.federation.v1.Federation", {"Subscribe": grpc.unary_stream_rpc_method_handler(subscribe)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    config = {"cluster": "a", "listen": "127.0.0.1:0", "links": [link("b", port)]}
    fed = Federation(parse_federation(config))
    caplog.set_level(logging.WARNING, logger="extproc.federation.exchange")
    follower = SummaryFollower(fed, silent_s=0.2)
    follower.sync()
    try:
        await asyncio.wait_for(subscribed[0].wait(), 10.0)
        await until(lambda: follower.reports == 1, 10.0)
        await asyncio.wait_for(subscribed[1].wait(), 10.0)  # dropped for its silence, then made again
        assert "summaries from b lost (nothing for 0.2 s)" in caplog.text
    finally:
        forever.set()
        await follower.aclose()
        await server.stop(0)
