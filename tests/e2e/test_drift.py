"""End to end: the drift alarm (extproc/drift) through real Envoy, the ext_proc and 3 simulated replicas.

``sim-0`` renders prompts with the model's own chat template; ``sim-1`` and ``sim-2`` with a
deliberately wrong one (messages in reverse order), so their prefix caches never hold the shared system
prompt the router predicts they hold. Requests are pinned to one replica with the conformance header.
Envoy's ``json_to_metadata`` filter reads each JSON answer's ``usage.prompt_tokens_details.cached_tokens``
into the completion log (kvgate/envoy/usage.py); the ext_proc compares it with its prediction.

With ``window = 32, min_samples = 8``: the first request to ``sim-1`` predicts nothing (a cold prefix),
each later one predicts the system prompt's blocks and the engine reuses none (error 1), so the alarm
trips at the 9th request (``min_samples + 1``), not before. ``sim-0`` answers 24 requests (sequential and
4 at a time) and never trips. ``sim-2`` gets only streams, whose answers carry no count: the alarm from
its prefix-cache counters (extproc/drift/counters.py) trips at the first scrape after the 9th.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from extproc.status.snapshot import DriftStatus, Status, decode
from kvgate.dev.up import Stack, StackOptions
from kvgate.status_cli import main as status_main
from tests.polling import until

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
FAST_SIM = ("--time-scale", "0.05")
SYSTEM = "You are a careful assistant for the kvgate drift test; answer briefly. " * 10  # ~9 KV blocks
#: SmolLM2's chat format with the messages in reverse order: the user's question comes first, so no two
#: requests share a prefix in this replica's cache.
REVERSED_TEMPLATE = (
    "{% for message in messages | reverse %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MIN_SAMPLES = 8


@contextmanager
def drift_stack(workdir: Path, **fleet: Any) -> Iterator[Stack]:
    """A stack over ``fleet`` (:class:`StackOptions` fields) whose ext_proc takes the conformance header
    (requests pinned to one replica) and runs the drift alarm with ``window = 32, min_samples =
    MIN_SAMPLES``."""
    overlay = {"drift": {"window": 32, "min_samples": MIN_SAMPLES}}
    options = StackOptions(port=0, workdir=workdir, extproc={"conformance": True}, overlay=overlay, **fleet)
    with Stack(options) as running:
        yield running


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with drift_stack(
        tmp_path_factory.mktemp("drift-stack"),
        replicas=3,
        sim_args=FAST_SIM,
        replica_args=((), *(("--chat-template", REVERSED_TEMPLATE),) * 2),
    ) as running:
        yield running


def base(stack: Stack) -> str:
    return f"http://127.0.0.1:{stack.extproc_ports['metrics']}"


def text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
    return body.decode()


def status(stack: Stack) -> Status:
    return decode(text(base(stack) + "/status.json").encode())


def drift(stack: Stack, endpoint: str, source: str = "responses") -> DriftStatus | None:
    return next((d for d in status(stack).drift if d.endpoint == endpoint and d.source == source), None)


def address(stack: Stack, endpoint: str) -> str:
    return next(str(e["address"]) for e in stack.engines if e["id"] == endpoint)


async def ask(client: httpx.AsyncClient, stack: Stack, endpoint: str, i: int, stream: bool = False) -> None:
    resp = await client.post(
        "/v1/chat/completions",
        headers={"test-epp-endpoint-selection": address(stack, endpoint)},
        json={
            "model": MODEL,
            "max_tokens": 2,
            "stream": stream,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Q{i}?"}],
        },
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream" if stream else "application/json")
    assert resp.headers["x-kvgate-endpoint"] == address(stack, endpoint)


async def observed(stack: Stack, endpoint: str, n: int, source: str = "responses") -> DriftStatus:
    """The endpoint's drift once the ext_proc has compared ``n`` requests to it (the first predicts
    nothing)."""
    seen: list[DriftStatus | None] = [None]

    def heard() -> bool:  # (the engine counts a request's queries a scrape after it was routed, or two)
        seen[0] = drift(stack, endpoint, source)
        return seen[0] is not None and seen[0].samples >= n - 1 and seen[0].error is not None

    await until(heard, 30)
    assert seen[0] is not None
    return seen[0]


async def settled(stack: Stack, endpoint: str, n: int, floor: float = 0.8) -> DriftStatus:
    """The endpoint's ``counters`` drift once the ext_proc has compared ``n`` requests to it and its
    ratio has reached ``floor``, untripped at every look (it fails the test otherwise).

    The engine's counters trail the routing: the reading that first holds all ``n`` routed prompts may
    hold only part of the engine's counts of them (an agent's reading is taken before the gateway hears
    it, and the engine counts a request when it admits it). Such a reading compares the rate of every
    routed prompt with the rate of the engine's first few, the cold first request (no hit) weighing far
    more among few: a correct engine showed a ratio of 0.7956 there on CI, its 4th counted request of
    16. The ratio settles once a reading holds them all (0.99 here)."""
    seen = [await observed(stack, endpoint, n, source="counters")]

    def converged() -> bool:
        view = drift(stack, endpoint, "counters")
        assert view is not None and not view.tripped, view
        seen[0] = view
        return view.ratio is not None and view.ratio >= floor

    await until(converged, 30)
    return seen[0]


@pytest.fixture(scope="module")
def mismatched(stack: Stack) -> tuple[DriftStatus, DriftStatus]:
    """``sim-1``'s drift after ``MIN_SAMPLES`` requests, then after one more."""

    async def run() -> tuple[DriftStatus, DriftStatus]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            for i in range(MIN_SAMPLES):
                await ask(client, stack, "sim-1", i)
            before = await observed(stack, "sim-1", MIN_SAMPLES)
            await ask(client, stack, "sim-1", MIN_SAMPLES)
            return before, await observed(stack, "sim-1", MIN_SAMPLES + 1)

    return asyncio.run(run())


def test_a_mismatched_template_trips_the_alarm_at_min_samples_plus_one(
    mismatched: tuple[DriftStatus, DriftStatus],
) -> None:
    before, after = mismatched
    assert before.samples == MIN_SAMPLES - 1 and not before.tripped  # the cold first predicts nothing
    assert before.ratio == 0.0 and before.error == 1.0
    assert after.samples == MIN_SAMPLES and after.tripped and after.model == MODEL


async def test_a_correct_endpoint_never_trips(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        for i in range(8):
            await ask(client, stack, "sim-0", 100 + i)
        for batch in range(4):  # 4 at a time: predictions made while an earlier prefill still runs
            await asyncio.gather(*(ask(client, stack, "sim-0", 200 + 4 * batch + j) for j in range(4)))
        view = await observed(stack, "sim-0", 24)
    assert not view.tripped and view.samples >= 2 * MIN_SAMPLES
    assert view.ratio is not None and view.ratio >= 0.9 and view.error is not None and view.error <= 0.1


async def test_metrics_and_kvgate_status_name_the_model_and_endpoint(
    stack: Stack, mismatched: tuple[DriftStatus, DriftStatus], capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = await asyncio.to_thread(text, base(stack) + "/metrics")
    assert f'kvgate_drift_tripped{{endpoint="sim-1",model="{MODEL}",source="responses"}} 1.0' in metrics
    assert f'kvgate_drift_error{{endpoint="sim-1",model="{MODEL}",source="responses"}} 1.0' in metrics
    assert await asyncio.to_thread(status_main, ["--url", base(stack)]) == 0
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("WARNING: drift")]
    assert warnings and all(f"model {MODEL} at endpoint sim-" in w for w in warnings)
    assert any("endpoint sim-1" in w and "from its responses" in w for w in warnings)
    assert await asyncio.to_thread(status_main, ["--url", base(stack), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["drift"] and "endpoint sim-1" in captured.err


async def test_a_large_json_answer_passes_untouched_and_is_not_compared(stack: Stack) -> None:
    """Past 1 MB the filter is skipped (it would buffer the body, and one past the listener's 4 MiB buffer
    failed with 500): a 5 MB ``top_logprobs`` answer reaches the client whole, and adds no sample."""
    before = drift(stack, "sim-0")
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
        resp = await client.post(
            "/v1/chat/completions",
            headers={"test-epp-endpoint-selection": address(stack, "sim-0")},
            json={
                "model": MODEL,
                "max_tokens": 3000,
                "logprobs": True,
                "top_logprobs": 20,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Long?"}],
            },
        )
    assert resp.status_code == 200 and len(resp.content) > 4 * 1024 * 1024
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        await ask(client, stack, "sim-0", 999)  # a small one after it: its completion is heard
    after = await observed(stack, "sim-0", (before.samples if before else 0) + 2)
    assert after.observed == (before.observed if before else 0) + 1


async def streams_trip_the_counters_alarm(stack: Stack, endpoint: str) -> None:
    """``MIN_SAMPLES`` streams to the mis-templated ``endpoint`` leave its ``counters`` alarm untripped
    (the first predicts nothing), one more trips it; no ``responses`` drift (no stream carries a count)."""
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        for i in range(MIN_SAMPLES):
            await ask(client, stack, endpoint, i, stream=True)
        before = await observed(stack, endpoint, MIN_SAMPLES, source="counters")
        assert before.samples == MIN_SAMPLES - 1 and not before.tripped and before.error == 1.0
        await ask(client, stack, endpoint, MIN_SAMPLES, stream=True)
        after = await observed(stack, endpoint, MIN_SAMPLES + 1, source="counters")
    assert after.tripped and after.model == MODEL
    assert drift(stack, endpoint) is None  # streams: no answer carried a count


async def test_streams_trip_the_alarm_from_the_engine_counters(stack: Stack) -> None:
    await streams_trip_the_counters_alarm(stack, "sim-2")


async def test_the_correct_endpoint_counters_never_trip(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        for i in range(MIN_SAMPLES + 4):
            await ask(client, stack, "sim-0", 500 + i, stream=True)
    view = await settled(stack, "sim-0", 2 * MIN_SAMPLES)
    assert not view.tripped and view.ratio is not None and view.ratio >= 0.8
