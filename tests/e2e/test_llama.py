"""End to end with real engines: the OpenAI SDK -> real Envoy -> ext_proc -> two ``llama-server`` replicas
(SmolLM2-135M on the CPU), each supervised by a node agent that registers it in a local etcd.

llama.cpp publishes no KV events, so the gateway routes these endpoints on its approximate index (learned
from its own decisions). llama-server sends no replica header either: which replica served a request is
read from the engines' own Prometheus counters (tokens generated), sampled before and after each request
(requests are sent one at a time). The cache hit is the engine's word: ``timings.cache_n`` and
``usage.prompt_tokens_details.cached_tokens`` of the repeat.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvgate.dev.procs import http_get
from kvgate.dev.up import Stack, StackOptions

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
#: ~290 prompt tokens with the chat template: a cold prefill takes ~2 s on one thread (~170 tok/s).
BODY = " ".join(f"Sentence {i}: the gateway keeps prompts near the cache that holds them." for i in range(18))
#: Counters that move on the replica that served a request (prompt tokens it processed, tokens it made).
SERVED_COUNTERS = ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(
        port=0,
        agents=2,
        agent_engine="llama_cpp",
        # Two slots per replica (llama.cpp keeps each slot's prompt cached), one CPU thread each.
        agent_engine_options={"parallel": 2, "context": 2048, "threads": 1},
        workdir=tmp_path_factory.mktemp("llama"),
    )
    with Stack(options) as running:
        yield running


def counters(stack: Stack) -> dict[str, float]:
    """Per engine id: the sum of :data:`SERVED_COUNTERS` from its ``/metrics``."""
    totals: dict[str, float] = {}
    for engine in stack.engines:
        got = http_get(f"http://{engine['address']}/metrics", timeout_s=5.0)
        assert got is not None and got[0] == 200, engine
        lines = got[1].decode().splitlines()
        totals[engine["id"]] = sum(
            float(ln.split()[-1]) for ln in lines if ln.split(" ", 1)[0] in SERVED_COUNTERS
        )
    return totals


def served_by(before: dict[str, float], after: dict[str, float]) -> str:
    moved = [engine for engine in before if after[engine] != before[engine]]
    assert len(moved) == 1, (before, after)
    return moved[0]


def chat(stack: Stack, content: str) -> tuple[str, int, int, int]:
    """(engine id that served it, prompt tokens, cached tokens as usage reports them, ``timings.cache_n``)."""
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    before = counters(stack)
    done = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=2, temperature=0
    )
    engine = served_by(before, counters(stack))
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    timings: dict[str, Any] = (done.model_extra or {})["timings"]
    cached = done.usage.prompt_tokens_details.cached_tokens or 0
    return engine, done.usage.prompt_tokens, cached, int(timings["cache_n"])


def test_agents_registered_llama_servers(llama: Stack) -> None:
    assert sorted(e["engine"] for e in llama.engines) == ["llama_cpp", "llama_cpp"]
    assert len({e["address"] for e in llama.engines}) == 2
    models = openai.OpenAI(base_url=f"{llama.url}/v1", api_key="unused", max_retries=0).models.list()
    assert [m.id for m in models] == [MODEL]


def test_repeat_goes_back_to_the_replica_that_cached_it(llama: Stack) -> None:
    prompts = [f"Topic {name}. {BODY} Summarise topic {name}." for name in ("alpha", "omega")]
    first = [chat(llama, p) for p in prompts]
    repeat = [chat(llama, p) for p in prompts]
    for (engine0, tokens0, _, cache0), (engine1, tokens1, cached1, cache1) in zip(first, repeat, strict=True):
        assert tokens0 == tokens1 >= 250
        assert cache0 < tokens0 // 2, first  # the first send was (mostly) a cold prefill
        assert engine1 == engine0, (first, repeat)  # routed back to the replica that holds it
        assert cache1 >= tokens1 - 4 and cached1 >= tokens1 - 4, repeat  # and the engine says: a hit


def test_unknown_model_is_a_404_that_reaches_no_engine(llama: Stack) -> None:
    before = counters(llama)
    resp = httpx.post(
        f"{llama.url}/v1/chat/completions",
        json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=30,
    )
    assert resp.status_code == 404, resp.text
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and "no-such-model" in error["message"]
    assert counters(llama) == before
