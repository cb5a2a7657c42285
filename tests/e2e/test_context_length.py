"""End to end (the OpenAI SDK -> real Envoy -> ext_proc -> an engine): prompts that fill the model's context
and bodies over the derived limit are refused by the gateway, quickly, without an engine seeing them, and
without stalling other requests.

The one engine is a spy that records every request it gets (and answers 200, empty): a refusal from the
gateway leaves it untouched, while a request that fits reaches it. SmolLM2-135M-Instruct's files give it
8192 tokens of context, so with no ``max_body_bytes`` set the gateway takes bodies up to
8192 x 81 x 6 + 1 MiB = 5,029,888 bytes (``extproc.config.default_max_body_bytes``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import orjson
import pytest

from kvgate.dev.up import Stack, StackOptions
from tests.e2e.conftest import Spy

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
DERIVED_LIMIT = 5_029_888


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Spy]]:
    spy = Spy()
    thread = threading.Thread(target=spy.serve_forever, daemon=True)
    thread.start()
    options = StackOptions(port=0, endpoints=(spy.address,), workdir=tmp_path_factory.mktemp("context"))
    try:
        with Stack(options) as stack:
            yield stack, spy
    finally:
        spy.shutdown()
        spy.server_close()


def engine_requests(spy: Spy) -> list[str]:
    """What reached the engine, less the gateway's metrics scrapes."""
    return [path for path in spy.hits if path.startswith("/v1/")]


def chat_body(content: str, **extra: object) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], **extra})


def post(stack: Stack, body: bytes) -> httpx.Response:
    return httpx.post(
        f"{stack.url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )


def test_a_prompt_that_fits_reaches_the_engine(gateway: tuple[Stack, Spy]) -> None:
    """Whatever max_tokens asks for: vLLM clamps it to what the prompt leaves of the context."""
    stack, spy = gateway
    before = len(engine_requests(spy))
    assert post(stack, chat_body("hello " * 1000, max_tokens=16)).status_code == 200
    assert post(stack, chat_body("hello " * 8000, max_tokens=1000)).status_code == 200
    assert engine_requests(spy)[before:] == ["/v1/chat/completions"] * 2


def test_over_the_context_the_sdk_sees_context_length_exceeded(gateway: tuple[Stack, Spy]) -> None:
    stack, spy = gateway
    before = engine_requests(spy)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello " * 9000}], max_tokens=16
        )
    assert chat.value.status_code == 400 and chat.value.code == "context_length_exceeded"
    assert chat.value.param == "messages" and chat.value.type == "invalid_request_error"
    assert "maximum context length is 8192 tokens" in chat.value.message
    assert "which exceeds this limit even without any output tokens" in chat.value.message
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model=MODEL, prompt="hello " * 8300, max_tokens=16)
    assert (completion.value.code, completion.value.param) == ("context_length_exceeded", "prompt")
    assert engine_requests(spy) == before


def test_huge_bodies_are_refused_quickly_and_models_stay_prompt(gateway: tuple[Stack, Spy]) -> None:
    """The reported case: a 21 MB body, under the former 32 MiB limit, was parsed and tokenized on the
    ext_proc's event loop for seconds (GET /v1/models waited 4.6 s) and then sent to an engine."""
    stack, spy = gateway
    before = engine_requests(spy)
    huge = chat_body("x" * (21 * 1024 * 1024))  # over the derived limit: 413 while it streams in
    long = chat_body("x" * (4 * 1024 * 1024), max_tokens=16)  # under it, far over the context: 400
    assert len(long) < DERIVED_LIMIT < len(huge)

    def send(body: bytes) -> tuple[int, str, float]:
        started = time.monotonic()
        resp = post(stack, body)
        return resp.status_code, resp.json()["error"]["code"] or "", time.monotonic() - started

    # One client lists throughout: a new one per request costs ~19 ms of CPU (its SSL context).
    with ThreadPoolExecutor(2) as pool, httpx.Client(timeout=30) as lister:
        sent = [pool.submit(send, body) for body in (huge, long)]
        slowest = 0.0
        while not all(f.done() for f in sent):  # meanwhile, the model list answers at once
            started = time.monotonic()
            listed = lister.get(f"{stack.url}/v1/models")
            slowest = max(slowest, time.monotonic() - started)
            assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == [MODEL]
        (huge_status, huge_code, huge_s), (long_status, long_code, long_s) = (f.result() for f in sent)
    assert (huge_status, huge_code, long_status, long_code) == (413, "", 400, "context_length_exceeded")
    assert max(huge_s, long_s) < 10, (huge_s, long_s)  # loose: not a benchmark
    assert slowest < 1.0, slowest
    assert engine_requests(spy) == before
