"""End to end, disaggregated through node agents: ``kvgate up --agents 2 --prefill 1 --decode 1`` (a local
etcd; agent ``node-0`` runs a simulated engine of role ``prefill``, ``node-1`` one of role ``decode``,
each registered in etcd with its role; the ext_proc learns the fleet from etcd and KV events from the
agents' feeds), real Envoy, the OpenAI SDK. A long request is prefilled on one engine and decoded on the
other; the engines' own counters and logs say so."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from kvgate.dev.procs import http_get
from kvgate.dev.up import Stack, StackOptions
from tests.e2e.conftest import FAST_SIM
from tests.e2e.test_disagg import LONG, MODEL, THRESHOLD, gateway_counter, samples, unique
from tests.polling import poll

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(
        agents=2,
        prefill=1,
        decode=1,
        agent_args=FAST_SIM,
        port=0,
        workdir=tmp_path_factory.mktemp("pd-agents"),
        disaggregation={"mode": "conditional", "min_uncached_tokens": THRESHOLD},
    )
    with Stack(options) as running:
        poll(lambda: endpoints(running) if len(endpoints(running)) == 2 else None, 10, "2 endpoints")
        yield running


def endpoints(stack: Stack) -> dict[str, dict[str, Any]]:
    """The ext_proc's endpoints by id, from its ``/status.json`` (what it learnt from etcd)."""
    got = http_get(f"http://127.0.0.1:{stack.extproc_ports['metrics']}/status.json")
    assert got is not None and got[0] == 200
    return {e["id"]: e for e in json.loads(got[1])["endpoints"]}


def engine_counter(stack: Stack, engine_id: str, name: str) -> float:
    """A counter of the simulated engine's own ``/metrics`` (agents register no metrics URL)."""
    (engine,) = [e for e in stack.engines if e["id"] == engine_id]
    url = f"http://{engine['address']}/metrics"
    return sum(v for (n, _), v in samples(url).items() if n == name)


def ask_long(stack: Stack, salt: int, stream: bool) -> str:
    """A chat request with the long system prompt (and a unique user turn) through the OpenAI SDK; the
    replica that answered (``x-kvgate-replica``), once the answer's text is read in full."""
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    messages: Any = [{"role": "system", "content": LONG}, {"role": "user", "content": unique(salt)}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=5, stream=stream
    )
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    else:
        text = raw.parse().choices[0].message.content or ""
    assert text
    return raw.headers["x-kvgate-replica"]


def test_the_agents_register_their_engines_roles_in_etcd(stack: Stack) -> None:
    assert {e["id"]: e.get("role") for e in stack.engines} == {"sim-0": "prefill", "sim-1": "decode"}
    seen = endpoints(stack)
    assert {k: (v["role"], v["healthy"], v["precise"]) for k, v in seen.items()} == {
        "sim-0": ("prefill", True, True),
        "sim-1": ("decode", True, True),
    }


@pytest.mark.parametrize("stream", [False, True])
def test_a_long_request_is_prefilled_and_decoded_on_the_pair(stack: Stack, stream: bool) -> None:
    prefilled = engine_counter(stack, "sim-0", "kvgate_sim_remote_decodes_total")
    received = engine_counter(stack, "sim-1", "kvgate_sim_remote_prefills_total")
    paired = gateway_counter(stack, "kvgate_pd_decisions_total", mode="disaggregated")
    timed = gateway_counter(stack, "kvgate_pd_prefill_seconds_count", model=MODEL, outcome="ok")
    assert ask_long(stack, int(stream), stream).startswith("sim-1")  # the decode engine streamed it
    assert engine_counter(stack, "sim-0", "kvgate_sim_remote_decodes_total") == prefilled + 1
    assert engine_counter(stack, "sim-1", "kvgate_sim_remote_prefills_total") == received + 1
    assert engine_counter(stack, "sim-1", "kvgate_sim_remote_prefill_tokens_total") > THRESHOLD
    assert gateway_counter(stack, "kvgate_pd_decisions_total", mode="disaggregated") == paired + 1
    assert gateway_counter(stack, "kvgate_pd_prefill_seconds_count", model=MODEL, outcome="ok") == timed + 1
