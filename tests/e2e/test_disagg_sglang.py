"""End to end, disaggregated with SGLang's protocol: the OpenAI SDK -> real Envoy -> ext_proc -> simulated
SGLang prefill/decode servers (``kvgate up --prefill 2 --decode 1 --pd-protocol sglang``: each replica
started with ``--disaggregation-mode``, registered as engine kind ``sglang``, the prefill replicas with
their ``bootstrap_port``). The gateway sends the client's body with ``bootstrap_host/port/room`` to the
decode replica (Envoy) and to a prefill replica (beside it) at once; the prefill replica computes the
prompt and hands its KV over through its bootstrap server. The engines' counters, logs and KV events say
who prefilled and who decoded.

Unlike vLLM's protocol, a failed SGLang prefill cannot fall back to aggregated serving: the decode server
already waits on the room, and it refuses requests without one. The last tests show what the client gets.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import openai
import pytest

from kvgate.dev.up import Stack, StackOptions
from tests.e2e.conftest import FAST_SIM
from tests.e2e.test_disagg import (
    KV_EVENTS,
    LONG,
    MODEL,
    THRESHOLD,
    ask_long,
    chat_over_mtls,
    client,
    delta,
    engine_counter,
    fail_next,
    gateway_counter,
    log_text,
    stored_blocks,
    stream_long,
    unique,
)
from tests.polling import poll

pytestmark = pytest.mark.e2e
#: The decode replicas' bound on a room's KV (SGLang's variable; its default is 300 s).
WAITING_TIMEOUT_S = 3
PREFILLS = ("prefill-0", "prefill-1")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with pytest.MonkeyPatch.context() as env:  # the simulators inherit it
        env.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", str(WAITING_TIMEOUT_S))
        options = StackOptions(
            prefill=2,
            decode=1,
            pd_protocol="sglang",
            port=0,
            sim_args=(*FAST_SIM, "--kv-events-config", KV_EVENTS),
            workdir=tmp_path_factory.mktemp("pd-sglang"),
            disaggregation={"mode": "conditional", "min_uncached_tokens": THRESHOLD, "prefill_timeout_s": 8},
        )
        with Stack(options) as running:
            yield running


def remote(stack: Stack) -> dict[str, float]:
    """Prefills handed to a decode (prefill replicas), requests decoded after a remote prefill (decode)."""
    names = {"prefill": "kvgate_sim_remote_decodes_total", "decode": "kvgate_sim_remote_prefills_total"}
    return {e["id"]: engine_counter(stack, e["id"], names[e["role"]]) for e in stack.engines}


def moved_to(stack: Stack, before: dict[str, float]) -> tuple[str, dict[str, float]]:
    """The prefill replica that handed one prompt over since ``before`` (its counter rises once its
    transfer is done, by when the decode side has the KV), and every counter's change."""

    def one() -> tuple[str, dict[str, float]] | None:
        moved = delta(before, remote(stack))
        prefills = [r for r in moved if r in PREFILLS]
        return (prefills[0], moved) if len(prefills) == 1 and moved[prefills[0]] == 1 else None

    return poll(one, 10, "one prefill replica's hand-over")


def prompt_tokens(stack: Stack, replica: str) -> float:
    return engine_counter(stack, replica, "vllm:prompt_tokens_total")


def test_the_fleet_registers_as_sglang_with_bootstrap_ports(stack: Stack) -> None:
    kinds = {e["id"]: (e["engine"], e.get("role"), e.get("bootstrap_port")) for e in stack.engines}
    assert {k: v[:2] for k, v in kinds.items()} == {
        "prefill-0": ("sglang", "prefill"),
        "prefill-1": ("sglang", "prefill"),
        "decode-0": ("sglang", "decode"),
    }
    ports = [kinds[p][2] for p in PREFILLS]
    assert all(isinstance(p, int) and p > 0 for p in ports) and kinds["decode-0"][2] is None
    for replica in PREFILLS:  # what the ready file said
        (ready,) = json.loads((stack.workdir / f"{replica}.ready.json").read_text())
        assert ready["bootstrap_port"] == kinds[replica][2]


def test_a_long_request_is_prefilled_on_a_prefill_replica_and_decoded_on_the_decode_replica(
    stack: Stack,
) -> None:
    before = remote(stack)
    prompts = {r: prompt_tokens(stack, r) for r in (*PREFILLS, "decode-0")}
    generated = engine_counter(stack, "decode-0", "vllm:generation_tokens_total")
    stored = {r: stored_blocks(stack, r) for r in before}
    ask_long(stack, 101)
    prefill, moved = moved_to(stack, before)
    assert moved == {prefill: 1, "decode-0": 1}
    # the prefill replica computed the prompt, the decode replica only received it
    assert prompt_tokens(stack, prefill) - prompts[prefill] > THRESHOLD
    assert engine_counter(stack, "decode-0", "kvgate_sim_remote_prefill_tokens_total") > THRESHOLD
    assert engine_counter(stack, "decode-0", "vllm:generation_tokens_total") - generated == 6
    decode_log = log_text(stack, "decode-0")
    assert f"prefilled by engine {prefill} (bootstrap room" in decode_log
    assert "for a remote decode (bootstrap room" in log_text(stack, prefill)
    for replica in (prefill, "decode-0"):  # both published the prompt's blocks (KV events)
        assert stored_blocks(stack, replica) - stored[replica] >= THRESHOLD // 16, replica
    (idle,) = set(PREFILLS) - {prefill}
    assert stored_blocks(stack, idle) == stored[idle]
    assert gateway_counter(stack, "kvgate_pd_decisions_total", mode="disaggregated") >= 1


def test_streamed_disaggregated(stack: Stack) -> None:
    before = remote(stack)
    stream_long(stack, 102)
    _, moved = moved_to(stack, before)
    assert moved["decode-0"] == 1


def test_completions_api_disaggregated(stack: Stack) -> None:
    before = remote(stack)
    done = client(stack).completions.create(model=MODEL, prompt=LONG + unique(103), max_tokens=3)
    assert done.usage is not None and done.usage.completion_tokens == 3
    assert moved_to(stack, before)[1]["decode-0"] == 1


def test_a_short_request_is_paired_too(stack: Stack) -> None:
    """Under the conditional mode a short request would be served by the decode pick alone, but an SGLang
    decode server refuses requests without a bootstrap room: the gateway pairs it anyway."""
    before = remote(stack)
    paired = gateway_counter(stack, "kvgate_pd_decisions_total", mode="disaggregated")
    raw = client(stack).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Short question?"}], max_tokens=4
    )
    assert raw.headers["x-kvgate-replica"] == "decode-0" and raw.parse().usage is not None
    assert moved_to(stack, before)[1]["decode-0"] == 1
    assert gateway_counter(stack, "kvgate_pd_decisions_total", mode="disaggregated") == paired + 1


def test_a_repeated_long_prefix_goes_to_the_prefill_replica_that_holds_it(stack: Stack) -> None:
    prefix = "A shared document the SGLang prefill replicas should not compute twice. " * 40
    picks = []
    for i in range(4):
        before = remote(stack)
        client(stack).chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": prefix}, {"role": "user", "content": unique(110 + i)}],
            max_tokens=2,
        )
        picks.append(moved_to(stack, before)[0])
    assert picks == [picks[0]] * 4


def test_a_failing_prefill_fails_the_request(stack: Stack) -> None:
    """Both halves are sent at once: when the prefill replica refuses its half, the decode replica waits
    on the room until SGLang's waiting timeout and answers 500; no fallback can help it."""
    for replica in PREFILLS:
        fail_next(stack, replica, 1)
    try:
        before = remote(stack)
        errors = gateway_counter(stack, "kvgate_pd_prefill_errors_total", reason="status")
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError, match="WaitingForInput"):
            client(stack).chat.completions.create(
                model=MODEL,
                messages=[{"role": "system", "content": LONG}, {"role": "user", "content": unique(120)}],
                max_tokens=3,
            )
        assert WAITING_TIMEOUT_S <= time.monotonic() - started < WAITING_TIMEOUT_S + 5
        assert delta(before, remote(stack)) == {}
        assert gateway_counter(stack, "kvgate_pd_prefill_errors_total", reason="status") == errors + 1
    finally:
        for replica in PREFILLS:
            fail_next(stack, replica, 0)


def test_with_the_prefill_replicas_down_the_gateway_answers_503(stack: Stack) -> None:
    """Last (it stops the prefill replicas): once the gateway's scrapes see no prefill replica up, no
    pair can be made, and the decode replica cannot serve alone (SGLang's decode server refuses a request
    without a room, 400): the gateway answers 503 ``no_prefill_endpoint`` at once. (Paired just before
    the gateway noticed, a request fails with the decode replica's 500: it cannot reach the room's
    bootstrap server.)"""
    for sim in stack.sims:
        if sim.name in PREFILLS:
            sim.stop()
    poll(
        lambda: (
            all(gateway_counter(stack, "kvgate_endpoint_healthy", endpoint=p) == 0 for p in PREFILLS) or None
        ),
        10,
        "the gateway to see the prefill replicas down",
    )
    served = engine_counter(stack, "decode-0", "vllm:generation_tokens_total")
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as failed:
        client(stack).chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": LONG}, {"role": "user", "content": unique(130)}],
            max_tokens=3,
        )
    assert failed.value.status_code == 503 and "no_prefill_endpoint" in str(failed.value.body)
    assert time.monotonic() - started < WAITING_TIMEOUT_S
    assert engine_counter(stack, "decode-0", "vllm:generation_tokens_total") == served


def test_an_mtls_fleet_pairs_too(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``--secure``: the engines' HTTP ports take only engine callers' certificates (the ext_proc's prefill
    half uses its client certificate); the bootstrap server is plain HTTP, as SGLang's."""
    options = StackOptions(
        prefill=1,
        decode=1,
        pd_protocol="sglang",
        port=0,
        sim_args=FAST_SIM,
        workdir=tmp_path_factory.mktemp("pd-sglang-secure"),
        secure=True,
        disaggregation={"mode": "disaggregated"},
    )
    with Stack(options) as secure:
        chat_over_mtls(secure)
        assert "prefilled by engine prefill-0 (bootstrap room" in log_text(secure, "decode-0")
        assert gateway_counter(secure, "kvgate_pd_prefill_errors_total") == 0
