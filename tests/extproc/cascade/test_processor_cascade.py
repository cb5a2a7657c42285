"""The stream state machine with a cascade's virtual model, in memory: the first step is routed among its
model's endpoints and handed to the shell (:attr:`StreamProcessor.cascade_step`); :meth:`stepped` then
answers the client itself (gate passed) or routes the client's body to the next step."""

from __future__ import annotations

import random
import types
from typing import Any

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import json_format

from contracts.epp import CASCADE_STEP_HEADER, DECISION_CASCADE_STEP
from contracts.events import EndpointId
from engines.endpoint import Endpoint
from extproc.cascade.plan import CascadePolicy, Cascader
from extproc.cascade.prior import PrerouteSpec
from extproc.cascade.spec import CascadeSpec
from extproc.disagg.plan import Disaggregator, PdPolicy, PdRoute
from extproc.disagg.policy import PdSpec
from extproc.errors import Unavailable
from extproc.fleet import Fleet
from extproc.flow.control import FlowControl, Room
from extproc.flow.policy import FlowPolicy, Saturation
from extproc.index.approximate import ApproximateIndex
from extproc.models.registry import ModelRegistry
from extproc.processor import ProcessorConfig, StreamProcessor
from extproc.routing.router import Router, RoutingPolicy
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile
from tests.extproc.test_processor import ACME_KEY, body, headers, make_gate, reply

SMALL, MID, LARGE = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def make(
    spec: CascadeSpec, hold_timeout_s: float | None = 600.0, cascader: Cascader | None = None
) -> tuple[StreamProcessor, Router]:
    endpoints = [
        Endpoint(EndpointId("s"), SMALL, frozenset({"small"}), "vllm"),
        Endpoint(EndpointId("m"), MID, frozenset({"mid"}), "vllm"),
        Endpoint(EndpointId("l"), LARGE, frozenset({"large"}), "vllm"),
    ]
    router = Router(
        Fleet(endpoints),
        ModelRegistry([]),
        ApproximateIndex(),
        RoutingPolicy(build_profile(DEFAULT_SCHEDULING), block_size=16),
        rng=random.Random(0),
    )
    cascader = cascader or Cascader(CascadePolicy(types.MappingProxyType({"auto": spec})))
    config = ProcessorConfig(max_body_bytes=1 << 20, hold_timeout_s=hold_timeout_s)
    return StreamProcessor(router, config, lambda: 1000.0, cascade=cascader), router


SPEC = CascadeSpec(("small", "large"), -0.5, timeout_s=12.5)


def request(**extra: Any) -> bytes:
    return orjson.dumps(
        {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    )


def answer(*logprobs: float, model: str = "small") -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "logprobs": {"content": [{"token": "o", "logprob": v} for v in logprobs]},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": 3,
                "completion_tokens": len(logprobs),
                "total_tokens": 3 + len(logprobs),
            },
        }
    )


def start(proc: StreamProcessor, payload: bytes) -> list[pb.ProcessingResponse]:
    assert proc.handle(headers()) == []
    return proc.handle(body(payload))


def load(router: Router) -> dict[str, tuple[int, int]]:
    """Per endpoint: (in flight, outstanding until a completion)."""
    return {s.address: (s.in_flight, s.outstanding) for s in router.fleet if s.in_flight or s.outstanding}


def immediate(out: list[pb.ProcessingResponse]) -> tuple[int, dict[str, str], bytes, dict[str, Any]]:
    (resp,) = out
    assert resp.HasField("immediate_response")
    ir = resp.immediate_response
    hs = {h.header.key: h.header.raw_value.decode() for h in ir.headers.set_headers}
    return ir.status.code, hs, ir.body, json_format.MessageToDict(resp.dynamic_metadata)


def test_the_first_step_is_sent_by_the_shell_with_logprobs() -> None:
    proc, router = make(SPEC)
    out = start(proc, request(stream=True))
    assert len(out) == 1 and out[0].WhichOneof("response") is None
    assert out[0].override_message_timeout.seconds == 17  # the step's bound + 5 s
    sub = proc.cascade_step
    assert sub is not None
    assert (sub.address, sub.path, sub.timeout_s, sub.headers) == (
        SMALL,
        "/v1/chat/completions",
        12.5,
        {"x-request-id": "r1"},
    )
    sent = orjson.loads(sub.body)
    assert (sent["model"], sent["stream"], sent["logprobs"]) == ("small", False, True)
    assert load(router) == {SMALL: (1, 1)}


def test_a_confident_answer_is_returned_by_the_gateway() -> None:
    proc, router = make(SPEC)
    start(proc, request())
    status, hs, text, meta = immediate(proc.stepped(answer(-0.1, -0.2)))
    assert status == 200
    assert hs == {"content-type": "application/json", CASCADE_STEP_HEADER: "1"}
    assert meta == {"kvgate": {"answered": "json"}}
    doc = orjson.loads(text)
    assert doc["model"] == "small" and doc["choices"][0]["logprobs"] is None  # the client did not ask
    assert doc["usage"]["completion_tokens"] == 2
    assert proc.answered is not None and proc.answered.step == 1 and proc.cascade_step is None
    assert load(router) == {}  # the step's slot and outstanding count are released
    proc.close()
    assert load(router) == {}


def test_a_streaming_client_gets_sse() -> None:
    proc, _ = make(SPEC)
    start(proc, request(stream=True, logprobs=True))
    _, hs, text, meta = immediate(proc.stepped(answer(-0.1)))
    assert hs["content-type"] == "text/event-stream" and meta == {"kvgate": {"answered": "sse"}}
    assert text.endswith(b"data: [DONE]\n\n")
    chunks = [orjson.loads(b[6:]) for b in text.split(b"\n\n")[:-2]]
    assert chunks[1]["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.1  # asked for: kept


@pytest.mark.parametrize(
    ("got", "failure", "reason"),
    [
        (answer(-0.1, -2.0), None, "gate"),
        (orjson.dumps({"choices": [{"message": {"content": "x"}, "logprobs": None}]}), None, "no_logprobs"),
        (b"<html>", None, "bad_answer"),
        (None, "timeout", "timeout"),
        (None, "status", "status"),
    ],
)
def test_an_uncertain_or_failed_step_escalates_to_the_next_through_envoy(
    got: bytes | None, failure: str | None, reason: str
) -> None:
    proc, router = make(SPEC)
    start(proc, request(stream=True, logprobs=False))
    decided = reply(proc.stepped(got, failure))
    assert decided.destination == [LARGE]
    doc = orjson.loads(decided.body)
    assert (doc["model"], doc["stream"], doc["logprobs"]) == ("large", True, False)  # the client's own body
    assert decided.decision[DECISION_CASCADE_STEP] == "2"
    assert decided.set_headers["x-kvgate-model"] == "large"
    assert proc.run is not None and proc.run.verdicts[-1][1].reason == reason
    assert proc.cascade_step is None and proc.answered is None
    assert load(router) == {LARGE: (1, 1)}
    proc.close()
    assert load(router) == {LARGE: (0, 1)}  # outstanding until Envoy's completion log


def test_three_steps() -> None:
    proc, router = make(CascadeSpec(("small", "mid", "large"), -0.5, "min", timeout_s=12.5))
    (first,) = start(proc, request())
    # Envoy honours one message-timeout extension per message: the first covers both gated steps
    assert first.override_message_timeout.seconds == 30  # 2 x 12.5 s + 5 s
    assert proc.stepped(answer(-0.1, -0.9)) == []  # a second extension would be ignored: none is sent
    sub = proc.cascade_step
    assert sub is not None and sub.address == MID and orjson.loads(sub.body)["model"] == "mid"
    assert load(router) == {MID: (1, 1)}
    _, hs, text, _ = immediate(proc.stepped(answer(-0.3, model="mid")))
    assert hs[CASCADE_STEP_HEADER] == "2" and orjson.loads(text)["model"] == "mid"
    assert load(router) == {}


def test_a_held_cascade_request_extends_the_timeout_once_for_the_hold_and_its_step() -> None:
    """Held by flow control, then a gated step: Envoy honours only the first extension of the body
    message, so the hold's covers the wait, the step's bound and the slack; the step sends none."""
    _, router = make(SPEC)
    control: FlowControl[StreamProcessor] = FlowControl(FlowPolicy(saturation=Saturation(max_in_flight=1)))
    cascader = Cascader(CascadePolicy(types.MappingProxyType({"auto": SPEC})))
    config = ProcessorConfig(max_body_bytes=1 << 20, hold_timeout_s=600.0)

    def proc() -> StreamProcessor:
        return StreamProcessor(router, config, lambda: 1000.0, flow=control, cascade=cascader)

    busy = proc()
    start(busy, request())  # step 1 on the one small endpoint: it is full
    held = proc()
    (out,) = start(held, request())
    assert held.held is not None and held.cascade_step is None
    wait = held.held.expires - 1000.0
    assert out.override_message_timeout.seconds == int(wait + 12.5 + 5)
    busy.close()
    entry = control.next("small", Room.OPEN, 1000.0)
    assert entry is held.held
    assert entry.payload.resume() == []  # the step goes; its extension was sent with the hold's
    assert held.cascade_step is not None and held.cascade_step.address == SMALL


def test_a_cascade_ending_on_a_disaggregated_model_extends_for_the_prefill_at_its_first_step() -> None:
    """The first extension (the gated step's) covers a later prefill half too: the handoff sends none."""
    _, router = make(SPEC)
    route = PdRoute(PdSpec("disaggregated", 0, None, 30.0), router.policy.profile)
    disagg = Disaggregator(router, PdPolicy(types.MappingProxyType({"large": route})))
    cascader = Cascader(CascadePolicy(types.MappingProxyType({"auto": SPEC})))
    config = ProcessorConfig(max_body_bytes=1 << 20, hold_timeout_s=600.0)
    proc = StreamProcessor(router, config, lambda: 1000.0, disagg=disagg, cascade=cascader)
    (out,) = start(proc, request())
    assert out.override_message_timeout.seconds == int(12.5 + 30.0 + 5)


def test_an_error_after_the_escalated_decision_leaves_nothing_taken_nor_recorded() -> None:
    """The escalated step is decided, then refused by the gateway itself (here its priority rule: a
    failure after decide): Envoy answers locally and logs no completion, so close() releases what decide
    took (in flight and outstanding) and records nothing in the index."""
    proc, router = make(SPEC)
    start(proc, request())
    decided = router.decide

    def decide_then_fail(*args: Any, **kw: Any) -> Any:
        decision = decided(*args, **kw)
        proc.decision = decision  # what _decide keeps before what can fail after it
        raise Unavailable("a failure after decide", code="test")

    committed: list[Any] = []
    commit = router.commit
    router.decide = decide_then_fail  # type: ignore[method-assign]
    router.commit = lambda d, now: (committed.append(d), commit(d, now))[1]  # type: ignore[method-assign]
    status, _, _, _ = immediate(proc.stepped(answer(-2.0)))  # escalates: decided, then refused
    assert status == 503
    stepped = list(committed)  # the gated step's own decision (it was sent: recorded)
    proc.after_send()
    proc.close()
    assert load(router) == {}
    assert committed == stepped  # the refused escalation recorded nothing


def test_a_step_judged_then_prepared_and_resent_routes_as_stepped_does() -> None:
    """The shell's way for a large body (judged, prepare_step in a worker thread, restep) sends the body
    to the next step with the replies stepped makes in one call; a failure preparing it (here an internal
    error while tokenizing) is restep's reply, as stepped's would be."""
    one, _ = make(SPEC)
    start(one, request())
    whole = reply(one.stepped(answer(-2.0)))
    proc, router = make(SPEC)
    start(proc, request())
    assert proc.judged(answer(-2.0)) is None and proc.step_preparable() is False  # a small body
    proc.prepare_step()
    split = reply(proc.restep())
    assert (split.destination, split.set_headers, split.body) == (
        whole.destination,
        whole.set_headers,
        whole.body,
    )
    assert load(router) == {LARGE: (1, 1)}
    proc.close()

    failing, router = make(SPEC)
    start(failing, request())
    assert failing.judged(answer(-2.0)) is None

    def broken(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("tokenizer failed")

    router.tokens = broken  # type: ignore[method-assign]
    failing.prepare_step()  # the error is kept for restep, never raised in the thread
    status, _, _, _ = immediate(failing.restep())
    assert status == 500
    failing.close()
    assert load(router) == {}


def test_a_client_gone_during_a_step_frees_its_slot() -> None:
    proc, router = make(SPEC)
    start(proc, request())
    proc.close()
    assert load(router) == {}


def test_without_a_message_timeout_extension() -> None:
    proc, _ = make(SPEC, hold_timeout_s=None)
    assert start(proc, request()) == []
    assert proc.cascade_step is not None


def test_a_served_model_is_not_cascaded_and_an_unknown_step_is_a_404() -> None:
    proc, _ = make(SPEC)
    out = start(proc, orjson.dumps({"model": "small", "messages": [{"role": "user", "content": "x"}]}))
    assert reply(out).destination == [SMALL] and proc.run is None
    proc, _ = make(CascadeSpec(("nowhere", "large"), -0.5))
    status, _, text, _ = immediate(start(proc, request()))
    assert status == 404 and b"nowhere" in text


def test_echo_on_a_cascade_is_a_400_and_the_step_is_asked_without_it() -> None:
    """The gate judges the answer's tokens: a step asked with echo judged the prompt's first tokens (the
    first with a null logprob), and an answer returned from a gated step cannot carry the prompt."""
    for path, payload in (
        ("/v1/chat/completions", request(echo=True)),
        ("/v1/completions", orjson.dumps({"model": "auto", "prompt": "hi", "max_tokens": 4, "echo": True})),
    ):
        proc, router = make(SPEC)
        assert proc.handle(headers(path)) == []
        status, _, text, _ = immediate(proc.handle(body(payload)))
        error = orjson.loads(text)["error"]
        assert status == 400 and error["param"] == "echo" and "'echo' is not supported" in error["message"]
        assert error["type"] == "invalid_request_error" and proc.run is None and load(router) == {}
    proc, _ = make(SPEC)
    start(proc, request(echo=False))
    assert proc.cascade_step is not None and "echo" not in orjson.loads(proc.cascade_step.body)


def sse_line(logprob: float, content: str = "x") -> bytes:
    choice = {
        "index": 0,
        "delta": {"content": content},
        "logprobs": {"content": [{"token": content, "logprob": logprob}]},
    }
    return b"data: " + orjson.dumps({"id": "c", "created": 1, "model": "small", "choices": [choice]}) + b"\n"


def test_a_first_k_step_is_streamed_and_cut_short_when_its_first_tokens_fail() -> None:
    proc, router = make(CascadeSpec(("small", "large"), -0.5, "first_k", 2))
    start(proc, request())
    sub = proc.cascade_step
    assert sub is not None and sub.stream and orjson.loads(sub.body)["stream"] is True
    assert proc.step_line(sse_line(-0.1)) and not proc.step_line(sse_line(-3.0))  # stop reading
    decided = reply(proc.stepped(None))
    assert decided.destination == [LARGE] and decided.decision[DECISION_CASCADE_STEP] == "2"
    assert proc.run is not None and proc.run.verdicts[-1][1].reason == "gate"
    assert load(router) == {LARGE: (1, 1)}


def test_a_first_k_step_that_passes_is_read_to_its_end() -> None:
    proc, _ = make(CascadeSpec(("small", "large"), -0.5, "first_k", 2))
    start(proc, request())
    for lp in (-0.1, -0.2, -3.0, -3.0):  # only the first 2 tokens count
        assert proc.step_line(sse_line(lp))
    assert proc.step_line(b"data: [DONE]\n")
    _, hs, text, _ = immediate(proc.stepped(None))
    doc = orjson.loads(text)
    assert hs[CASCADE_STEP_HEADER] == "1" and doc["choices"][0]["message"]["content"] == "xxxx"
    assert doc["choices"][0]["logprobs"] is None


def test_a_replay_step_that_passes_its_first_tokens_goes_again_through_envoy() -> None:
    """``replay``: a streaming client's step is seeded and cut at ``k`` passing tokens; the client's own
    body (its ``logprobs`` choice, ``stream``) then goes to the same step's model with the same seed, routed
    KV-aware, through Envoy (the step's header says 1); the gated sub-request is released, the replay holds
    the slot."""
    replay = CascadeSpec(("small", "large"), -0.5, "first_k", 2, replay=True)
    cascader = Cascader(CascadePolicy(types.MappingProxyType({"auto": replay})), rng=random.Random(3))
    proc, router = make(replay, cascader=cascader)
    start(proc, request(stream=True, logprobs=False))
    sub = proc.cascade_step
    assert sub is not None and sub.stream
    seed = orjson.loads(sub.body)["seed"]
    assert seed == random.Random(3).randrange(Cascader.SEEDS)
    assert proc.step_line(sse_line(-0.1)) and not proc.step_line(sse_line(-0.2))  # passed: stop reading
    decided = reply(proc.stepped(None))
    assert decided.destination == [SMALL] and decided.decision[DECISION_CASCADE_STEP] == "1"
    doc = orjson.loads(decided.body)
    assert (doc["model"], doc["stream"], doc["logprobs"], doc["seed"]) == ("small", True, False, seed)
    assert "stream_options" not in doc  # the client's own body: it asked for none
    assert proc.answered is None and proc.run is not None and proc.run.replaying
    assert proc.run.verdicts[-1][1].reason == "pass"
    assert load(router) == {SMALL: (1, 1)}
    proc.close()
    assert load(router) == {SMALL: (0, 1)}  # outstanding until Envoy's completion log

    proc, _ = make(replay, cascader=cascader)  # a non-streaming client: the answer whole, as first_k
    start(proc, request())
    sub = proc.cascade_step
    assert sub is not None and "seed" not in orjson.loads(sub.body)
    for lp in (-0.1, -0.2, -3.0):
        assert proc.step_line(sse_line(lp))
    _, hs, _, _ = immediate(proc.stepped(None))
    assert hs[CASCADE_STEP_HEADER] == "1"


def test_a_tenant_is_admitted_by_the_virtual_models_name() -> None:
    """Tenant ``acme`` may use ``smol*``: the cascade ``smol-auto`` (over ``small`` and ``large``, which it
    may not name itself)."""
    _, router = make(SPEC)
    cascader = Cascader(CascadePolicy(types.MappingProxyType({"smol-auto": SPEC})))
    config = ProcessorConfig(max_body_bytes=1 << 20, hold_timeout_s=None)
    proc = StreamProcessor(router, config, lambda: 1000.0, make_gate(), cascade=cascader)
    assert proc.handle(headers(extra=ACME_KEY)) == []
    assert proc.handle(body(orjson.dumps({**orjson.loads(request()), "model": "smol-auto"}))) == []
    assert proc.cascade_step is not None and proc.ticket is not None
    proc = StreamProcessor(router, config, lambda: 1000.0, make_gate(), cascade=cascader)
    assert proc.handle(headers(extra=ACME_KEY)) == []
    status, _, text, _ = immediate(
        proc.handle(body(orjson.dumps({**orjson.loads(request()), "model": "small"})))
    )
    assert status == 403 and b"model_not_allowed" in text


def test_models_lists_virtual_models_whose_steps_are_served() -> None:
    _, router = make(SPEC)
    specs = {"auto": SPEC, "broken": CascadeSpec(("small", "nowhere"), -0.5)}
    cascader = Cascader(CascadePolicy(types.MappingProxyType(specs)))
    proc = StreamProcessor(router, ProcessorConfig(max_body_bytes=1 << 20), lambda: 1000.0, cascade=cascader)
    status, _, text, _ = immediate(proc.handle(headers("/v1/models", "GET", end=True)))
    ids = [m["id"] for m in orjson.loads(text)["data"]]
    assert status == 200 and ids == ["large", "mid", "small", "auto"]


def test_preroute_learns_from_the_gate_and_sends_what_it_would_escalate_straight_to_the_last_step() -> None:
    spec = CascadeSpec(("small", "large"), -0.5, preroute=PrerouteSpec(above=0.9, min_seen=4, explore=0.0))
    cascader = Cascader(CascadePolicy(types.MappingProxyType({"auto": spec})))

    def ask(text: str) -> tuple[StreamProcessor, list[pb.ProcessingResponse]]:
        proc, _ = make(spec, cascader=cascader)
        return proc, start(proc, request(messages=[{"role": "user", "content": text}]))

    for i in range(40):  # hard ones escalate, easy ones pass: the gate's verdicts teach the learner
        hard = i % 3 == 0
        proc, _ = ask(f"[{'hard' if hard else 'easy'}] question {i}")
        if proc.cascade_step is not None:
            proc.stepped(answer(-2.0) if hard else answer(-0.1))
        else:
            assert hard  # an easy request is never skipped here
        proc.close()
    prior = cascader.priors["auto"]
    assert prior.verdicts >= 4
    proc, out = ask("[hard] question 99")
    assert proc.cascade_step is None and proc.run is not None and proc.run.preskipped
    decided = reply(out)
    assert decided.destination == [LARGE] and decided.decision[DECISION_CASCADE_STEP] == "2"
    assert orjson.loads(decided.body)["model"] == "large"
    easy, _ = ask("[easy] question 100")
    assert easy.cascade_step is not None and easy.cascade_step.address == SMALL  # small first, as before
    cascader.apply(CascadePolicy(types.MappingProxyType({"auto": spec})))
    assert cascader.priors["auto"] is prior  # the same preroute: what was learnt stays
    other = CascadeSpec(("small", "large"), -0.5, preroute=PrerouteSpec(above=0.95))
    cascader.apply(CascadePolicy(types.MappingProxyType({"auto": other})))
    assert cascader.priors["auto"] is not prior and cascader.priors["auto"].verdicts == 0


@pytest.mark.parametrize(
    ("got", "failure", "counted"),
    [(answer(-2.0), None, 1), (answer(-0.1), None, 1), (None, "timeout", 0), (b"<html>", None, 0)],
)
def test_preroute_learns_only_from_verdicts_on_the_threshold(
    got: bytes | None, failure: str | None, counted: int
) -> None:
    spec = CascadeSpec(("small", "large"), -0.5, preroute=PrerouteSpec())
    cascader = Cascader(CascadePolicy(types.MappingProxyType({"auto": spec})))
    proc, _ = make(spec, cascader=cascader)
    start(proc, request())
    proc.stepped(got, failure)
    assert cascader.priors["auto"].verdicts == counted


def shaped_answer(**choice: Any) -> bytes:
    """A confident step-1 answer whose choice has ``choice``'s fields (a message of some shape)."""
    lp = {"content": [{"token": "o", "logprob": -0.1}]}
    return orjson.dumps(
        {"id": "c", "object": "chat.completion", "created": 1, "model": "small",
         "choices": [{"index": 0, "logprobs": lp, "finish_reason": "stop", **choice}]}
    )  # fmt: skip


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    "message",
    ["ok", {"role": "assistant", "content": None, "tool_calls": ["x"]}, {"content": ["a"]}],
)
def test_a_confident_answer_of_the_wrong_shape_escalates_as_bad_answer(stream: bool, message: Any) -> None:
    """A passing answer the client could not be given as asked (a message that is not an object, a tool
    call that is not one: an SSE rendering of it raised, a 500) escalates, as a streamed one does."""
    proc, router = make(SPEC)
    start(proc, request(stream=stream))
    decided = reply(proc.stepped(shaped_answer(message=message)))
    assert decided.destination == [LARGE]
    assert proc.run is not None and proc.run.verdicts[-1][1].reason == "bad_answer"
    assert proc.answered is None and load(router) == {LARGE: (1, 1)}


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/v1/chat/completions", request(prompt_logprobs=1)),
        ("/v1/completions", orjson.dumps({"model": "auto", "prompt": "hi", "prompt_logprobs": -1})),
        ("/v1/completions", orjson.dumps({"model": "auto", "prompt": "hi", "use_beam_search": True})),
    ],
)
def test_a_first_k_step_the_engine_would_refuse_streamed_is_sent_whole(path: str, payload: bytes) -> None:
    """vLLM refuses ``prompt_logprobs`` streamed, and a completion's ``use_beam_search`` streamed (400):
    a first_k step of a non-streaming client asking for them was streamed, refused, and escalated every
    time. It is sent whole instead, and the gate judges the first k tokens of the whole answer."""
    proc, _ = make(CascadeSpec(("small", "large"), -0.5, "first_k", 2))
    assert proc.handle(headers(path)) == []
    proc.handle(body(payload))
    sub = proc.cascade_step
    assert sub is not None and not sub.stream
    sent = orjson.loads(sub.body)
    assert sent["stream"] is False and "stream_options" not in sent
    chat = path == "/v1/chat/completions"
    whole = answer(-0.1, -0.2, -3.0) if chat else orjson.dumps(
        {"id": "c", "object": "text_completion", "created": 1, "model": "small",
         "choices": [{"index": 0, "text": "ok", "logprobs": {"token_logprobs": [-0.1, -0.2, -3.0]},
                      "finish_reason": "stop"}]}
    )  # fmt: skip
    status, hs, _, _ = immediate(proc.stepped(whole))  # only the first 2 tokens count
    assert status == 200 and hs[CASCADE_STEP_HEADER] == "1"


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/v1/embeddings", {"model": "auto", "input": "hi"}),
        ("/v1/responses", {"model": "auto", "input": "hi"}),
    ],
)
def test_a_kind_the_gate_cannot_judge_is_a_400_on_a_cascade(path: str, payload: dict[str, Any]) -> None:
    """An embeddings or Responses request naming the virtual model was sent as a gated step (with
    ``logprobs`` and ``stream`` added to its body); its answer has no choices to judge, so it escalated
    every time after paying the small step. It is refused, naming ``model``."""
    proc, router = make(SPEC)
    assert proc.handle(headers(path)) == []
    status, _, text, _ = immediate(proc.handle(body(orjson.dumps(payload))))
    error = orjson.loads(text)["error"]
    assert status == 400 and error["param"] == "model" and error["type"] == "invalid_request_error"
    assert "serves chat completions and completions only" in error["message"]
    assert proc.run is None and proc.cascade_step is None and load(router) == {}
