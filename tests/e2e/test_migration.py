"""In-flight migration through real Envoy (issue 24 part 2): the serving replica is SIGKILLed mid-stream.

An opted-in model's streams pass through the migration proxy (extproc/migration); when the replica
serving one dies, the stream continues on another replica of the ext_proc's decided list and the
client (the OpenAI SDK, and raw SSE) sees one complete stream: one id, ``max_tokens`` tokens in all,
one ``[DONE]``. A model without migration loses the stream as before. The simulators are slowed
(``--time-scale``) so that a kill lands mid-stream; the kill happens once the client has read some
tokens, and the serving replica is found from the engines' own metrics (polled, never slept on).
"""

from __future__ import annotations

import os
import signal
import ssl
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from kvgate.dev.up import Stack, StackOptions
from load.faults import ejections
from tests.e2e.conftest import FAST_SIM
from tests.e2e.test_flow import metric
from tests.polling import poll

MODEL = "SmolLM2-135M-Instruct"
#: 8x the documented H100 step time: ~50 ms a token, so a 48-token answer streams for over 2 s and the
#: kill (after KILL_AFTER tokens reached the client) lands mid-stream even on a loaded machine.
SLOW_SIM = ("--time-scale", "8")
MAX_TOKENS = 48
#: Tokens the client reads before the serving replica is killed.
KILL_AFTER = 6


def stack_with(tmp: pytest.TempPathFactory, name: str, replicas: int, migration: bool) -> Stack:
    options = StackOptions(
        replicas=replicas,
        port=0,
        sim_args=SLOW_SIM,
        workdir=tmp.mktemp(name),
        overlay={"models": [{"name": MODEL, "gguf": "smollm2", "migration": migration}]},
    )
    return Stack(options)


@pytest.fixture(scope="module")
def migrating(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with stack_with(tmp_path_factory, "migrating", 3, True) as stack:
        yield stack


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with stack_with(tmp_path_factory, "plain", 2, False) as stack:
        yield stack


def kill_serving(stack: Stack) -> str:
    """SIGKILL the live simulator that runs a request now; its id. One client scrapes throughout (a new
    client per scrape costs ~19 ms of CPU, its SSL context, taken from the stack under test)."""

    def busy() -> str | None:
        for sim in stack.sims:
            if not sim.alive():
                continue
            (engine,) = [e for e in stack.engines if e["id"] == sim.name]
            try:
                text = scraper.get(engine["metrics_url"]).text
            except httpx.TransportError:
                continue
            if metric(text, "vllm:num_requests_running") >= 1:
                os.kill(sim.pid, signal.SIGKILL)
                return sim.name
        return None

    with httpx.Client(timeout=2) as scraper:
        return poll(busy, 10, "a replica running the request")


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat_stream(stack: Stack, kill: bool) -> tuple[set[str], str, str | None, Any, str | None]:
    """One streamed chat (``kill``: its replica is killed after KILL_AFTER tokens): the ids seen, the
    text, the finish reason, the usage and the killed replica."""
    stream = client(stack).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a long story about a migrating bird."}],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    ids, text, finish, usage, killed, pieces = set(), "", None, None, None, 0
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                text += choice.delta.content
                pieces += 1
            if choice.finish_reason:
                finish = choice.finish_reason
        if kill and killed is None and pieces >= KILL_AFTER:
            killed = kill_serving(stack)
    return ids, text, finish, usage, killed


def proxy_metric(stack: Stack, outcome: str) -> float:
    port = stack.migration_ports["metrics"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return metric(text, "kvgate_migrations_total", outcome=outcome)


def test_a_killed_replica_stream_goes_on_elsewhere(migrating: Stack) -> None:
    ids, text, finish, usage, _ = chat_stream(migrating, kill=False)  # the shape of a run without failure
    assert len(ids) == 1 and finish == "length" and usage.completion_tokens == MAX_TOKENS
    prompt_tokens = usage.prompt_tokens

    ids, text, finish, usage, killed = chat_stream(migrating, kill=True)
    assert killed is not None
    assert len(ids) == 1, ids  # one id across the seam
    assert finish == "length"
    assert usage.completion_tokens == MAX_TOKENS and usage.prompt_tokens == prompt_tokens
    assert usage.total_tokens == prompt_tokens + MAX_TOKENS
    assert text.strip()
    assert proxy_metric(migrating, "resumed") == 1


def test_a_completion_stream_is_one_well_formed_sse_stream(migrating: Stack) -> None:
    """Raw SSE: every event parses, one id and ``created``, ``[DONE]`` exactly once and last."""
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events: list[Any] = []
    killed = None
    with httpx.stream("POST", f"{migrating.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[6:]
            events.append("[DONE]" if data == "[DONE]" else orjson.loads(data))
            texts = sum(1 for e in events if isinstance(e, dict) for c in e["choices"] if c.get("text"))
            if killed is None and texts >= KILL_AFTER:
                killed = kill_serving(migrating)
    assert killed is not None
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert "error" not in str(chunks[-1])
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    usage = [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")]
    assert usage == sorted(usage) and usage[-1] == MAX_TOKENS  # continuous usage counts across the seam
    assert chunks[-1]["choices"] == [] and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert proxy_metric(migrating, "resumed") == 2


def test_without_migration_the_stream_is_lost_as_before(plain: Stack) -> None:
    assert plain.migration is None
    try:
        _, _, finish, usage, killed = chat_stream(plain, kill=True)
    except (openai.APIError, httpx.HTTPError):
        return  # the stream broke under the client: lost, as before
    assert killed is not None
    assert finish is None or usage is None, "the stream survived its engine without migration"


def ejected_everywhere(stack: Stack) -> bool | None:
    """Whether every ext_proc has ejected some engine (any kind) at least once."""
    per_extproc = [ejections(stack, str(e["id"])) for e in stack.engines]
    return all(sum(counts) >= 1 for counts in zip(*per_extproc, strict=True)) or None


def test_with_secure_the_proxy_reaches_engines_and_reports_to_the_ext_procs_over_mtls(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``kvgate up --secure``: engines and ext_procs take mTLS only; the proxy serves an opted-in model's
    streams from them (under Envoy's identity) and its failed tries still eject the engine at every
    ext_proc."""
    options = StackOptions(
        replicas=2,
        port=0,
        sim_args=FAST_SIM,
        workdir=tmp_path_factory.mktemp("secure-migrating"),
        overlay={"models": [{"name": MODEL, "gguf": "smollm2", "migration": True}]},
        secure=True,
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    with Stack(options) as stack:
        ca = str(stack.certs["envoy-edge"].ca)
        caller = stack.certs["extproc"]  # an engine caller's identity, for the simulator's control routes
        control = ssl.create_default_context(cafile=ca)
        control.load_cert_chain(caller.cert, caller.key)
        with httpx.Client(verify=ssl.create_default_context(cafile=ca), timeout=30) as http:
            done = http.post(f"{stack.url}/v1/chat/completions", json=body)
            assert done.status_code == 200 and done.text.rstrip().endswith("data: [DONE]"), done.text
            assert not ejected_everywhere(stack)
            with httpx.Client(verify=control, timeout=10) as sims:
                for engine in stack.engines:  # every engine resets its next stream after 2 events
                    url = f"https://{engine['address']}/_sim/reset_next"
                    assert sims.post(url, params={"n": 1, "after": 2}).status_code == 200
            http.post(f"{stack.url}/v1/chat/completions", json=body)  # its tries reset: reported
        poll(lambda: ejected_everywhere(stack), 20, "an ejection at every ext_proc")
