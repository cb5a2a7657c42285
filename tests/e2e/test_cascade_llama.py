"""End to end, a cascade over real engines: the OpenAI SDK -> real Envoy -> ext_proc -> two ``llama-server``
processes (SmolLM2-135M on the CPU). Only one small model runs here, so the same GGUF serves both steps
under two names (``--alias smol-small``, ``--alias smol-large``); the gate reads the real token logprobs
llama.cpp returns for ``logprobs: true``. Which step answers is set by the threshold of two virtual models:
``lenient`` (mean >= -20 nats: any real answer passes) and ``strict`` (mean >= -1e-6: no real answer of
8 sampled tokens is that sure, so it escalates); ``replayed`` passes on 2 tokens and replays the small step
through Envoy. The engines' own counters say who served.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from engines.gguf import smollm2_gguf_path
from engines.llama_cpp import llama_server_path
from kvgate.dev.etcd import free_port
from kvgate.dev.procs import Child, http_get
from kvgate.dev.up import Stack, StackOptions
from tests.polling import poll

pytestmark = pytest.mark.e2e
STEPS = ["smol-small", "smol-large"]
POLICY = {
    "models": {
        "lenient": {"cascade": {"steps": STEPS, "threshold": -20.0}},
        "strict": {"cascade": {"steps": STEPS, "threshold": -1e-6}},
        "replayed": {
            "cascade": {"steps": STEPS, "threshold": -20.0, "stat": "first_k", "k": 2, "replay": True}
        },
    }
}
STEP = "x-kvgate-cascade-step"
COUNTER = "llamacpp:tokens_predicted_total"


@pytest.fixture(scope="module")
def llama_cascade(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("cascade-llama")
    engines: list[Child] = []
    try:
        urls = []
        for alias in STEPS:
            port = free_port()
            argv = [llama_server_path(), "-m", str(smollm2_gguf_path()), "--host", "127.0.0.1"]
            argv += ["--port", str(port), "--alias", alias, "-np", "1", "-c", "1024", "-t", "1"]
            argv += ["--metrics", "--no-webui"]
            engines.append(Child(alias, argv, work / f"{alias}.log"))
            url = f"http://127.0.0.1:{port}"
            poll(
                lambda u=url: ((got := http_get(f"{u}/health")) is not None and got[0] == 200) or None,
                120,
                alias,
            )
            urls.append(url)
        policy = work / "policy.json"
        policy.write_text(json.dumps(POLICY))
        options = StackOptions(
            port=0,
            model=None,
            engine="llama_cpp",
            endpoints=tuple(urls),
            workdir=work / "stack",
            overlay={"policy": {"file": str(policy)}},
        )
        with Stack(options) as running:
            yield running
    finally:
        for child in engines:
            child.stop()


def predicted(stack: Stack) -> dict[str, float]:
    """Per served model name: tokens its engine predicted so far."""
    out = {}
    for engine in stack.engines:
        got = http_get(f"http://{engine['address']}/metrics", timeout_s=5.0)
        assert got is not None and got[0] == 200
        lines = got[1].decode().splitlines()
        out[stack.served[engine["id"]][0]] = sum(
            float(ln.split()[-1]) for ln in lines if ln.startswith(COUNTER + " ")
        )
    return out


def moved(before: dict[str, float], after: dict[str, float]) -> list[str]:
    return sorted(m for m in before if after[m] != before[m])


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(model: str, **extra: Any) -> dict[str, Any]:
    content = "Name three colours of the rainbow."
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}


def test_the_engines_serve_the_two_step_names(llama_cascade: Stack) -> None:
    assert sorted(m for ms in llama_cascade.served.values() for m in ms) == sorted(STEPS)


def test_a_passing_answer_comes_from_the_small_step_with_real_logprobs(llama_cascade: Stack) -> None:
    before = predicted(llama_cascade)
    raw = client(llama_cascade).chat.completions.with_raw_response.create(**ask("lenient", logprobs=True))
    done = raw.parse()
    assert raw.headers[STEP] == "1" and done.model == "smol-small"
    assert done.choices[0].message.content and done.usage is not None
    assert done.choices[0].logprobs is not None  # asked for: llama.cpp's own numbers
    values = [t.logprob for t in done.choices[0].logprobs.content or []]
    assert values and all(v <= 0 for v in values) and sum(values) / len(values) >= -20
    assert moved(before, predicted(llama_cascade)) == ["smol-small"]


def test_without_logprobs_asked_none_are_returned(llama_cascade: Stack) -> None:
    done = client(llama_cascade).chat.completions.create(**ask("lenient"))
    assert done.model == "smol-small" and done.choices[0].logprobs is None


def test_a_failing_answer_escalates_and_streams_from_the_large_step(llama_cascade: Stack) -> None:
    before = predicted(llama_cascade)
    with client(llama_cascade).chat.completions.with_streaming_response.create(
        **ask("strict", stream=True, max_tokens=12)
    ) as response:
        assert response.headers[STEP] == "2"
        chunks = list(response.parse())
    assert {c.model for c in chunks} == {"smol-large"}
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 3  # token by token from llama-server through Envoy
    assert moved(before, predicted(llama_cascade)) == sorted(STEPS)  # the small step ran, then the large one


def test_a_passing_streamed_answer(llama_cascade: Stack) -> None:
    with client(llama_cascade).chat.completions.with_streaming_response.create(
        **ask("lenient", stream=True, stream_options={"include_usage": True})
    ) as response:
        assert response.headers[STEP] == "1"
        chunks = list(response.parse())
    assert {c.model for c in chunks} == {"smol-small"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.usage.completion_tokens for c in chunks if c.usage is not None] == [8]


def test_a_replayed_step_streams_what_llama_server_samples_for_its_seed(llama_cascade: Stack) -> None:
    """``replay``: the small step, seeded, passes on its first 2 tokens and is cut; the client's request
    goes to it again with the same seed and streams through Envoy. llama-server samples the same tokens for
    the same seed (temperature 1: not greedy), so the client gets the answer the gate judged: the same
    request sent straight to the engine gives the same text."""
    before = predicted(llama_cascade)
    sampled = {"temperature": 1.0, "seed": 1234, "max_tokens": 32}
    with client(llama_cascade).chat.completions.with_streaming_response.create(
        **ask("replayed", stream=True, **sampled)
    ) as response:
        assert response.headers[STEP] == "1"
        chunks = list(response.parse())
    assert {c.model for c in chunks} == {"smol-small"}
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 3  # token by token from llama-server through Envoy
    assert moved(before, predicted(llama_cascade)) == ["smol-small"]  # (a cut task may go uncounted)
    small = next(e["address"] for e in llama_cascade.engines if llama_cascade.served[e["id"]] == [STEPS[0]])
    direct = openai.OpenAI(base_url=f"http://{small}/v1", api_key="unused", max_retries=0, timeout=120)
    again = direct.chat.completions.create(**{**ask(STEPS[0]), **sampled})
    assert again.choices[0].message.content == "".join(pieces)
