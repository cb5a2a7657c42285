"""SLO-aware admission through real Envoy, a real ext_proc and simulated vLLM replicas (``kvgate up``).

Requests of several sizes teach the gateway each engine's TTFT (its scrapes of the engines'
``vllm:time_to_first_token_seconds`` histograms, windows of 0.5 s); then a long prompt whose deadline
no engine is predicted to meet gets 429 ``slo_unattainable`` and never reaches an engine, while the
same prompt without a deadline is served. The replicas run 30x slower than the simulated H100, so a
long prompt's prefill takes seconds, well clear of the gateway's own processing time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from extproc.scheduling.predict import CONFIDENT_AFTER
from kvgate.dev.up import Stack, StackOptions
from tests.e2e.test_flow import body, metric


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(
        replicas=2,
        port=0,
        sim_args=("--time-scale", "30"),
        workdir=tmp_path_factory.mktemp("flow-slo"),
        overlay={"flow": {"saturation": {"max_in_flight": 1}}},
    )
    with Stack(options) as running:
        yield running


async def test_a_deadline_no_engine_is_predicted_to_meet_is_shed_before_any_engine(stack: Stack) -> None:
    assert stack.info is not None and stack.info.metrics_url
    gateway_metrics = stack.info.metrics_url
    engines = [e["metrics_url"] for e in stack.engines]
    probe = httpx.Client(timeout=10)

    def learned() -> float:
        return metric(probe.get(gateway_metrics).text, "kvgate_ttft_prediction_error_seconds_count")

    def sheds() -> float:
        return metric(probe.get(gateway_metrics).text, "kvgate_flow_sheds_total", reason="slo_unattainable")

    def prompt_tokens() -> float:
        return sum(metric(probe.get(u).text, "vllm:prompt_tokens_total") for u in engines)

    with probe:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
            i = 0
            while learned() < 2 * (CONFIDENT_AFTER + 2):  # windows of both engines' TTFT histograms
                i += 1
                assert i <= 60, f"learned only {learned()} windows"
                pair = [  # at once: each engine holds one, so a pair is split
                    client.post(
                        "/v1/chat/completions",
                        json=body(f"teach {i} {j} " + "word " * (100 * (i % 4 + 1)), 1),
                    )
                    for j in range(2)
                ]
                assert [r.status_code for r in await asyncio.gather(*pair)] == [200, 200]
            tokens_before = prompt_tokens()
            long = body("unattainable " + "word " * 3000, 1)
            shed = await client.post(
                "/v1/chat/completions", json=long, headers={"x-kvgate-deadline-ms": "150"}
            )
            assert shed.status_code == 429, shed.text
            error = shed.json()["error"]
            assert error["code"] == "slo_unattainable" and "predicted" in error["message"]
            assert shed.headers["retry-after"]
            assert prompt_tokens() == tokens_before  # no engine saw it
            served = await client.post("/v1/chat/completions", json=long)
            assert served.status_code == 200
            assert sheds() == 1
