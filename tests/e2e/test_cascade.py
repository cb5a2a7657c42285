"""End to end, a cascade: the OpenAI SDK -> real Envoy -> ext_proc -> two simulated models, ``small``
(two replicas) and ``large`` (one), behind the virtual model ``auto`` (policy file: mean logprob gate at
-0.5). The simulator's logprobs follow the prompt (``[easy]``: about -0.05 a token, ``[hard]``: about -2,
load/sim/README.md), so which step answers is known in advance; the engines' own counters say who served.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvgate.dev.procs import Child
from kvgate.dev.up import Stack, StackOptions
from tests.e2e.conftest import FAST_SIM
from tests.e2e.test_disagg import samples
from tests.polling import poll

pytestmark = pytest.mark.e2e
THRESHOLD = -0.5
POLICY = {
    "models": {
        "auto": {"cascade": {"steps": ["small", "large"], "threshold": THRESHOLD}},
        "early": {
            "cascade": {"steps": ["small", "large"], "threshold": THRESHOLD, "stat": "first_k", "k": 4}
        },
        "replay": {
            "cascade": {
                "steps": ["small", "large"],
                "threshold": THRESHOLD,
                "stat": "first_k",
                "k": 4,
                "replay": True,
            }
        },
        "learnt": {
            "cascade": {
                "steps": ["small", "large"],
                "threshold": THRESHOLD,
                "preroute": {"above": 0.7, "min_seen": 2, "explore": 0},
            }
        },
        "kept": {  # the same, for the restart test (last in this module)
            "cascade": {
                "steps": ["small", "large"],
                "threshold": THRESHOLD,
                "preroute": {"above": 0.7, "min_seen": 2, "explore": 0},
            }
        },
    }
}
STEP = "x-kvgate-cascade-step"
#: ~400 prompt tokens: the repeat of it hits the prefix cache of the small replica that served it.
LONG = "A cascade answers from the small model when it is sure. " * 35


@pytest.fixture(scope="module")
def cascade(tmp_path_factory: pytest.TempPathFactory, model_dir: str) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("cascade")
    engines: list[Child] = []
    try:
        urls = []
        for model, replicas in (("small", 2), ("large", 1)):
            ready = work / f"{model}.ready.json"
            argv = [sys.executable, "-m", "load.sim.server", "--model", model, "--model-dir", model_dir]
            argv += ["--replicas", str(replicas), "--port", "0", "--ready-file", str(ready), *FAST_SIM]
            engines.append(child := Child(model, argv, work / f"{model}.log"))
            urls += [f"http://{r['address']}" for r in child.wait_for_json_file(ready, 120)]
        policy = work / "policy.json"
        policy.write_text(json.dumps(POLICY))
        options = StackOptions(
            port=0,
            model=None,
            endpoints=tuple(urls),
            workdir=work / "stack",
            overlay={"policy": {"file": str(policy)}},
        )
        with Stack(options) as running:
            yield running
    finally:
        for child in engines:
            child.stop()


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


def generated(stack: Stack) -> dict[str, float]:
    """Per engine address: tokens it generated so far (vLLM's counter)."""
    out = {}
    for engine in stack.engines:
        values = samples(f"http://{engine['address']}/metrics")
        out[engine["address"]] = sum(v for (n, _), v in values.items() if n == "vllm:generation_tokens_total")
    return out


def served(stack: Stack, before: dict[str, float]) -> dict[str, str]:
    """Which engines generated tokens since ``before``, each with the model it serves."""
    after = generated(stack)
    models = {e["address"]: stack.served[e["id"]][0] for e in stack.engines}
    return {a: models[a] for a in after if after[a] != before[a]}


def gateway(stack: Stack, name: str, **labels: str) -> float:
    assert stack.info is not None and stack.info.metrics_url
    want = set(labels.items())
    return sum(v for (n, ls), v in samples(stack.info.metrics_url).items() if n == name and want <= set(ls))


def ask(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "auto", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}


def test_a_confident_answer_comes_from_the_small_step(cascade: Stack) -> None:
    before = generated(cascade)
    answers = gateway(cascade, "kvgate_cascade_answers_total", model="auto", step="1")
    raw = client(cascade).chat.completions.with_raw_response.create(**ask("[easy] What is 2 + 2?"))
    done = raw.parse()
    assert raw.headers[STEP] == "1" and raw.headers["content-type"] == "application/json"
    assert done.model == "small" and done.choices[0].message.content
    assert done.choices[0].logprobs is None  # the gate asked for them, the client did not
    assert done.usage is not None and done.usage.completion_tokens == 8
    assert list(served(cascade, before).values()) == ["small"]
    assert gateway(cascade, "kvgate_cascade_answers_total", model="auto", step="1") == answers + 1


def test_the_clients_logprobs_choice_is_honoured(cascade: Stack) -> None:
    done = client(cascade).chat.completions.create(**ask("[easy] Name a colour.", logprobs=True))
    assert done.model == "small" and done.choices[0].logprobs is not None
    content = done.choices[0].logprobs.content or []
    assert len(content) == 8 and all(t.logprob >= -0.1 for t in content)


def test_an_uncertain_answer_escalates_and_comes_from_the_large_step(cascade: Stack) -> None:
    before = generated(cascade)
    gate = gateway(cascade, "kvgate_cascade_escalations_total", model="auto", reason="gate")
    raw = client(cascade).chat.completions.with_raw_response.create(
        **ask("[hard] Prove the Riemann hypothesis.")
    )
    done = raw.parse()
    assert raw.headers[STEP] == "2" and done.model == "large"
    assert done.choices[0].logprobs is None and done.usage is not None
    large = next(e["address"] for e in cascade.engines if cascade.served[e["id"]] == ["large"])
    assert raw.headers["x-kvgate-endpoint"] == large  # proxied by Envoy from the large engine
    assert sorted(served(cascade, before).values()) == ["large", "small"]  # both steps ran
    assert gateway(cascade, "kvgate_cascade_escalations_total", model="auto", reason="gate") == gate + 1
    assert gateway(cascade, "kvgate_cascade_escalation_seconds_count", model="auto") >= 1
    assert gateway(cascade, "kvgate_cascade_gate_stat_count", model="auto") >= 2


@pytest.mark.parametrize("usage", [True, False])
def test_streamed_confident_answer_is_a_valid_sse_stream(cascade: Stack, usage: bool) -> None:
    options = {"stream_options": {"include_usage": True}} if usage else {}
    with client(cascade).chat.completions.with_streaming_response.create(
        **ask("[easy] Say hello.", stream=True, **options)
    ) as response:
        assert response.headers[STEP] == "1"
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = list(response.parse())
    assert all(c.object == "chat.completion.chunk" and c.model == "small" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    totals = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert totals == ([8] if usage else [])


def test_streamed_uncertain_answer_streams_from_the_large_engine(cascade: Stack) -> None:
    before = generated(cascade)
    body = ask("[hard] Explain quantum gravity.", stream=True, max_tokens=24)
    with httpx.stream("POST", f"{cascade.url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers[STEP] == "2"
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert {c["model"] for c in chunks} == {"large"}
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(tokens) >= 3  # token by token from the engine, not one buffered chunk
    assert sorted(served(cascade, before).values()) == ["large", "small"]


def test_the_small_step_is_routed_kv_aware_among_its_replicas(cascade: Stack) -> None:
    first = generated(cascade)
    client(cascade).chat.completions.create(**ask(f"[easy] {LONG} Summarise."))
    (replica,) = served(cascade, first)
    hits = samples(f"http://{replica}/metrics")
    again = generated(cascade)
    client(cascade).chat.completions.create(**ask(f"[easy] {LONG} Summarise."))
    assert list(served(cascade, again)) == [replica]  # the replica that holds the prompt
    after = samples(f"http://{replica}/metrics")
    hit = [k for k in after if k[0] == "vllm:prefix_cache_hits_total"]
    assert hit and sum(after[k] - hits.get(k, 0.0) for k in hit) >= 300  # and it was a cache hit


def test_completions_api(cascade: Stack) -> None:
    raw = client(cascade).completions.with_raw_response.create(
        model="auto", prompt="[easy] One two", max_tokens=4
    )
    done = raw.parse()
    assert raw.headers[STEP] == "1" and done.model == "small" and done.choices[0].logprobs is None
    raw = client(cascade).completions.with_raw_response.create(
        model="auto", prompt="[hard] One two", max_tokens=4
    )
    assert raw.headers[STEP] == "2" and raw.parse().model == "large"


def test_the_virtual_models_are_listed(cascade: Stack) -> None:
    assert [m.id for m in client(cascade).models.list()] == [
        "large",
        "small",
        "auto",
        "early",
        "kept",
        "learnt",
        "replay",
    ]


def test_a_served_model_is_not_cascaded(cascade: Stack) -> None:
    raw = client(cascade).chat.completions.with_raw_response.create(
        model="large", messages=[{"role": "user", "content": "[easy] hi"}], max_tokens=2
    )
    assert raw.parse().model == "large" and STEP not in raw.headers


def test_a_refused_cascade_keeps_the_good_one(cascade: Stack) -> None:
    """``kvgate policy set`` refuses a bad cascade for the running stack's policy file (exit 2, nothing
    written); the stack still answers ``auto`` from its good cascade."""
    from kvgate.policy_cli import main as policy_main

    policy = Path(cascade.options.overlay["policy"]["file"])
    text = policy.read_text()
    bad = '{"cascade": {"steps": ["small", "large"], "threshold": 2}}'
    assert policy_main(["set", "models/auto", bad, "--file", str(policy)]) == 2
    assert policy.read_text() == text
    done = client(cascade).chat.completions.create(**ask("[easy] Still there?"))
    assert done.model == "small"


def test_first_k_cuts_an_uncertain_small_step_short(cascade: Stack) -> None:
    """``first_k``: the small step is streamed to the gateway and closed after 4 unsure tokens (the engine
    aborts it), then the request streams from the large engine."""
    small = next(e["address"] for e in cascade.engines if cascade.served[e["id"]] == ["small"])
    before = generated(cascade)
    body = {**ask("[hard] A long uncertain essay.", stream=True), "model": "early", "max_tokens": 400}
    with httpx.stream("POST", f"{cascade.url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers[STEP] == "2"
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert {json.loads(e[6:])["model"] for e in events[:-1]} == {"large"}
    after = generated(cascade)
    smalls = [e["address"] for e in cascade.engines if cascade.served[e["id"]] == ["small"]]
    cut = sum(after[a] - before[a] for a in smalls)
    assert 4 <= cut < 200, cut  # the small step stopped long before its 400 tokens
    assert small in after


def test_first_k_passes_a_confident_answer_whole(cascade: Stack) -> None:
    raw = client(cascade).chat.completions.with_raw_response.create(
        **{**ask("[easy] Count to ten."), "model": "early"}
    )
    done = raw.parse()
    assert raw.headers[STEP] == "1" and done.model == "small"
    assert done.usage is not None and done.usage.completion_tokens == 8 and done.choices[0].message.content
    assert done.choices[0].logprobs is None


def test_preroute_sends_what_the_gate_escalated_straight_to_the_large_step(cascade: Stack) -> None:
    """``preroute``: after two hard requests escalated by the gate, the third goes straight to ``large``
    (the small engines generate nothing for it); an easy one still takes the small step."""
    smalls = [e["address"] for e in cascade.engines if cascade.served[e["id"]] == ["small"]]
    sdk = client(cascade)
    for n in ("one", "two"):  # 39 characters each: the same length bucket as the third
        raw = sdk.chat.completions.with_raw_response.create(
            **{**ask(f"[hard] an uncertain question number {n}"), "model": "learnt"}
        )
        assert raw.headers[STEP] == "2"
    assert gateway(cascade, "kvgate_cascade_preroutes_total", model="learnt") == 0
    before = generated(cascade)
    raw = sdk.chat.completions.with_raw_response.create(
        **{**ask("[hard] an uncertain question number six"), "model": "learnt"}
    )
    assert raw.headers[STEP] == "2" and raw.parse().model == "large"
    after = generated(cascade)
    assert all(after[a] == before[a] for a in smalls)  # no small step ran
    assert gateway(cascade, "kvgate_cascade_preroutes_total", model="learnt") == 1
    assert gateway(cascade, "kvgate_cascade_answers_total", model="learnt", step="2") == 3
    easy = sdk.chat.completions.with_raw_response.create(**{**ask("[easy] hello"), "model": "learnt"})
    assert easy.headers[STEP] == "1" and easy.parse().model == "small"


def test_replay_streams_a_confident_answer_token_by_token_from_the_small_engine(cascade: Stack) -> None:
    """``replay``: the small step passes on its first 4 tokens and is cut there; the client's request then
    goes to ``small`` again (same seed) through Envoy and its tokens stream from the engine, not in one
    buffered piece. The large engine does nothing; the answer counts for step 1, not as an escalation."""
    smalls = [e["address"] for e in cascade.engines if cascade.served[e["id"]] == ["small"]]
    before = generated(cascade)
    answers = gateway(cascade, "kvgate_cascade_answers_total", model="replay", step="1")
    escalations = gateway(cascade, "kvgate_cascade_escalations_total", model="replay")
    body = {**ask("[easy] Tell a long story.", stream=True, max_tokens=400), "model": "replay"}
    with httpx.stream("POST", f"{cascade.url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers[STEP] == "1"
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert {c["model"] for c in chunks} == {"small"}
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(tokens) >= 3  # token by token from the engine, not one buffered chunk
    assert all(c["choices"][0].get("logprobs") is None for c in tokens)  # the client asked for none
    assert set(served(cascade, before).values()) == {"small"}
    after = generated(cascade)
    made = sum(after[a] - before[a] for a in smalls)
    assert 400 + 4 <= made < 2 * 400, made  # the gated step's first tokens (cut), then the whole replay
    assert gateway(cascade, "kvgate_cascade_answers_total", model="replay", step="1") == answers + 1
    assert gateway(cascade, "kvgate_cascade_escalations_total", model="replay") == escalations


def test_replay_of_a_streamed_completion(cascade: Stack) -> None:
    body = {"model": "replay", "prompt": "[easy] One two three", "max_tokens": 16, "stream": True}
    with httpx.stream("POST", f"{cascade.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers[STEP] == "1"
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert {c["model"] for c in chunks} == {"small"} and events[-1] == "data: [DONE]"
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["text"]]) >= 3


def test_a_restarted_ext_proc_keeps_what_preroute_learnt(cascade: Stack) -> None:
    """The preroute learners are kept across an ext_proc restart (``kvgate up``'s ``[cascade] state_dir``,
    WORKDIR/cascade): two hard requests escalated by the gate, the ext_proc stopped (SIGTERM: it drains and
    writes its learners) and started again; the new process sends the third hard request straight to
    ``large`` (its own preroute counter, the small engines idle). Last in the module: it restarts the
    ext_proc the other tests share."""
    assert cascade.extproc is not None
    smalls = [e["address"] for e in cascade.engines if cascade.served[e["id"]] == ["small"]]
    sdk = client(cascade)
    for n in ("one", "two"):  # 39 characters each: the same length bucket as the third
        raw = sdk.chat.completions.with_raw_response.create(
            **{**ask(f"[hard] an uncertain question number {n}"), "model": "kept"}
        )
        assert raw.headers[STEP] == "2"
    assert cascade.extproc.stop() == 0
    assert (cascade.workdir / "cascade" / "preroute-extproc.json").is_file()
    cascade.extproc.spawn()
    cascade.extproc.await_ready()

    def routed() -> bool | None:
        try:
            got = httpx.post(
                f"{cascade.url}/v1/chat/completions", json={**ask("hi"), "model": "small"}, timeout=10
            )
        except httpx.HTTPError:
            return None
        return True if got.status_code == 200 else None

    poll(routed, 60, "Envoy routing through the restarted ext_proc", interval_s=0.1)
    assert gateway(cascade, "kvgate_cascade_preroutes_total", model="kept") == 0  # a new process
    assert gateway(cascade, "kvgate_cascade_preroute_verdicts", model="kept") == 2  # the two taken back
    assert gateway(cascade, "kvgate_cascade_preroute_restored_total") >= 1
    assert gateway(cascade, "kvgate_cascade_preroute_state_errors_total") == 0
    before = generated(cascade)
    raw = sdk.chat.completions.with_raw_response.create(
        **{**ask("[hard] an uncertain question number six"), "model": "kept"}
    )
    assert raw.headers[STEP] == "2" and raw.parse().model == "large"
    after = generated(cascade)
    assert all(after[a] == before[a] for a in smalls)  # no small step ran
    assert gateway(cascade, "kvgate_cascade_preroutes_total", model="kept") == 1
