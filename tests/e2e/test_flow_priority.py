"""Flow control with an engine that schedules by priority, through real Envoy, a real ext_proc and a
simulated replica: one that preempts like SGLang (``--scheduling-policy priority --priority-preemption``),
and one that schedules as vLLM's v1 scheduler does (``--scheduling-policy priority`` alone: the waiting
queue ordered by ``(priority, arrival)``, no preemption for a waiting request).

The engine runs one sequence at a time and the gateway fills it with batch work (``max_in_flight = 1``,
batch headroom 0); interactive may go past the limit (headroom -1) and the gateway writes each request's
band into the body (``flow/engine_priority``), so an interactive arrival preempts the running batch
request at the engine's next step instead of waiting for it to end, and the batch request still
completes afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from kvgate.dev.up import Stack, StackOptions
from tests.e2e.test_flow import metric
from tests.polling import until

MODEL = "SmolLM2-135M-Instruct"
OBJECTIVE = "x-llm-d-inference-objective"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    sim = ("--time-scale", "3", "--max-num-seqs", "1", "--scheduling-policy", "priority")
    options = StackOptions(
        replicas=1,
        port=0,
        sim_args=(*sim, "--priority-preemption"),
        workdir=tmp_path_factory.mktemp("flow-priority"),
        overlay={
            "objectives": {"interactive": {"priority": 1}, "batch": {"priority": 0}},
            "flow": {
                "saturation": {"max_in_flight": 1},
                "bands": {"1": {"headroom": -1}},
                "engine_priority": {"order": "low_first"},
            },
        },
    )
    with Stack(options) as running:
        yield running


def body(content: str, max_tokens: int) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


async def test_an_interactive_request_preempts_running_batch_work_at_the_engine(stack: Stack) -> None:
    assert stack.info is not None and stack.info.metrics_url
    engine = stack.engines[0]["metrics_url"]
    probe = httpx.Client(timeout=10)

    def running() -> float:
        return metric(probe.get(engine).text, "vllm:num_requests_running")

    with probe:
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
            long = client.post("/v1/chat/completions", json=body("long", 400), headers={OBJECTIVE: "batch"})
            batch = asyncio.create_task(long)
            await until(lambda: running() >= 1, 20)
            urgent = await client.post(
                "/v1/chat/completions", json=body("quick question", 4), headers={OBJECTIVE: "interactive"}
            )
            assert urgent.status_code == 200, urgent.text
            assert not batch.done()  # served while the batch request still runs
            assert metric((await client.get(engine)).text, "vllm:num_preemptions_total") == 1
            done = await batch
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["completion_tokens"] == 400


@pytest.fixture(scope="module")
def vllm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One engine of one sequence at a time that orders its queue by priority as vLLM does; the gateway
    lets batch fill 4 (1 running, 3 queued at the engine) and interactive go to 8. ``engine_priority``
    assumes no order: the band reaches the engine because its endpoint record declares ``low_first``
    (``kvgate up`` reads it from the simulator's ``--scheduling-policy priority``)."""
    options = StackOptions(
        replicas=1,
        port=0,
        sim_args=("--time-scale", "3", "--max-num-seqs", "1", "--scheduling-policy", "priority"),
        workdir=tmp_path_factory.mktemp("flow-priority-vllm"),
        overlay={
            "objectives": {"interactive": {"priority": 1}, "batch": {"priority": 0}},
            "flow": {
                "saturation": {"max_in_flight": 4},
                "bands": {"1": {"headroom": -1}},
                "engine_priority": {},
            },
        },
    )
    with Stack(options) as running:
        yield running


async def test_an_interactive_request_is_served_ahead_of_batch_work_queued_at_the_engine(
    vllm_stack: Stack,
) -> None:
    stack = vllm_stack
    assert stack.engines[0].get("priority_order") == "low_first"
    engine = stack.engines[0]["metrics_url"]
    probe = httpx.Client(timeout=10)

    def gauge(name: str) -> float:
        return metric(probe.get(engine).text, name)

    with probe:
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:

            def send(content: str, tokens: int, objective: str) -> asyncio.Task[httpx.Response]:
                post = client.post(
                    "/v1/chat/completions", json=body(content, tokens), headers={OBJECTIVE: objective}
                )
                return asyncio.create_task(post)

            first = send("running batch", 150, "batch")
            await until(lambda: gauge("vllm:num_requests_running") >= 1, 20)
            queued = [send(f"queued batch {i}", 150, "batch") for i in range(3)]
            await until(lambda: gauge("vllm:num_requests_waiting") >= 3, 20)
            urgent = await send("quick question", 4, "interactive")
            assert urgent.status_code == 200, urgent.text
            # it waited for the running request (vLLM does not preempt for a waiting one), then went
            # before every batch request that had queued at the engine before it arrived
            assert not any(t.done() for t in queued)
            assert gauge("vllm:num_preemptions_total") == 0
            done = await asyncio.gather(first, *queued)
    assert [r.status_code for r in done] == [200] * 4
