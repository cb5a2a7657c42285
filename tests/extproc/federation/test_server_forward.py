"""The forward check in the gRPC shell: where a long prompt's window is hashed before the forward verdict
(issue 27.2: no long work on the event loop). The gateway's real tokenizer (SmolLM2), a link to a peer
whose summary holds the prompt's prefix, the stream driven through :meth:`ExternalProcessor.Process`."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from typing import cast

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from contracts.digest import Digest
from contracts.federation import HOP_HEADER, ModelSummary, Report
from extproc.config import parse_config
from extproc.federation.forwarding import Forwarder
from extproc.federation.links import parse_federation
from extproc.federation.peers import Federation
from extproc.federation.summary import SummaryBuilder, build_bits, sampled, sizing
from extproc.processor import ProcessorConfig
from extproc.routing.request import Kind, parse_body
from extproc.routing.router import LazyPrompt
from extproc.server import ExternalProcessor, Gateway
from tests.extproc.test_server import MODEL, body_msgs, chat_body, decision, headers_msg, threads_calling

INGRESS_B = "10.9.0.1:10443"


@pytest.fixture
def gateway(model_dir: str) -> Gateway:
    """A gateway (not started: the test drives its servicer) with SmolLM2 on two endpoints."""
    config = parse_config(
        {
            "extproc": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "metrics_listen": ""},
            "models": [{"name": MODEL, "model_dir": model_dir, "max_model_len": 1 << 20}],
            "endpoints": [
                {"id": f"e{i}", "address": f"127.0.0.{i + 1}:8000", "models": [MODEL]} for i in range(2)
            ],
        }
    )
    return Gateway(config)


def forwarder(chain: list[Digest], block_size: int) -> Forwarder:
    """A forwarder with one link, to ``b``, whose summary holds ``chain`` (warm only there)."""
    link = {
        "cluster": "b",
        "ingress": INGRESS_B,
        "service": "10.9.0.1:9500",
        "identity": "spiffe://kvgate.local/federation-b",
        "rtt_ms": 20,
        "egress_requests_per_s": 100,
        "egress_bytes_per_s": 1e9,
    }
    fwd = Forwarder(Federation(parse_federation({"cluster": "a", "links": [link]})), SummaryBuilder())
    entries = sampled(chain)
    size, k = sizing(len(entries))
    summary = ModelSummary(MODEL, block_size, k, len(entries), build_bits(entries, size, k), 0.0, 1)
    fwd.federation.received(Report("b", 0.0, 3.0, [summary]), time.monotonic())  # the shell's clock
    return fwd


@pytest.fixture
def hashed_in(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads each step of a lazy prompt's tokenizing and hashing ran in, from now on."""
    return threads_calling(monkeypatch, LazyPrompt, "_hash_step")


async def test_a_large_prompts_window_is_hashed_for_the_forward_check_off_the_event_loop(
    gateway: Gateway, hashed_in: list[str]
) -> None:
    """A never-seen long prompt (a body over ``offload_bytes``) with a link in force: its whole window is
    hashed before the forward verdict, in the worker thread that prepares the body, not on the event loop
    after the decision; the verdict is the same (its prefix, warm only in the peer, goes there)."""
    payload = chat_body(" ".join(f"f{i}" for i in range(20_000)))  # ~130 KB, every block new
    tokens = gateway.router.tokens(parse_body(Kind.CHAT, payload), window=True)
    assert tokens.chain is not None and tokens.rest is not None and tokens.rest.complete
    fwd = forwarder(list(tokens.chain), gateway.router.policy.block_size)
    servicer = ExternalProcessor(
        gateway.router, ProcessorConfig(max_body_bytes=1 << 20), gateway.metrics, federation=fwd
    )

    async def messages() -> AsyncIterator[pb.ProcessingRequest]:
        for msg in [headers_msg("/v1/chat/completions"), *body_msgs(payload)]:
            yield msg

    hashed_in.clear()
    resps = [r async for r in servicer.Process(messages(), cast(grpc.aio.ServicerContext, None))]
    destination, _, set_headers = decision(resps)
    assert destination.split(",")[0] == INGRESS_B and set_headers[HOP_HEADER] == "a"
    assert fwd.decisions == {"forward": 1}
    assert len(hashed_in) > 1 and threading.main_thread().name not in hashed_in, hashed_in
