"""End to end, disaggregated: the OpenAI SDK -> real Envoy -> ext_proc -> a prefill/decode pair of
simulated vLLM replicas (``kvgate up --prefill 2 --decode 1``, the model's route ``conditional`` from 256
uncached tokens). The engines' own counters, logs and KV events say who prefilled and who decoded."""

from __future__ import annotations

import json
import ssl
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from contracts.errors import ConfigError
from kvgate.dev.procs import http_get
from kvgate.dev.up import Stack, StackOptions
from tests.e2e.conftest import FAST_SIM

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
THRESHOLD = 256
#: The route's bound on a prefill: past Envoy's 5 s ext_proc message timeout (kvgate/envoy/bootstrap.py).
PREFILL_TIMEOUT_S = 8
#: Every replica publishes vLLM KV events (ZMQ, ephemeral ports; read back here through replay).
KV_EVENTS = json.dumps(
    {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://127.0.0.1:0",
        "replay_endpoint": "tcp://127.0.0.1:0",
    }
)
#: ~700 prompt tokens: past the threshold for any decode replica that does not hold it.
LONG = "Disaggregated serving computes the prompt on one replica and decodes on another. " * 50


def unique(i: int, n: int = 60) -> str:
    """~5 tokens a word, distinct per ``i``: a suffix no replica holds."""
    return " ".join(f"q{i}x{j}" for j in range(n))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(
        prefill=2,
        decode=1,
        port=0,
        sim_args=(*FAST_SIM, "--kv-events-config", KV_EVENTS),
        workdir=tmp_path_factory.mktemp("pd-stack"),
        disaggregation={
            "mode": "conditional",
            "min_uncached_tokens": THRESHOLD,
            "prefill_timeout_s": PREFILL_TIMEOUT_S,
        },
    )
    with Stack(options) as running:
        yield running


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    got = http_get(url)
    assert got is not None and got[0] == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(got[1].decode())
        for s in family.samples
    }


def engine_counter(stack: Stack, replica: str, name: str) -> float:
    (engine,) = [e for e in stack.engines if e["id"] == replica]
    return sum(v for (n, _), v in samples(engine["metrics_url"]).items() if n == name)


def gateway_counter(stack: Stack, name: str, **labels: str) -> float:
    assert stack.info is not None and stack.info.metrics_url
    want = set(labels.items())
    return sum(v for (n, ls), v in samples(stack.info.metrics_url).items() if n == name and want <= set(ls))


def remote(stack: Stack) -> dict[str, float]:
    """Each replica's handoff counter: prefills answered for a remote decode (prefill replicas), requests
    decoded after a remote prefill (decode replicas)."""
    names = {"prefill": "kvgate_sim_remote_decodes_total", "decode": "kvgate_sim_remote_prefills_total"}
    return {e["id"]: engine_counter(stack, e["id"], names[e["role"]]) for e in stack.engines}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before if after[k] != before[k]}


def _stored(event: Any) -> int:
    """Blocks a ``BlockStored`` event announces: vLLM's (a map with ``type``) or SGLang's (a positional
    array, its tag first, then the block hashes: a replica in SGLang's mode publishes SGLang's shape)."""
    if isinstance(event, dict):
        return len(event["block_hashes"]) if event["type"] == "BlockStored" else 0
    return len(event[1]) if event[0] == "BlockStored" else 0


def stored_blocks(stack: Stack, replica: str) -> int:
    """Blocks the replica announced in ``BlockStored`` KV events so far (its replay from seq 0)."""
    (ready,) = json.loads((stack.workdir / f"{replica}.ready.json").read_text())
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        dealer.connect(ready["kv_events_replay"])
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        blocks = 0
        while True:
            frames = dealer.recv_multipart()
            if frames[1] == (-1).to_bytes(8, "big", signed=True):
                return blocks
            events = msgspec.msgpack.decode(frames[2])[1]
            blocks += sum(_stored(e) for e in events)
    finally:
        dealer.close(linger=0)
        ctx.term()


def log_text(stack: Stack, child: str) -> str:
    assert stack.info is not None
    return Path(stack.info.logs[child]).read_text()


def test_the_fleet_has_roles(stack: Stack) -> None:
    assert {e["id"]: e.get("role") for e in stack.engines} == {
        "prefill-0": "prefill",
        "prefill-1": "prefill",
        "decode-0": "decode",
    }


def ask_long(stack: Stack, n: int) -> None:
    """A chat of the long prompt with question ``n``: 6 tokens of answer, from the decode replica."""
    raw = client(stack).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": LONG}, {"role": "user", "content": unique(n)}],
        max_tokens=6,
    )
    done = raw.parse()
    assert raw.headers["x-kvgate-replica"] == "decode-0"
    assert done.usage is not None and done.usage.completion_tokens == 6 and done.choices[0].message.content


def test_a_long_request_is_prefilled_on_a_prefill_replica_and_decoded_on_the_decode_replica(
    stack: Stack,
) -> None:
    before = remote(stack)
    generated = engine_counter(stack, "decode-0", "vllm:generation_tokens_total")
    stored = {r: stored_blocks(stack, r) for r in before}
    ask_long(stack, 1)
    moved = delta(before, remote(stack))
    assert moved.pop("decode-0") == 1
    assert list(moved.values()) == [1], moved  # exactly one prefill replica computed the prompt
    (prefill,) = moved
    assert engine_counter(stack, "decode-0", "vllm:generation_tokens_total") - generated == 6
    assert engine_counter(stack, "decode-0", "kvgate_sim_remote_prefill_tokens_total") > THRESHOLD
    assert f"prefilled by engine {prefill}" in log_text(stack, "decode-0")
    assert "for a remote decode" in log_text(stack, prefill)
    # both engines published the prompt's blocks (KV events): computed on one, received on the other
    for replica in (prefill, "decode-0"):
        assert stored_blocks(stack, replica) - stored[replica] >= THRESHOLD // 16, replica
    (idle,) = {"prefill-0", "prefill-1"} - {prefill}
    assert stored_blocks(stack, idle) == stored[idle]
    assert gateway_counter(stack, "kvgate_pd_decisions_total", mode="disaggregated") >= 1


def stream_long(stack: Stack, n: int) -> None:
    """A streamed chat of the long prompt with question ``n``: text, and usage counting its 8 tokens."""
    stream = client(stack).chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": LONG}, {"role": "user", "content": unique(n)}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert text and usage and usage[-1].completion_tokens == 8


def test_streamed_disaggregated(stack: Stack) -> None:
    before = remote(stack)
    stream_long(stack, 2)
    moved = delta(before, remote(stack))
    assert moved.pop("decode-0") == 1 and list(moved.values()) == [1]


def test_completions_api_disaggregated(stack: Stack) -> None:
    before = remote(stack)
    done = client(stack).completions.create(model=MODEL, prompt=LONG + unique(3), max_tokens=3)
    assert done.usage is not None and done.usage.completion_tokens == 3
    assert delta(before, remote(stack)).get("decode-0") == 1


def test_a_short_request_is_served_aggregated(stack: Stack) -> None:
    before = remote(stack)
    cached = gateway_counter(stack, "kvgate_pd_decisions_total", mode="aggregated", reason="cached")
    raw = client(stack).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Short question?"}], max_tokens=4
    )
    assert raw.headers["x-kvgate-replica"] == "decode-0"
    assert raw.parse().usage is not None
    assert delta(before, remote(stack)) == {}
    assert (
        gateway_counter(stack, "kvgate_pd_decisions_total", mode="aggregated", reason="cached") == cached + 1
    )


def test_a_repeated_long_prefix_goes_to_the_prefill_replica_that_holds_it(stack: Stack) -> None:
    prefix = "A shared document the prefill replicas should not compute twice. " * 40
    picks = []
    for i in range(4):
        before = remote(stack)
        client(stack).chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": prefix}, {"role": "user", "content": unique(10 + i)}],
            max_tokens=2,
        )
        moved = delta(before, remote(stack))
        assert moved.pop("decode-0") == 1, "each suffix is long enough to disaggregate"
        (pick,) = moved
        picks.append(pick)
    assert picks == [picks[0]] * 4


def fail_next(stack: Stack, replica: str, n: int) -> None:
    (engine,) = [e for e in stack.engines if e["id"] == replica]
    url = f"http://{engine['address']}/_sim/fail_next?n={n}"
    with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=5) as answer:
        assert answer.status == 200


def delay_next(stack: Stack, replica: str, n: int, seconds: float) -> None:
    (engine,) = [e for e in stack.engines if e["id"] == replica]
    url = f"http://{engine['address']}/_sim/delay_next?n={n}&s={seconds}"
    with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=5) as answer:
        assert answer.status == 200


def slow_prefill_is_waited_for(stack: Stack) -> None:
    """A 6 s prefill (longer than Envoy's 5 s ext_proc message timeout) still disaggregates."""
    prefills = [e["id"] for e in stack.engines if e.get("role") == "prefill"]
    for replica in prefills:
        delay_next(stack, replica, 1, 6.0)
    try:
        before = remote(stack)
        started = time.monotonic()
        raw = client(stack).chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "system", "content": LONG}, {"role": "user", "content": unique(40)}],
            max_tokens=3,
        )
        assert time.monotonic() - started >= 6.0
        assert raw.headers["x-kvgate-replica"] == "decode-0" and raw.parse().usage is not None
        moved = delta(before, remote(stack))
        assert moved.pop("decode-0") == 1 and list(moved.values()) == [1], "disaggregated, not a fallback"
    finally:
        for replica in prefills:
            delay_next(stack, replica, 0, 0.0)


def test_a_prefill_longer_than_envoys_message_timeout_is_waited_for(stack: Stack) -> None:
    """Streamed bodies (the bundled default): Envoy runs no message timer while it waits
    (tests/kvgate/envoy/test_message_timeout.py); the stream idle timeout bounds the wait."""
    slow_prefill_is_waited_for(stack)


def test_buffered_bodies_wait_for_the_prefill_through_override_message_timeout(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Buffered bodies (``--fail-open``): Envoy's 5 s message timer runs, and only the held request's
    ``override_message_timeout`` (the prefill's bound + 5 s) keeps it from giving up on the ext_proc."""
    options = StackOptions(
        prefill=1,
        decode=1,
        fail_open=True,
        port=0,
        sim_args=(*FAST_SIM, "--kv-events-config", KV_EVENTS),
        workdir=tmp_path_factory.mktemp("pd-buffered"),
        disaggregation={"mode": "disaggregated", "prefill_timeout_s": PREFILL_TIMEOUT_S},
    )
    with Stack(options) as buffered:
        slow_prefill_is_waited_for(buffered)


def test_a_prefill_past_its_timeout_is_served_aggregated(stack: Stack) -> None:
    for replica in ("prefill-0", "prefill-1"):
        delay_next(stack, replica, 1, 60.0)
    try:
        before = remote(stack)
        timeouts = gateway_counter(stack, "kvgate_pd_fallbacks_total", reason="timeout")
        started = time.monotonic()
        raw = client(stack).chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "system", "content": LONG}, {"role": "user", "content": unique(50)}],
            max_tokens=3,
        )
        assert PREFILL_TIMEOUT_S <= time.monotonic() - started < PREFILL_TIMEOUT_S + 5
        assert raw.headers["x-kvgate-replica"] == "decode-0" and raw.parse().usage is not None
        assert delta(before, remote(stack)) == {}
        assert gateway_counter(stack, "kvgate_pd_fallbacks_total", reason="timeout") == timeouts + 1
    finally:
        for replica in ("prefill-0", "prefill-1"):
            delay_next(stack, replica, 0, 0.0)


def test_a_failing_prefill_replica_still_serves_the_request_aggregated(stack: Stack) -> None:
    for replica in ("prefill-0", "prefill-1"):
        fail_next(stack, replica, 100)
    try:
        before = remote(stack)
        fallbacks = gateway_counter(stack, "kvgate_pd_fallbacks_total", reason="status")
        prompts = engine_counter(stack, "decode-0", "vllm:prompt_tokens_total")
        raw = client(stack).chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "system", "content": LONG}, {"role": "user", "content": unique(30)}],
            max_tokens=5,
        )
        assert raw.headers["x-kvgate-replica"] == "decode-0"
        assert raw.parse().usage is not None
        assert delta(before, remote(stack)) == {}, "no handoff: the decode replica computed the prompt"
        assert engine_counter(stack, "decode-0", "vllm:prompt_tokens_total") - prompts > THRESHOLD
        assert gateway_counter(stack, "kvgate_pd_fallbacks_total", reason="status") == fallbacks + 1
    finally:
        for replica in ("prefill-0", "prefill-1"):
            fail_next(stack, replica, 0)


@pytest.mark.parametrize(
    "options",
    [
        {"prefill": 1},
        {"decode": 2},
        {"prefill": 1, "decode": 1, "endpoints": ("http://127.0.0.1:1",)},
        {"prefill": 1, "decode": 1, "agents": 3},  # --agents N+M only
        {"prefill": 1, "decode": 1, "agents": 2, "agent_engine": "llama_cpp"},  # agents: the sim engine
    ],
)
def test_prefill_and_decode_go_together(options: dict[str, object], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--prefill"):
        Stack(StackOptions(port=0, workdir=tmp_path, **options)).start()  # type: ignore[arg-type]
    assert not list(tmp_path.glob("*.log")), "nothing was started"


def chat_over_mtls(secure: Stack) -> None:
    """A chat through the ``--secure`` stack's edge (its CA trusted), served by the decode replica."""
    ctx = ssl.create_default_context(cafile=str(secure.certs["envoy-edge"].ca))
    with httpx.Client(verify=ctx, timeout=30) as http:
        sdk = openai.OpenAI(base_url=f"{secure.url}/v1", api_key="unused", max_retries=0, http_client=http)
        raw = sdk.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi over mTLS"}], max_tokens=3
        )
    assert raw.headers["x-kvgate-replica"] == "decode-0" and raw.parse().usage is not None


def test_the_prefill_sub_request_speaks_mtls_to_engines(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``--secure``: engines accept only certificates of engine callers; the ext_proc's prefill request
    uses its client certificate (the scraper's files), so the pair still works."""
    options = StackOptions(
        prefill=1,
        decode=1,
        port=0,
        sim_args=FAST_SIM,
        workdir=tmp_path_factory.mktemp("pd-secure"),
        secure=True,
        disaggregation={"mode": "disaggregated"},
    )
    with Stack(options) as secure:
        chat_over_mtls(secure)
        assert gateway_counter(secure, "kvgate_pd_decisions_total", mode="disaggregated") == 1
        assert gateway_counter(secure, "kvgate_pd_fallbacks_total") == 0
        assert "prefilled by engine prefill-0" in log_text(secure, "decode-0")
