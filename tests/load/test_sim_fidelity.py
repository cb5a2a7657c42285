"""The simulator answers every request shape vLLM 0.33 accepts and refuses what it refuses, with its
errors: one test per row of the table in load/sim/README.md, over HTTP with the openai SDK where it can
express the request."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from load.sim.engine import Engine, EngineConfig
from load.sim.server import SimConfig, SimFleet, main
from load.sim.serving import ToolParsing
from load.sim.timing import TimingModel
from tests.load.test_sim_server import MESSAGES, MODEL, config, model_dir

__all__ = ["config", "model_dir"]  # the fixtures, shared with test_sim_server

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CLOCK: Any = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}


@pytest.fixture
async def fleet(config: SimConfig) -> AsyncIterator[SimFleet]:
    async with SimFleet(config, 1) as fleet:
        yield fleet


@pytest.fixture
async def tool_fleet(config: SimConfig) -> AsyncIterator[SimFleet]:
    """A replica started as ``--enable-auto-tool-choice --tool-call-parser hermes``."""
    async with SimFleet(replace(config, tool_parsing=ToolParsing(True, "hermes")), 1) as fleet:
        yield fleet


def client(fleet: SimFleet) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://{fleet.addresses[0]}/v1", api_key="none", max_retries=0)


@pytest.fixture
async def api(fleet: SimFleet) -> AsyncIterator[openai.AsyncOpenAI]:
    async with client(fleet) as api:
        yield api


@pytest.fixture
async def tool_api(tool_fleet: SimFleet) -> AsyncIterator[openai.AsyncOpenAI]:
    async with client(tool_fleet) as api:
        yield api


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http: aiohttp.ClientSession, fleet: SimFleet, path: str, body: Any) -> tuple[int, Any]:
    async with http.post(f"http://{fleet.addresses[0]}{path}", json=body) as resp:
        return resp.status, await resp.json()


def error(status: int, message: str, param: str | None = None, kind: str = "BadRequestError") -> Any:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# -- n, best_of, seed ------------------------------------------------------------------------------


async def test_n_choices_are_indexed_and_all_counted(api: openai.AsyncOpenAI) -> None:
    done = await api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, n=3)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert len({c.message.content for c in done.choices}) == 3  # each choice samples its own words
    assert done.usage is not None and done.usage.completion_tokens == 15
    again = await api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, n=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in done.choices]


async def test_n_streams_chunks_per_choice_index(api: openai.AsyncOpenAI) -> None:
    stream = await api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, n=2, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert all(len(c.choices) == 1 for c in chunks[:-1])  # one choice per chunk, as vLLM
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    assert [c.choices[0].index for c in chunks[:2]] == [0, 1]
    texts = {
        i: "".join(c.choices[0].delta.content or "" for c in chunks[:-1] if c.choices[0].index == i)
        for i in (0, 1)
    }
    whole = await api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=2)
    assert texts == {c.index: c.message.content for c in whole.choices}
    finishes = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason]
    assert finishes == ["length", "length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_n_siblings_share_the_prefill_and_decode_each() -> None:
    engine = Engine(EngineConfig(block_size=4, num_blocks=64, max_model_len=256), TimingModel(), b"\0" * 16)  # type: ignore[arg-type]
    engine.add_request("r", list(range(1, 11)), [50, 51], 0.0, siblings=[("r-1", [60, 61])])
    step = engine.schedule(0.0)
    assert step is not None and step.n_prefill_tokens == 10 and engine.num_running == 1
    events = engine.complete(step)
    assert [e.request_id for e in events] == ["r"]
    step = engine.schedule(step.end)  # the sibling takes the 2 cached blocks and computes the rest
    assert step is not None and len(step.decode) == 1 and step.n_prefill_tokens == 2
    events = engine.complete(step)
    assert {e.request_id: e.cached_tokens for e in events} == {"r": 0, "r-1": 8}
    assert engine.stats.generation_tokens == 3


async def test_best_of_is_an_ignored_extra_field(api: openai.AsyncOpenAI) -> None:
    done = await api.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=3, best_of=3)
    assert len(done.choices) == 1 and done.usage is not None and done.usage.completion_tokens == 3


async def test_seed_fixes_the_output(api: openai.AsyncOpenAI) -> None:
    def ask(seed: int) -> Any:
        return api.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=6, seed=seed)

    a, b, c = await ask(1), await ask(1), await ask(2)
    assert a.choices[0].text == b.choices[0].text != c.choices[0].text


async def test_greedy_sampling_refuses_n(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    status, got = await post(
        http, fleet, "/v1/chat/completions", {"messages": MESSAGES, "n": 2, "temperature": 0}
    )
    assert (status, got) == (400, error(400, "n must be 1 when using greedy sampling, got 2."))


# -- logprobs, stop ---------------------------------------------------------------------------------


async def test_chat_logprobs_with_top_alternatives(api: openai.AsyncOpenAI) -> None:
    done = await api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=2
    )
    assert done.choices[0].logprobs is not None
    content = done.choices[0].logprobs.content or []
    assert "".join(t.token for t in content) == done.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in content)
    assert all(t.logprob < 0 and t.top_logprobs[1].logprob < t.logprob for t in content)


@pytest.mark.parametrize(
    ("marker", "low", "high"), [("[easy]", -0.1, -0.01), ("[hard]", -3.0, -1.0), ("", -0.55, -0.05)]
)
async def test_the_prompt_sets_the_confidence(
    api: openai.AsyncOpenAI, marker: str, low: float, high: float
) -> None:
    """``[easy]`` / ``[hard]`` in the last user message fix the range of the sampled tokens' logprobs, the
    same for every repeat and streamed or not (what a cascade's logprob gate is tested with)."""
    messages: Any = [{"role": "user", "content": f"{marker} What is the capital of France?"}]
    done = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, logprobs=True)
    assert done.choices[0].logprobs is not None
    values = [t.logprob for t in done.choices[0].logprobs.content or []]
    assert len(values) == 8 and all(low <= v <= high for v in values), values
    again = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, logprobs=True)
    assert again.choices[0].logprobs is not None
    assert [t.logprob for t in again.choices[0].logprobs.content or []] == values
    stream = await api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, logprobs=True, stream=True
    )
    streamed = [
        t.logprob
        async for c in stream
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or []
    ]
    assert streamed == values
    text = await api.completions.create(model=MODEL, prompt=f"{marker} Paris is", max_tokens=4, logprobs=0)
    assert text.choices[0].logprobs is not None
    assert all(low <= v <= high for v in text.choices[0].logprobs.token_logprobs or [])


async def test_completion_logprobs(api: openai.AsyncOpenAI) -> None:
    done = await api.completions.create(model=MODEL, prompt="the lazy dog", max_tokens=3, logprobs=2)
    lp = done.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert "".join(lp.tokens) == done.choices[0].text and len(lp.top_logprobs[0]) == 2
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {"top_logprobs": 2},
            error(
                400,
                "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)",
                "top_logprobs",
            ),
        ),
        (
            {"logprobs": True, "top_logprobs": 21},
            error(
                400,
                "Requested sample logprobs of 21, which is greater than max allowed: 20 (parameter=logprobs, "
                "value=21)",
                "logprobs",
            ),
        ),
    ],
)
async def test_logprobs_limits(
    fleet: SimFleet, http: aiohttp.ClientSession, fields: dict[str, Any], expected: Any
) -> None:
    assert await post(http, fleet, "/v1/chat/completions", {"messages": MESSAGES, **fields}) == (
        400,
        expected,
    )


async def test_stop_string_ends_the_choice(api: openai.AsyncOpenAI) -> None:
    free = await api.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=8)
    text = free.choices[0].text
    word = text.split(" ")[4]  # the fourth word of " w1 w2 w3 ..."
    cut = await api.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=8, stop=[word])
    choice = cut.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra and choice.model_extra["stop_reason"] == word
    assert choice.text == text[: text.index(word)]
    assert cut.usage is not None and cut.usage.completion_tokens < 8


async def test_stop_token_id_ends_the_choice(
    api: openai.AsyncOpenAI, fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    free = await api.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=6, logprobs=0)
    assert free.choices[0].logprobs is not None and free.choices[0].logprobs.tokens is not None
    _, ids = await post(http, fleet, "/tokenize", {"prompt": free.choices[0].logprobs.tokens[2]})
    cut = await api.completions.create(
        model=MODEL, prompt="the quick brown fox", max_tokens=6, extra_body={"stop_token_ids": ids["tokens"]}
    )
    choice = cut.choices[0]
    assert (
        choice.finish_reason == "stop"
        and choice.model_extra
        and choice.model_extra["stop_reason"] in ids["tokens"]
    )
    assert cut.usage is not None and cut.usage.completion_tokens == 3


# -- streaming usage --------------------------------------------------------------------------------


async def test_continuous_usage_stats_on_every_chunk(api: openai.AsyncOpenAI) -> None:
    stream = await api.completions.create(
        model=MODEL,
        prompt="the quick brown fox",
        max_tokens=3,
        stream=True,
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    chunks = [c async for c in stream]
    assert all(c.usage is not None for c in chunks)
    assert [c.usage.completion_tokens for c in chunks if c.usage] == [*range(1, len(chunks)), 3]


# -- response_format --------------------------------------------------------------------------------


async def test_response_format_json_object(api: openai.AsyncOpenAI) -> None:
    done = await api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=64, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(done.choices[0].message.content or ""), dict)
    assert done.choices[0].finish_reason == "stop"


async def test_response_format_json_schema(api: openai.AsyncOpenAI) -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "ok": {"type": "boolean"}},
    }
    done = await api.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    value = json.loads(done.choices[0].message.content or "")
    assert set(value) == {"city", "ok"} and isinstance(value["city"], str) and value["ok"] is True


async def test_response_format_json_schema_needs_its_schema(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    got = await post(
        http,
        fleet,
        "/v1/chat/completions",
        {"messages": MESSAGES, "response_format": {"type": "json_schema"}},
    )
    assert got == (
        400,
        error(
            400,
            "When response_format type is 'json_schema', the 'json_schema' field must be "
            "provided. (parameter=response_format)",
            "response_format",
        ),
    )


# -- tools --------------------------------------------------------------------------------------------


AUTO_REFUSED = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@pytest.mark.parametrize(
    ("tool_choice", "message"),
    [
        (None, AUTO_REFUSED),  # tools without tool_choice default to "auto"
        ("auto", AUTO_REFUSED),
        ("required", 'tool_choice="required" requires --tool-call-parser to be set'),
        (
            {"type": "function", "function": {"name": "weather"}},
            "tool_choice=\"function=ChatCompletionNamedFunction(name='weather') type='function'\" requires "
            "--tool-call-parser to be set",
        ),
    ],
)
async def test_tool_calls_need_the_parser_flags(
    fleet: SimFleet, http: aiohttp.ClientSession, tool_choice: Any, message: str
) -> None:
    request = {
        "messages": MESSAGES,
        "tools": [WEATHER],
        **({"tool_choice": tool_choice} if tool_choice else {}),
    }
    assert await post(http, fleet, "/v1/chat/completions", request) == (400, error(400, message))


async def test_tool_choice_none_renders_tools_and_answers_text(api: openai.AsyncOpenAI) -> None:
    done = await api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, tools=[WEATHER], tool_choice="none"
    )
    plain = await api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert done.choices[0].message.tool_calls is None and done.choices[0].finish_reason == "length"
    assert done.usage is not None and plain.usage is not None
    assert done.usage.prompt_tokens > plain.usage.prompt_tokens  # the template rendered the tools


@pytest.mark.parametrize(
    ("fields", "message", "param"),
    [
        ({"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set.", "tool_choice"),
        (
            {"tools": []},
            "`tools` must not be an empty array. Either provide at least one tool or omit the "
            "field entirely.",
            "tools",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            "tool_choice",
        ),
    ],
)
async def test_tool_usage_checks(
    tool_fleet: SimFleet, http: aiohttp.ClientSession, fields: dict[str, Any], message: str, param: str
) -> None:
    got = await post(http, tool_fleet, "/v1/chat/completions", {"messages": MESSAGES, **fields})
    assert got == (400, error(400, f"{message} (parameter={param})", param))


async def test_auto_tool_choice_calls_a_tool(tool_api: openai.AsyncOpenAI) -> None:
    done = await tool_api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=64, tools=[WEATHER, CLOCK], parallel_tool_calls=False
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("chatcmpl-tool-")
    assert calls[0].function.name == "weather"
    assert set(json.loads(calls[0].function.arguments)) == {"city", "days"}
    answered = [
        *MESSAGES,
        {"role": "assistant", "tool_calls": [calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"},
    ]
    after = await tool_api.chat.completions.create(
        model=MODEL, messages=answered, max_tokens=3, tools=[WEATHER]
    )
    assert after.choices[0].finish_reason == "length" and after.choices[0].message.tool_calls is None


async def test_without_max_tokens_a_tool_call_or_json_answer_runs_to_its_end(
    tool_api: openai.AsyncOpenAI,
) -> None:
    """vLLM's chat limit without max_tokens is the rest of the context, so a call or a JSON answer ends
    with EOS, not cut at the simulator's 16-token default for free text."""
    called = await tool_api.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice="required"
    )
    calls = called.choices[0].message.tool_calls or []
    assert called.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert set(json.loads(calls[0].function.arguments)) == {"city", "days"}  # type: ignore[union-attr]
    assert called.usage is not None and called.usage.completion_tokens > 16
    answer = await tool_api.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}
    )
    assert answer.choices[0].finish_reason == "stop"
    json.loads(answer.choices[0].message.content or "")
    text = await tool_api.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert text.usage is not None and text.usage.completion_tokens == 16  # free text: the default


async def test_required_and_named_tool_choice(tool_api: openai.AsyncOpenAI) -> None:
    required = await tool_api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=64, tools=[WEATHER, CLOCK], tool_choice="required"
    )
    assert required.choices[0].finish_reason == "tool_calls" and required.choices[0].message.content == ""
    named = await tool_api.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=64,
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "clock"}},
    )
    calls = named.choices[0].message.tool_calls or []
    assert named.choices[0].finish_reason == "stop"  # vLLM, as OpenAI, reports a forced named call so
    assert [c.function.name for c in calls] == ["clock"]  # type: ignore[union-attr]


async def test_streamed_tool_call_accumulates_to_the_whole_one(tool_api: openai.AsyncOpenAI) -> None:
    stream = await tool_api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=64, tools=[WEATHER], stream=True
    )
    chunks = [c async for c in stream]
    deltas = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function and deltas[0].function.name == "weather"
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert set(json.loads(arguments)) == {"city", "days"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_flag_needs_a_parser(model_dir: Path) -> None:
    assert main(["--model", MODEL, "--model-dir", str(model_dir), "--enable-auto-tool-choice"]) == 2


# -- lengths ------------------------------------------------------------------------------------------


async def test_max_completion_tokens_wins_over_max_tokens(
    api: openai.AsyncOpenAI, fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    done = await api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=9, max_completion_tokens=2
    )
    assert done.usage is not None and done.usage.completion_tokens == 2
    got = await post(
        http, fleet, "/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 513}
    )
    assert got == (
        400,
        error(
            400,
            "max_completion_tokens=513 cannot be greater than max_model_len=512. Please "
            "request fewer output tokens. (parameter=max_completion_tokens, value=513)",
            "max_completion_tokens",
        ),
    )


async def test_output_beyond_the_context_is_clamped(api: openai.AsyncOpenAI) -> None:
    done = await api.completions.create(
        model=MODEL, prompt=[10 + i % 300 for i in range(500)], max_tokens=100
    )
    assert done.usage is not None and done.usage.completion_tokens == 12  # 512 - 500
    assert done.choices[0].finish_reason == "length"


async def test_over_long_prompt(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    got = await post(http, fleet, "/v1/completions", {"prompt": [10 + i % 300 for i in range(520)]})
    assert got == (
        400,
        error(
            400,
            "This model's maximum context length is 512 tokens. However, your prompt "
            "contains 520 input tokens, which exceeds this limit even without any output "
            "tokens. Please reduce the length of the input prompt. (parameter=input_tokens, "
            "value=520)",
            "input_tokens",
        ),
    )


# -- field handling -------------------------------------------------------------------------------------


async def test_unknown_fields_are_ignored(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    status, got = await post(
        http, fleet, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "frobnicate": {"x": 1}}
    )
    assert status == 200 and got["usage"]["completion_tokens"] == 2


async def test_types_convert_as_pydantic_lax_mode(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    status, got = await post(
        http,
        fleet,
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": "2", "n": 2.0, "stream": 0, "logprobs": "false"},
    )
    assert status == 200 and got["usage"]["completion_tokens"] == 4
    status, got = await post(http, fleet, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": "two"})
    assert (status, got["error"]["type"], got["error"]["param"]) == (400, "Bad Request", "body.max_tokens")
    assert got["error"]["message"] == (
        "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.max_tokens', "
        "'msg': 'Input should be a valid integer, unable to parse string as an integer', 'input': 'two'}"
    )


# -- completions ----------------------------------------------------------------------------------------


async def test_completion_batch_of_prompts(api: openai.AsyncOpenAI) -> None:
    done = await api.completions.create(
        model=MODEL, prompt=["the lazy dog", "a quick fox"], max_tokens=2, n=2
    )
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    alone = await api.completions.create(model=MODEL, prompt="a quick fox", max_tokens=2)
    assert done.choices[2].text == alone.choices[0].text
    assert done.usage is not None and alone.usage is not None and done.usage.completion_tokens == 8


async def test_completion_echo(api: openai.AsyncOpenAI) -> None:
    done = await api.completions.create(model=MODEL, prompt="the lazy dog", max_tokens=2, echo=True)
    plain = await api.completions.create(model=MODEL, prompt="the lazy dog", max_tokens=2)
    assert done.choices[0].text == "the lazy dog" + plain.choices[0].text


async def test_chat_echo_prepends_the_last_message_of_the_same_role(api: openai.AsyncOpenAI) -> None:
    messages: Any = [*MESSAGES, {"role": "assistant", "content": "It is"}]
    done = await api.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=2,
        extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert (done.choices[0].message.content or "").startswith("It is ")


async def test_suffix_is_refused(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    got = await post(http, fleet, "/v1/completions", {"prompt": "def f(", "suffix": "return x"})
    assert got == (400, error(400, "suffix is not currently supported"))


# -- other routes ---------------------------------------------------------------------------------------


async def test_unknown_routes_are_404(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    status, got = await post(http, fleet, "/v1/audio/speech", {"input": "x"})
    assert status == 404 and got["error"]["code"] == 404


async def test_embeddings_in_openai_shape(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    status, got = await post(http, fleet, "/v1/embeddings", {"input": ["the lazy dog", "a quick fox"]})
    assert status == 200 and got["object"] == "list" and got["usage"]["prompt_tokens"] > 0
    first, second = got["data"]
    assert first["object"] == "embedding" and (first["index"], second["index"]) == (0, 1)
    assert len(first["embedding"]) == 64 and abs(sum(v * v for v in first["embedding"]) - 1) < 1e-9
    again = await post(http, fleet, "/v1/embeddings", {"input": "the lazy dog", "dimensions": 8})
    assert again[0] == 200 and len(again[1]["data"][0]["embedding"]) == 8
    b64 = await post(http, fleet, "/v1/embeddings", {"input": [1, 2, 3], "encoding_format": "base64"})
    assert b64[0] == 200 and len(base64.b64decode(b64[1]["data"][0]["embedding"])) == 64 * 4
    for bad in (
        {"input": ""},
        {"input": []},
        {"input": "x", "dimensions": 0},
        {"input": "x", "encoding_format": "x"},
    ):
        assert (await post(http, fleet, "/v1/embeddings", bad))[0] == 400
    assert (await post(http, fleet, "/v1/embeddings", {"model": "nope", "input": "x"}))[0] == 404


async def test_responses_score_and_rerank(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    body = {
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
        "instructions": "Be brief.",
    }
    status, got = await post(http, fleet, "/v1/responses", {**body, "max_output_tokens": 5})
    assert status == 200 and got["object"] == "response" and got["status"] == "completed"
    (message,) = got["output"]
    assert message["type"] == "message" and message["content"][0]["type"] == "output_text"
    assert got["usage"]["output_tokens"] == 5 and got["usage"]["input_tokens"] > 0
    streamed = {"input": "Hi", "stream": True, "max_output_tokens": 3}
    async with http.post(f"http://{fleet.addresses[0]}/v1/responses", json=streamed) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        blocks = [b.split("\n") for b in (await resp.text()).split("\n\n") if b]
    kinds = [kind.removeprefix("event: ") for kind, _ in blocks]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    datas = [json.loads(data.removeprefix("data: ")) for _, data in blocks]
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    assert datas[0]["response"]["id"] == datas[-1]["response"]["id"]
    assert datas[-1]["response"]["usage"]["output_tokens"] == 3
    assert (await post(http, fleet, "/v1/responses", {"input": []}))[0] == 400
    status, got = await post(http, fleet, "/v1/score", {"text_1": "q", "text_2": ["a", "b"]})
    assert status == 200 and [d["index"] for d in got["data"]] == [0, 1]
    assert all(0 <= d["score"] <= 1 for d in got["data"])
    assert (await post(http, fleet, "/score", {"text_1": ["q", "r", "s"], "text_2": ["a", "b"]}))[0] == 400
    status, got = await post(
        http, fleet, "/rerank", {"query": "q", "documents": ["a", {"text": "b"}, "c"], "top_n": 2}
    )
    assert status == 200 and len(got["results"]) == 2
    assert got["results"][0]["relevance_score"] >= got["results"][1]["relevance_score"]
    assert (await post(http, fleet, "/v1/rerank", {"query": "q", "documents": []}))[0] == 400


async def test_tokenize_and_detokenize(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    status, got = await post(http, fleet, "/tokenize", {"prompt": "the lazy dog", "return_token_strs": True})
    assert status == 200 and got["count"] == len(got["tokens"]) == len(got["token_strs"])
    assert await post(http, fleet, "/detokenize", {"tokens": got["tokens"]}) == (
        200,
        {"prompt": "the lazy dog"},
    )
    status, bad = await post(
        http, fleet, "/tokenize", {"prompt": [1, 2]}
    )  # TokenizeCompletionRequest: a string
    assert (status, bad["error"]["param"]) == (400, "body.prompt")
    status, bad = await post(http, fleet, "/detokenize", {"tokens": [-1]})
    assert (status, bad["error"]["param"]) == (400, "body.tokens.0")


async def test_models_card_and_unknown_model(
    api: openai.AsyncOpenAI, fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    card = (await api.models.list()).data[0].model_dump()
    assert card["max_model_len"] == 512 and card["owned_by"] == "vllm"
    assert card["permission"][0]["object"] == "model_permission"
    got = await post(http, fleet, "/v1/completions", {"model": "other", "prompt": "x"})
    assert got == (
        404,
        error(404, f"The model `other` does not exist. Valid aliases: {MODEL}.", "model", "NotFoundError"),
    )
