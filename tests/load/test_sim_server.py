"""The simulator on the wire: real aiohttp servers on 127.0.0.1:0 driven by the openai SDK and raw HTTP."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from certs.store import LeafFiles, dev_bundle
from load.sim.engine import EngineConfig
from load.sim.server import REPLICA_HEADER, SimConfig, SimFleet, server_tls
from load.sim.timing import TimingModel

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-chat"
CHATML = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "the quick brown fox jumps over lazy dog you are helpful assistant answer question about cache "
    "block prefix token engine replica gateway route request stream model system user tool weather city"
)
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are a helpful assistant. " * 8},
    {"role": "user", "content": "What is the weather in the city?"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level BPE tokenizer with ChatML special tokens, saved the Hugging Face way."""
    path = tmp_path_factory.mktemp("tiny-model")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([WORDS] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHATML,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def config(model_dir: Path) -> SimConfig:
    return SimConfig(
        MODEL, model_dir, timing=TimingModel(time_scale=0.01), engine=EngineConfig(max_model_len=512)
    )


@pytest.fixture
async def fleet(config: SimConfig) -> AsyncIterator[SimFleet]:
    async with SimFleet(config, 2) as fleet:
        yield fleet


@pytest.fixture
async def clients(fleet: SimFleet) -> AsyncIterator[list[openai.AsyncOpenAI]]:
    """An openai client per replica."""
    apis = [
        openai.AsyncOpenAI(base_url=f"http://{a}/v1", api_key="none", max_retries=0) for a in fleet.addresses
    ]
    yield apis
    for api in apis:
        await api.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def hf_ids(result: Any) -> list[int]:
    """transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4 a list."""
    ids = result["input_ids"] if isinstance(result, Mapping) or hasattr(result, "keys") else result
    return list(ids)


async def test_fleet_replicas_are_independent(fleet: SimFleet) -> None:
    assert [r.id for r in fleet.replicas] == ["sim-0", "sim-1"]
    assert len(set(fleet.addresses)) == 2
    assert fleet.describe()[1] == {"id": "sim-1", "address": fleet.addresses[1], "model": MODEL}
    assert fleet.replicas[0].tokenizer is fleet.replicas[1].tokenizer
    assert fleet.replicas[0].engine is not fleet.replicas[1].engine


async def test_chat_repeated_prompt_reports_cached_tokens(
    fleet: SimFleet, clients: list[openai.AsyncOpenAI]
) -> None:
    api = clients[0]
    first = await api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    second = await api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    assert first.object == "chat.completion"
    assert first.choices[0].finish_reason == "length"
    assert first.choices[0].message.role == "assistant"
    assert first.usage is not None and second.usage is not None
    assert first.usage.completion_tokens == 5
    assert first.usage.total_tokens == first.usage.prompt_tokens + 5
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens - 1) // 16 * 16 > 0
    assert second.choices[0].message.content == first.choices[0].message.content  # deterministic output
    other = await clients[1].chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    assert other.usage is not None and other.usage.prompt_tokens_details is not None
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # another replica, another cache


async def test_sync_client_in_a_thread(fleet: SimFleet) -> None:
    def call() -> Any:
        with openai.OpenAI(base_url=f"http://{fleet.addresses[0]}/v1", api_key="none", max_retries=0) as api:
            return api.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=3)

    done = await asyncio.to_thread(call)
    assert done.object == "text_completion"
    assert done.usage.completion_tokens == 3
    assert done.choices[0].text.startswith(" ")


async def test_streaming_chat_with_usage(fleet: SimFleet, clients: list[openai.AsyncOpenAI]) -> None:
    api = clients[0]
    stream = await api.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = await api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=7)
    assert text == whole.choices[0].message.content
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
    assert (whole.usage.prompt_tokens_details.cached_tokens or 0) > 0


async def test_streaming_completion_from_token_ids(
    fleet: SimFleet, clients: list[openai.AsyncOpenAI]
) -> None:
    api = clients[0]
    stream = await api.completions.create(
        model=MODEL,
        prompt=list(range(10, 60)),
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 50
    assert chunks[-2].choices[0].finish_reason == "length"


async def test_raw_sse_framing_and_replica_header(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    request = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True}
    async with http.post(f"http://{fleet.addresses[1]}/v1/completions", json=request) as resp:
        assert resp.headers[REPLICA_HEADER] == "sim-1"
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert len(events) == 3 + 2


async def test_tokenize_matches_transformers(
    fleet: SimFleet, clients: list[openai.AsyncOpenAI], http: aiohttp.ClientSession, model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    tools: list[Any] = [
        {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    ]
    cases: list[tuple[dict[str, Any], list[int]]] = [
        ({"messages": MESSAGES}, hf_ids(hf.apply_chat_template(MESSAGES, add_generation_prompt=True))),
        (
            {"messages": MESSAGES, "add_generation_prompt": False, "tools": tools},
            hf_ids(hf.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=False)),
        ),
        ({"prompt": "the lazy dog"}, hf("the lazy dog")["input_ids"]),
    ]
    for request, expected in cases:
        async with http.post(
            f"http://{fleet.addresses[0]}/tokenize", json={"model": MODEL, **request}
        ) as resp:
            got = await resp.json()
        assert got == {
            "count": len(expected),
            "max_model_len": 512,
            "tokens": expected,
            "token_strs": None,
        }
    chat = await clients[0].chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert chat.usage is not None and chat.usage.prompt_tokens == len(cases[0][1])


async def test_chat_template_override_and_tokenizer_loaded_once(
    config: SimConfig, model_dir: Path, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    from transformers import AutoTokenizer

    from load.sim.tokenizer import load_tokenizer

    assert load_tokenizer(model_dir) is load_tokenizer(model_dir)
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    expected = hf_ids(
        AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
            MESSAGES, chat_template=template.read_text(), add_generation_prompt=True
        )
    )
    async with SimFleet(replace(config, chat_template=str(template)), 1) as fleet:
        url = f"http://{fleet.addresses[0]}/tokenize"
        async with http.post(url, json={"messages": MESSAGES}) as resp:
            assert (await resp.json())["tokens"] == expected


async def test_metrics_use_vllm_names(
    fleet: SimFleet, clients: list[openai.AsyncOpenAI], http: aiohttp.ClientSession
) -> None:
    await clients[0].completions.create(model=MODEL, prompt="the quick brown fox " * 10, max_tokens=2)
    async with http.get(f"http://{fleet.addresses[0]}/metrics") as resp:
        assert resp.headers[REPLICA_HEADER] == "sim-0"
        text = await resp.text()
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
    ):
        assert samples[name].labels["model_name"] == MODEL, name
    info = samples["vllm:cache_config_info"]
    assert info.value == 1 and info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "28000"
    assert samples["vllm:generation_tokens_total"].value == 2
    assert samples["vllm:time_to_first_token_seconds_count"].value == 1
    assert samples["vllm:prefix_cache_queries_total"].value == samples["vllm:prompt_tokens_total"].value > 0
    assert samples["vllm:num_requests_running"].value == 0


async def test_models_and_health(
    fleet: SimFleet, clients: list[openai.AsyncOpenAI], http: aiohttp.ClientSession
) -> None:
    models = await clients[0].models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra is not None and models.data[0].model_extra["max_model_len"] == 512
    async with http.get(f"http://{fleet.addresses[0]}/health") as resp:
        assert resp.status == 200 and await resp.read() == b""
        assert resp.headers[REPLICA_HEADER] == "sim-0"


async def test_unknown_model_is_an_openai_404(fleet: SimFleet, clients: list[openai.AsyncOpenAI]) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        await clients[0].chat.completions.create(model="nope", messages=MESSAGES, max_tokens=1)
    assert err.value.response.headers[REPLICA_HEADER] == "sim-0"
    assert "nope" in err.value.message


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


BAD, SCHEMA, MISSING = "BadRequestError", "Bad Request", "NotFoundError"


@pytest.mark.parametrize(
    ("path", "raw", "status", "param", "kind"),
    [  # vLLM's three error styles (load/sim/errors.py): schema failures, its own checks, 404s
        (CHAT, b"{not json", 400, "body.1", SCHEMA),
        (CHAT, b"[1, 2]", 400, "body", SCHEMA),
        (CHAT, body(model=MODEL), 400, "body.messages", SCHEMA),
        (CHAT, body(messages=[{"content": "no role"}]), 400, "body.messages.0.role", SCHEMA),
        (CHAT, body(messages=MESSAGES, max_tokens="nine"), 400, "body.max_tokens", SCHEMA),
        (CHAT, body(messages=MESSAGES, stream=2), 400, "body.stream", SCHEMA),
        (CHAT, body(messages=MESSAGES, max_tokens=0), 400, "max_tokens", BAD),
        (CHAT, body(messages=MESSAGES, max_tokens=600), 400, "max_tokens", BAD),  # > max_model_len 512
        (CHAT, body(messages=MESSAGES, n=0), 400, None, BAD),
        (COMPLETIONS, body(prompt="the " * 600), 400, "input_tokens", BAD),  # prompt alone > max_model_len
        (COMPLETIONS, body(prompt=[1, 10**6]), 400, None, BAD),  # out of vocabulary
        (COMPLETIONS, body(prompt="x", suffix="y"), 400, None, BAD),
        (COMPLETIONS, body(prompt="x", stream_options={"include_usage": True}), 400, "stream_options", BAD),
        (CHAT, body(messages=MESSAGES, priority=3), 400, None, BAD),  # fcfs: vLLM refuses a priority
        (CHAT, body(messages=MESSAGES, priority="high"), 400, "body.priority", SCHEMA),
        (COMPLETIONS, body(model="other", prompt="x"), 404, "model", MISSING),
        ("/v1/nothing", b"{}", 404, None, MISSING),
    ],
)
async def test_bad_requests_get_openai_error_json(
    fleet: SimFleet,
    http: aiohttp.ClientSession,
    path: str,
    raw: bytes,
    status: int,
    param: str | None,
    kind: str,
) -> None:
    async with http.post(f"http://{fleet.addresses[0]}{path}", data=raw) as resp:
        assert resp.status == status
        assert resp.headers[REPLICA_HEADER] == "sim-0"
        err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["param"] == param
    assert err["type"] == kind


async def test_client_disconnect_cancels_and_frees_blocks(
    config: SimConfig, http: aiohttp.ClientSession
) -> None:
    slow = replace(config, timing=TimingModel(time_scale=1.0))
    async with SimFleet(slow, 1) as fleet:
        engine = fleet.replicas[0].engine
        request = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 400, "stream": True}
        async with http.post(f"http://{fleet.addresses[0]}/v1/completions", json=request) as resp:
            await resp.content.readuntil(b"\n\n")
            assert engine.num_running == 1 and engine.kv_usage > 0
        for _ in range(200):
            if engine.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.num_running == 0 and engine.kv_usage == 0


def test_main_in_a_subprocess_writes_ready_file_and_stops_on_sigterm(model_dir: Path, tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    cmd = [sys.executable, "-m", "load.sim.server", "--model", MODEL, "--model-dir", str(model_dir)]
    cmd += ["--replicas", "2", "--replica-prefix", "eng", "--ready-file", str(ready), "--time-scale", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "no ready file"
            time.sleep(0.05)
        records = json.loads(ready.read_text())
        assert [r["id"] for r in records] == ["eng-0", "eng-1"]
        assert all(r["model"] == MODEL and r["address"].startswith("127.0.0.1:") for r in records)
        request = urllib.request.Request(
            f"http://{records[1]['address']}/v1/completions",
            data=json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.headers[REPLICA_HEADER] == "eng-1"
            assert json.load(resp)["usage"]["completion_tokens"] == 2
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 0, stderr
    assert json.loads(stdout.splitlines()[0]) == records


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LeafFiles]:
    """Dev-CA leaves of every role that may or may not call an engine, and an API client from its own CA."""
    now = dt.datetime.now(dt.UTC)
    roles = ["engine", "envoy-edge", "extproc", "agent-node-a", "kvcached", "operator-ops", "client-x"]
    bundle = dev_bundle(tmp_path_factory.mktemp("pki"), roles, now)
    bundle["foreign-client"] = dev_bundle(tmp_path_factory.mktemp("clients"), ["client-x"], now)["client-x"]
    return bundle


@pytest.fixture
async def tls_fleet(config: SimConfig, pki: dict[str, LeafFiles]) -> AsyncIterator[SimFleet]:
    engine = pki["engine"]
    async with SimFleet(config, 1, ssl_context=server_tls(engine.cert, engine.key, engine.ca)) as fleet:
        yield fleet


async def tls_get(fleet: SimFleet, pki: dict[str, LeafFiles], name: str, path: str) -> tuple[int, Any]:
    """GET ``path`` presenting ``pki[name]``'s certificate; the status and the parsed body (or text)."""
    ctx = ssl.create_default_context(cafile=str(pki["engine"].ca))
    ctx.load_cert_chain(pki[name].cert, pki[name].key)
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"https://{fleet.addresses[0]}{path}", ssl=ctx) as resp,
    ):
        text = await resp.text()
        return resp.status, json.loads(text) if resp.content_type == "application/json" else text


@pytest.mark.parametrize("name", ["envoy-edge", "extproc", "agent-node-a"])
async def test_tls_engine_callers_are_served(
    tls_fleet: SimFleet, pki: dict[str, LeafFiles], name: str
) -> None:
    status, models = await tls_get(tls_fleet, pki, name, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL]
    status, metrics = await tls_get(tls_fleet, pki, name, "/metrics")
    assert status == 200 and "vllm:num_requests_running" in metrics


@pytest.mark.parametrize("name", ["kvcached", "operator-ops", "client-x"])
async def test_tls_other_roles_of_the_same_ca_get_an_openai_403(
    tls_fleet: SimFleet, pki: dict[str, LeafFiles], name: str
) -> None:
    """Issue 26.1: a certificate that chains to the CA but names a role that may not call an engine."""
    for path in ("/v1/models", "/metrics", "/health"):
        status, answer = await tls_get(tls_fleet, pki, name, path)
        assert status == 403, path
        assert answer["error"]["code"] == 403 and answer["error"]["type"] == "ForbiddenError"
        assert set(answer["error"]) == {"message", "type", "param", "code"}
    ctx = ssl.create_default_context(cafile=str(pki["engine"].ca))
    ctx.load_cert_chain(pki[name].cert, pki[name].key)
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"https://{tls_fleet.addresses[0]}/v1/completions",
            data=body(model=MODEL, prompt="the quick brown fox", max_tokens=2),
            ssl=ctx,
        ) as resp,
    ):
        assert resp.status == 403 and (await resp.json())["error"]["code"] == 403
    assert tls_fleet.replicas[0].engine.stats.prompt_tokens == 0  # nothing reached the engine


async def test_tls_client_certificate_from_another_ca_fails_the_handshake(
    tls_fleet: SimFleet, pki: dict[str, LeafFiles]
) -> None:
    with pytest.raises(aiohttp.ClientError):
        await tls_get(tls_fleet, pki, "foreign-client", "/v1/models")


async def test_priority_scheduling_accepts_the_priority_field_and_counts_preemptions(
    model_dir: Path, http: aiohttp.ClientSession
) -> None:
    engine = EngineConfig(max_model_len=512, scheduling_policy="priority", priority_preemption=True)
    config = SimConfig(MODEL, model_dir, timing=TimingModel(time_scale=0.01), engine=engine)
    async with SimFleet(config, 1) as fleet:
        url = f"http://{fleet.addresses[0]}"
        async with http.post(f"{url}{CHAT}", data=body(messages=MESSAGES, priority=-5, max_tokens=3)) as resp:
            assert resp.status == 200, await resp.text()
        async with http.get(f"{url}/metrics") as resp:
            assert "vllm:num_preemptions" in await resp.text()


async def test_an_empty_completion_prompt_is_a_400(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    """An empty token list in a batch (or a text that tokenizes to nothing) is vLLM's input processor's
    400 "The decoder prompt cannot be empty", not a 500 from the engine."""
    url = f"http://{fleet.addresses[0]}/v1/completions"
    for prompt in ([[]], [[5, 6], []]):
        async with http.post(url, json={"model": MODEL, "prompt": prompt, "max_tokens": 2}) as resp:
            assert resp.status == 400, await resp.text()
            error = (await resp.json())["error"]
        assert error["message"] == "The decoder prompt cannot be empty"
        assert error["type"] == "BadRequestError" and error["param"] is None and error["code"] == 400
