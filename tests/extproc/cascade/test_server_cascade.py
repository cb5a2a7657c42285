"""A cascade's steps in the gRPC shell: where the next step's prompt is rendered and tokenized (issue 27.2:
no long work on the event loop). The gateway's real tokenizer (SmolLM2, loaded once per step model), a
fake upstream answering the gated step, the stream driven through :meth:`ExternalProcessor.Process`."""

from __future__ import annotations

import threading
import types
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.cascade.plan import CascadePolicy, Cascader
from extproc.cascade.spec import CascadeSpec
from extproc.config import parse_config
from extproc.processor import ProcessorConfig
from extproc.routing.request import ParsedRequest
from extproc.server import ExternalProcessor, Gateway
from extproc.upstream.client import Answer
from extproc.upstream.request import SubRequest
from tests.extproc.cascade.test_processor_cascade import answer
from tests.extproc.test_server import body_msgs, decision, headers_msg, threads_calling

SMALL, LARGE = "127.0.0.1:8000", "127.0.0.2:8000"


@pytest.fixture
def gateway(model_dir: str) -> Gateway:
    """A gateway (not started: the test drives its servicer) with SmolLM2 served as ``small`` and as
    ``large``, one endpoint each."""
    config = parse_config(
        {
            "extproc": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "metrics_listen": ""},
            "models": [
                {"name": name, "model_dir": model_dir, "max_model_len": 1 << 20}
                for name in ("small", "large")
            ],
            "endpoints": [
                {"id": "s", "address": SMALL, "models": ["small"]},
                {"id": "l", "address": LARGE, "models": ["large"]},
            ],
        }
    )
    return Gateway(config)


class Upstream:
    """The gated step's engine: an answer whose logprobs fail the gate (the request escalates)."""

    def __init__(self) -> None:
        self.sent: list[SubRequest] = []

    async def send(self, sub: SubRequest) -> Answer:
        self.sent.append(sub)
        return Answer(200, answer(-3.0, -2.5))


@pytest.fixture
def tokenized_in(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Each prompt the router renders and tokenizes from now on: (its model, the thread's name)."""

    def model(request: ParsedRequest, **_: object) -> str:
        return request.model

    return threads_calling(monkeypatch, gateway.router, "tokens", model)


async def test_a_large_bodys_next_step_is_rendered_and_tokenized_off_the_event_loop(
    gateway: Gateway, tokenized_in: list[tuple[str, str]]
) -> None:
    """A body over ``offload_bytes`` whose gated first step escalates: the next step's prompt (another
    model: another template and tokenizer, nothing cached) is rendered and tokenized in a worker thread,
    as the first step's was, not on the event loop; it is routed to the next step as before."""
    upstream = Upstream()
    cascader = Cascader(
        CascadePolicy(types.MappingProxyType({"auto": CascadeSpec(("small", "large"), -0.5, timeout_s=5)}))
    )
    servicer = ExternalProcessor(
        gateway.router,
        ProcessorConfig(max_body_bytes=1 << 20),
        gateway.metrics,
        upstream=cast(Any, upstream),
        cascade=cascader,
    )
    content = " ".join(f"s{i}" for i in range(20_000))  # ~130 KB, every block new
    payload = orjson.dumps({"model": "auto", "messages": [{"role": "user", "content": content}]})

    async def messages() -> AsyncIterator[pb.ProcessingRequest]:
        for msg in [headers_msg("/v1/chat/completions"), *body_msgs(payload)]:
            yield msg

    resps = [r async for r in servicer.Process(messages(), cast(grpc.aio.ServicerContext, None))]
    assert [sub.address for sub in upstream.sent] == [SMALL]
    destination, _, set_headers = decision([r for r in resps if r.HasField("request_headers")])
    assert destination == LARGE and set_headers["x-kvgate-model"] == "large"
    main = threading.main_thread().name
    assert [model for model, _ in tokenized_in] == ["small", "large"]
    assert main not in [thread for _, thread in tokenized_in], tokenized_in
