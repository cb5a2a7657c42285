"""A first_k step read as a stream: decided after k tokens (cut short when they fail), otherwise read to
its end and assembled into the answer the engine would have sent unstreamed."""

from __future__ import annotations

import random
import types
from typing import Any

import orjson
import pytest

from extproc.cascade.gate import Verdict
from extproc.cascade.plan import Answered, CascadePolicy, Cascader, Replayed, Run
from extproc.cascade.spec import CascadeSpec
from extproc.cascade.stream import StepStream

SPEC = CascadeSpec(("small", "large"), -0.5, "first_k", 3)


def line(doc: Any) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n"


def chunk(delta: dict[str, Any], logprobs: list[float] | None = None, finish: str | None = None) -> bytes:
    lp = None if logprobs is None else {"content": [{"token": "t", "logprob": v} for v in logprobs]}
    choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
    return line(
        {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "small", "choices": [choice]}
    )


def feed(stream: StepStream, lines: list[bytes]) -> int:
    """Lines fed until the stream says stop; how many it took."""
    for i, ln in enumerate(lines, 1):
        if not stream.feed(ln):
            return i
    return len(lines)


LINES = [
    chunk({"role": "assistant", "content": ""}),
    b"\n",
    chunk({"content": "Hel"}, [-0.1]),
    chunk({"content": "lo"}, [-0.2]),
    chunk({"content": " you"}, [-0.3, -0.1]),  # llama.cpp and vLLM may put several tokens in one chunk
    chunk({"content": "!"}, [-4.0]),
    chunk({}, None, "stop"),
    line(
        {
            "id": "c1",
            "object": "chat.completion.chunk",
            "created": 5,
            "model": "small",
            "choices": [],
            "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9},
        }
    ),
    b"data: [DONE]\n",
]


def test_passes_at_k_then_reads_to_the_end_and_assembles() -> None:
    stream = StepStream(SPEC, chat=True)
    assert feed(stream, LINES) == len(LINES)
    assert stream.verdict == Verdict(pytest.approx(-0.2), True, "pass") and not stream.cut
    answer = stream.answer()
    assert answer == {
        "id": "c1",
        "created": 5,
        "model": "small",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello you!"},
                "logprobs": {
                    "content": [{"token": "t", "logprob": v} for v in (-0.1, -0.2, -0.3, -0.1, -4.0)]
                },
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9},
    }


def test_fails_at_k_and_stops_reading() -> None:
    stream = StepStream(CascadeSpec(("s", "l"), -0.1, "first_k", 3), chat=True)
    assert feed(stream, LINES) == 5  # the chunk that brought the third token
    assert stream.cut and stream.verdict is not None and stream.verdict.reason == "gate"


def test_tool_calls_are_merged_and_completions_assembled() -> None:
    stream = StepStream(SPEC, chat=True)
    calls = [
        {"index": 0, "id": "call1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}},
        {"index": 0, "function": {"arguments": ": 1}"}},
    ]
    feed(
        stream,
        [chunk({"tool_calls": [calls[0]]}, [-0.1]), chunk({"tool_calls": [calls[1]]}, [-0.1], "tool_calls")],
    )
    answer = stream.answer()
    assert answer is not None and stream.verdict is None  # fewer than k tokens: judged at the end
    assert answer["choices"][0]["message"]["tool_calls"] == [
        {"id": "call1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]
    text = StepStream(SPEC, chat=False)
    for piece, lp in (("ab", -0.1), ("c", -0.2)):
        text.feed(
            line(
                {
                    "id": "x",
                    "created": 1,
                    "model": "small",
                    "choices": [
                        {
                            "index": 0,
                            "text": piece,
                            "logprobs": {"tokens": [piece], "token_logprobs": [lp]},
                            "finish_reason": None,
                        }
                    ],
                }
            )
        )
    doc = text.answer()
    assert doc is not None and doc["choices"][0]["text"] == "abc"
    assert doc["choices"][0]["logprobs"] == {"tokens": ["ab", "c"], "token_logprobs": [-0.1, -0.2]}


def test_bad_or_empty_streams_have_no_answer() -> None:
    stream = StepStream(SPEC, chat=True)
    assert stream.answer() is None
    stream.feed(b"data: {not json\n")
    stream.feed(chunk({"content": "x"}, [-0.1]))
    assert stream.answer() is None


def run(spec: CascadeSpec = SPEC) -> Run:
    client = {"model": "auto", "messages": [], "stream": True, "stream_options": {"include_usage": True}}
    return Run(spec, "auto", client, True, 0.0)


def test_a_run_streams_its_first_k_steps() -> None:
    r = run()
    body = orjson.loads(r.body())
    assert r.streamed and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert feed_run(r, LINES)
    answered = r.judge(None)
    assert answered is not None and answered.content_type == "text/event-stream"
    assert b'"Hello you!"' in answered.body and b'"usage"' in answered.body

    r = run(CascadeSpec(("s", "l"), -0.1, "first_k", 3))
    r.body()
    assert not feed_run(r, LINES)
    assert r.judge(None) is None and r.verdicts[-1][1].reason == "gate"

    r = run()
    r.body()
    assert r.judge(None, "timeout") is None and r.verdicts[-1][1].reason == "timeout"
    assert orjson.loads(run(CascadeSpec(("s", "l"), -0.5)).body())["stream"] is False  # mean: whole answer


def feed_run(r: Run, lines: list[bytes]) -> bool:
    return all(r.feed(ln) for ln in lines)


def test_stop_on_pass_stops_reading_when_the_first_k_pass() -> None:
    stream = StepStream(SPEC, chat=True, stop_on_pass=True)
    assert feed(stream, LINES) == 5  # the chunk that brought the third token
    assert stream.cut and stream.verdict == Verdict(pytest.approx(-0.2), True, "pass")
    short = StepStream(SPEC, chat=True, stop_on_pass=True)  # an answer shorter than k: judged at its end
    assert feed(short, [LINES[0], LINES[2], LINES[6], LINES[8]]) == 4
    assert not short.cut and short.verdict is None and short.answer() is not None


REPLAY = CascadeSpec(("small", "large"), -0.5, "first_k", 3, replay=True)


def test_a_replay_run_seeds_its_step_and_replays_it_when_the_first_k_pass() -> None:
    rng = random.Random(5)
    cascader = Cascader(CascadePolicy(types.MappingProxyType({"auto": REPLAY})), rng=rng)
    client = {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2}
    r = cascader.start("auto", client, chat=True, now=0.0)
    assert r is not None and r.seed == random.Random(5).randrange(Cascader.SEEDS)
    sent = orjson.loads(r.body())
    assert sent["seed"] == r.seed and sent["stream"] is True and sent["logprobs"] is True
    assert not feed_run(r, LINES)  # stopped at the third token: it passed
    replayed = r.judge(None)
    assert replayed == Replayed(1, "small") and r.replaying and not r.gated
    assert r.verdicts == [("small", Verdict(pytest.approx(-0.2), True, "pass"))]
    # The client's own body again (its logprobs choice, n, stream) and the same seed; the processor sets
    # the step's model (tests/extproc/cascade/test_processor_cascade.py).
    assert r.replay_body() == {**client, "seed": r.seed}

    r = run(REPLAY)  # fails on its first tokens: escalates as without replay
    r.seed = 7
    r.body()
    assert not feed_run(r, [chunk({"content": "x"}, [-3.0, -3.0, -3.0])])
    assert r.judge(None) is None and not r.replaying and r.escalate() == "large"


def test_a_replay_run_keeps_the_clients_seed_and_leaves_a_non_streaming_client_alone() -> None:
    cascader = Cascader(CascadePolicy(types.MappingProxyType({"auto": REPLAY})))
    own = cascader.start("auto", {"model": "auto", "stream": True, "seed": 42}, chat=True, now=0.0)
    assert own is not None and own.seed == 42 and orjson.loads(own.body())["seed"] == 42
    whole = cascader.start("auto", {"model": "auto", "seed": 42}, chat=True, now=0.0)
    assert whole is not None and whole.seed is None  # the answer is returned whole, read to its end
    assert orjson.loads(whole.body())["seed"] == 42 and feed_run(whole, LINES)  # the client's, as sent
    answered = whole.judge(None)
    assert isinstance(answered, Answered) and not whole.replaying
    plain = Cascader(CascadePolicy(types.MappingProxyType({"auto": SPEC})))
    r = plain.start("auto", {"model": "auto", "stream": True}, chat=True, now=0.0)
    assert r is not None and r.seed is None and "seed" not in orjson.loads(r.body())
