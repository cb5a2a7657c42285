"""A first_k step read as a stream: decided after k tokens (cut short when they fail), otherwise read to
its end and assembled into the answer the engine would have sent unstreamed."""

from __future__ import annotations

import random
import types
from typing import Any

import orjson
import pytest

from extproc.cascade.gate import Verdict, judge
from extproc.cascade.plan import Answered, CascadePolicy, Cascader, Replayed, Run
from extproc.cascade.spec import CascadeSpec
from extproc.cascade.stream import StepStream

SPEC = CascadeSpec(("small", "large"), -0.5, "first_k", 3)


def line(doc: Any) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n"


def chunk(
    delta: dict[str, Any],
    logprobs: list[float | None] | None = None,
    finish: str | None = None,
    index: int = 0,
) -> bytes:
    lp = None if logprobs is None else {"content": [{"token": "t", "logprob": v} for v in logprobs]}
    choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
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


@pytest.mark.parametrize(
    "choice",
    [
        {"index": None, "delta": {}},
        {"index": "0", "delta": {}},
        {"index": -1, "delta": {}},
        {"index": True, "delta": {}},
        {"index": 0, "delta": "x"},
        {"index": 0, "delta": {"content": 5}},
        {"index": 0, "delta": {"role": ["assistant"]}},
        {"index": 0, "delta": {"tool_calls": {"index": 0}}},
        {"index": 0, "delta": {"tool_calls": ["f"]}},
        {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": "f"}]}},
        {"index": 0, "delta": {"tool_calls": [{"index": None, "function": {"name": "f"}}]}},
        {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": {"a": 1}}}]}},
        {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": 7}]}},
        "a choice",
    ],
)
def test_a_malformed_chunk_makes_the_stream_bad_and_escalates_as_bad_answer(choice: object) -> None:
    """A chunk of the wrong shape raised TypeError / AttributeError out of feed (the gRPC stream died:
    the client got a 500); now the stream stops, has no answer, and the step escalates as bad_answer."""
    r = run()
    r.body()
    assert r.feed(LINES[2])
    bad = line(
        {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "small", "choices": [choice]}
    )
    assert not r.feed(bad)  # stop reading: the answer is refused whatever follows
    assert r.stream is not None and r.stream.bad and not r.stream.cut and r.stream.answer() is None
    assert not r.feed(LINES[3])
    assert r.judge(None) is None and r.verdicts[-1][1] == Verdict(None, False, "bad_answer")


@pytest.mark.parametrize(
    "doc",
    [
        {"id": "x", "choices": {"index": 0}},
        {"id": "x", "choices": [{"index": 0, "text": 5}]},
        {"id": "x", "choices": [{"index": 0.5, "text": "a"}]},
        ["not", "an", "object"],
    ],
)
def test_a_malformed_completions_chunk_makes_the_stream_bad(doc: object) -> None:
    stream = StepStream(SPEC, chat=False)
    assert not stream.feed(line(doc)) and stream.bad and stream.answer() is None


def test_a_pass_waits_for_every_choice_the_client_asked_for() -> None:
    """n = 2: choice 0 passing on its first k tokens said nothing of choice 1, not seen yet (the answer is
    judged by its worst choice); the early pass waits for it, a fail needs no wait."""
    stream = StepStream(SPEC, chat=True, stop_on_pass=True, n=2)
    assert stream.feed(chunk({"content": "a"}, [-0.01, -0.01, -0.01]))
    assert stream.verdict is None and not stream.cut
    assert not stream.feed(chunk({"content": "b"}, [-0.2, -0.2, -0.2], index=1))
    assert stream.cut and stream.verdict == Verdict(pytest.approx(-0.2), True, "pass")

    later = StepStream(SPEC, chat=True, n=2)  # not replayed: a later choice's fail still cuts it short
    assert later.feed(chunk({"content": "a"}, [-0.01, -0.01, -0.01]))
    assert not later.feed(chunk({"content": "b"}, [-3.0, -3.0, -3.0], index=1))
    assert later.cut and later.verdict is not None and later.verdict.reason == "gate"

    fails = StepStream(SPEC, chat=True, stop_on_pass=True, n=2)
    assert not fails.feed(chunk({"content": "a"}, [-3.0, -3.0, -3.0]))  # the worst is below already
    assert fails.cut and fails.verdict is not None and fails.verdict.reason == "gate"

    one = StepStream(SPEC, chat=True, stop_on_pass=True, n=2)  # the engine sent one choice: judged whole
    assert feed(one, [chunk({"content": "a"}, [-0.01, -0.01, -0.01], "stop"), b"data: [DONE]\n"]) == 2
    assert not one.cut and one.verdict is None and one.answer() is not None


def test_a_run_waits_for_the_clients_n_choices() -> None:
    client = {"model": "auto", "messages": [], "stream": True, "n": 3}
    r = Run(REPLAY, "auto", client, True, 0.0, seed=1)
    r.body()
    assert r.feed(chunk({"content": "a"}, [-0.1] * 3)) and r.feed(
        chunk({"content": "b"}, [-0.1] * 3, index=1)
    )
    assert not r.feed(chunk({"content": "c"}, [-0.1] * 3, index=2))
    assert r.judge(None) == Replayed(1, "small")


def test_null_logprobs_are_skipped_as_the_buffered_gate_skips_them() -> None:
    """A null entry (a token the engine gave no log-probability) is skipped by both gates: the stream
    dropped it and the buffered gate refused the whole answer (no_logprobs)."""
    stream = StepStream(SPEC, chat=True, stop_on_pass=True)
    assert (
        feed(stream, [chunk({"content": "a"}, [None]), chunk({"content": "b"}, [-0.01, -0.01, -0.01])]) == 2
    )
    assert stream.verdict == Verdict(pytest.approx(-0.01), True, "pass")
    whole = StepStream(SPEC, chat=True)
    feed(
        whole, [chunk({"content": "a"}, [None, -0.01]), chunk({"content": "b"}, [-0.01, -0.01, -4.0], "stop")]
    )
    doc = whole.answer()
    assert doc is not None and judge(SPEC, doc) == Verdict(pytest.approx(-0.01), True, "pass")
    nulls = StepStream(SPEC, chat=True)
    feed(nulls, [chunk({"content": "a"}, [None, None, None, None], "stop")])
    assert nulls.verdict is None and (doc := nulls.answer()) is not None
    assert judge(SPEC, doc) == Verdict(None, False, "no_logprobs")  # no number: no statistic
    odd = StepStream(SPEC, chat=True)
    feed(
        odd,
        [
            line(
                {
                    "id": "c",
                    "choices": [{"index": 0, "delta": {}, "logprobs": {"content": [{"logprob": "x"}] * 3}}],
                }
            )
        ],
    )
    assert odd.verdict is None and (doc := odd.answer()) is not None
    assert judge(SPEC, doc) == Verdict(None, False, "no_logprobs")  # not a number: unreadable


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
    assert feed_run(r, LINES[:5])  # choice 0 passes on its first 3 tokens; choice 1 is not in yet
    assert not r.feed(chunk({"content": "Yo"}, [-0.1, -0.1, -0.1], index=1))  # both in: it passed
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


@pytest.mark.parametrize("chat", [True, False])
def test_each_chunk_reads_its_own_entries_once(chat: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """n = 2, choice 0 ends with fewer than k tokens (the verdict waits for the end) while choice 1 goes
    on: each chunk's log-probabilities are read once, not every entry so far at every chunk (quadratic
    on the event loop: a 2,000-token choice took seconds)."""
    import extproc.cascade.stream as stream_module

    read: list[int] = []
    real = stream_module.token_values

    def counted(entries: list[Any]) -> list[float] | None:
        read.append(len(entries))
        return real(entries)

    monkeypatch.setattr(stream_module, "token_values", counted)

    def text(values: list[float], index: int, finish: str | None = None) -> bytes:
        lp = {"tokens": ["t"] * len(values), "token_logprobs": values}
        choice = {"index": index, "text": "t", "logprobs": lp, "finish_reason": finish}
        doc = {"id": "c", "object": "text_completion", "created": 5, "model": "small", "choices": [choice]}
        return line(doc)

    tokens = 500
    first = chunk({"content": "a"}, [-0.1], "stop") if chat else text([-0.1], 0, "stop")
    rest = [chunk({"content": "b"}, [-0.1], index=1) if chat else text([-0.1], 1) for _ in range(tokens)]
    stream = StepStream(SPEC, chat=chat, n=2)
    assert feed(stream, [first, *rest]) == tokens + 1
    assert sum(read) <= 2 * (tokens + 1)  # linear in the entries (was ~tokens^2 / 2)
    doc = stream.answer()
    assert doc is not None and judge(SPEC, doc) == Verdict(pytest.approx(-0.1), True, "pass")
    assert stream.verdict is None and not stream.cut  # judged whole at the end, as before


@pytest.mark.parametrize(
    "event",
    [
        {"error": {"message": "engine failed", "type": "InternalServerError", "code": 500}},
        {"object": "error", "message": "engine failed", "type": "BadRequestError", "code": 400},
    ],
)
def test_an_error_event_mid_stream_escalates_as_bad_answer(event: dict[str, Any]) -> None:
    """vLLM answers a failure during generation inside the 200 stream: ``data: {"error": ...}`` (older:
    an ``"object": "error"`` body), then ``[DONE]``. The tokens before it passed the gate and the partial
    answer went to the client as whole (no finish reason); now the stream is bad and the step escalates."""
    r = run()
    r.body()
    assert r.feed(LINES[2]) and r.feed(LINES[3]) and r.feed(LINES[4])  # k = 3 tokens in: passed
    assert r.stream is not None and r.stream.verdict is not None and r.stream.verdict.passed
    assert not r.feed(line(event))
    assert r.stream.bad and r.stream.answer() is None
    assert r.judge(None) is None and r.verdicts[-1][1] == Verdict(None, False, "bad_answer")
