"""Flow control through real Envoy, a real ext_proc and simulated vLLM replicas (``kvgate up``).

Each engine may hold one request (``flow/saturation max_in_flight = 1``): a burst larger than the fleet
is held in the gateway and served as engines finish (Envoy's completion log tells the ext_proc), with no
429 and never two requests at one engine; a held request whose client goes away never reaches an engine.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator

import httpx
import pytest

from kvgate.dev.up import Stack, StackOptions
from tests.polling import until

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(
        replicas=2,
        port=0,
        sim_args=("--time-scale", "3"),
        workdir=tmp_path_factory.mktemp("flow"),
        overlay={"flow": {"saturation": {"max_in_flight": 1}}},
    )
    with Stack(options) as running:
        yield running


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


class EngineWatch:
    """Reads every engine's running + waiting gauges in a thread until stopped; the most seen at once."""

    def __init__(self, stack: Stack) -> None:
        self._urls = [e["metrics_url"] for e in stack.engines]
        self.most = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> EngineWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                for url in self._urls:
                    text = client.get(url).text
                    at_engine = metric(text, "vllm:num_requests_running") + metric(
                        text, "vllm:num_requests_waiting"
                    )
                    self.most = max(self.most, at_engine)


def body(content: str, max_tokens: int) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


async def test_a_burst_over_capacity_is_held_then_served_with_no_engine_queue(stack: Stack) -> None:
    assert stack.info is not None and stack.info.metrics_url
    gateway_metrics = stack.info.metrics_url
    with EngineWatch(stack) as watch:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
            answers = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body(f"burst {i}", 24)) for i in range(8))
            )
    assert [a.status_code for a in answers] == [200] * 8
    assert watch.most <= 1  # never two requests at one engine
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(gateway_metrics)).text
    assert metric(text, "kvgate_flow_dispatches_total", model=MODEL) >= 6 - 0.5
    assert metric(text, "kvgate_flow_sheds_total") == 0


async def test_a_held_request_whose_client_leaves_never_reaches_an_engine(stack: Stack) -> None:
    assert stack.info is not None and stack.info.metrics_url
    gateway_metrics = stack.info.metrics_url
    engines = [e["metrics_url"] for e in stack.engines]
    probe = httpx.Client(timeout=10)

    def prompt_tokens() -> float:
        return sum(metric(probe.get(u).text, "vllm:prompt_tokens_total") for u in engines)

    def queued() -> float:
        return metric(probe.get(gateway_metrics).text, "kvgate_flow_queued")

    def routed() -> float:
        return metric(probe.get(gateway_metrics).text, "kvgate_requests_total", outcome="routed")

    with probe:
        before, routed_before = prompt_tokens(), routed()
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
            busy = [
                asyncio.create_task(client.post("/v1/chat/completions", json=body(f"long {i}", 300)))
                for i in range(2)
            ]
            await until(lambda: routed() >= routed_before + 2, 20)
            leaver = asyncio.create_task(
                client.post("/v1/chat/completions", json=body("never to be served " * 200, 8))
            )
            await until(lambda: queued() >= 1 or leaver.done(), 20)
            assert not leaver.done(), leaver.result().text
            leaver.cancel()  # the client goes away while its request is held
            with pytest.raises(asyncio.CancelledError):
                await leaver
            await until(lambda: queued() == 0, 5)  # removed at once, not at its expiry (60 s)
            assert not all(t.done() for t in busy)
            done = await asyncio.gather(*busy)
        assert [r.status_code for r in done] == [200, 200]
        served = prompt_tokens() - before
        assert served < 200  # the two short prompts only: the leaver's ~1,000-token prompt never ran
