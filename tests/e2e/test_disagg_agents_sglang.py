"""End to end, SGLang's prefill/decode protocol through node agents: ``kvgate up --agents 2 --prefill 1
--decode 1 --pd-protocol sglang`` (a local etcd; agent ``node-0`` runs an engine of kind ``sglang`` and
role ``prefill``, ``node-1`` one of role ``decode``; each agent renders SGLang's command line, picks the
prefill server's bootstrap port as its side port and registers the engine in etcd with engine kind
``sglang``, its role and, for the prefill server, that ``bootstrap_port``). No GPU here: the engines'
``command`` is ``load.sim.sglang_launch``, the simulator taking SGLang's flags. The ext_proc learns the
fleet from etcd; real Envoy; the OpenAI SDK. A long request is prefilled by the prefill engine and
decoded by the decode engine through the bootstrap room; the engines' own counters say so."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from contracts.etcd import EtcdSettings, endpoint_key
from kvgate.dev.procs import http_get
from kvgate.dev.up import Stack, StackOptions
from runtime.etcd import connect
from tests.e2e.conftest import FAST_SIM
from tests.e2e.test_disagg import THRESHOLD, gateway_counter
from tests.e2e.test_disagg_agents import ask_long, endpoints, engine_counter
from tests.polling import poll

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(
        agents=2,
        prefill=1,
        decode=1,
        pd_protocol="sglang",
        agent_args=FAST_SIM,
        port=0,
        workdir=tmp_path_factory.mktemp("pd-agents-sglang"),
        disaggregation={"mode": "conditional", "min_uncached_tokens": THRESHOLD, "prefill_timeout_s": 8},
    )
    with Stack(options) as running:
        poll(lambda: endpoints(running) if len(endpoints(running)) == 2 else None, 10, "2 endpoints")
        yield running


def registered(stack: Stack, endpoint_id: str, node: str) -> dict[str, Any]:
    """The endpoint record an agent wrote to etcd (``/kvgate/endpoints/<node>/<id>``, JSON)."""
    assert stack.etcd is not None
    settings = EtcdSettings(endpoints=(stack.etcd.address,), timeout_s=5.0)

    async def get() -> dict[str, Any]:
        client = await connect(settings)
        try:
            assert client.kv is not None
            got = await client.kv.get(endpoint_key("/kvgate/", endpoint_id, node), timeout=5.0)
            (kv,) = got.kvs
            record: dict[str, Any] = json.loads(bytes(kv.value))
            return record
        finally:
            await client.close()

    return asyncio.run(get())


def test_the_agents_register_sglang_engines_with_roles_and_the_bootstrap_port(stack: Stack) -> None:
    assert {e["id"]: (e["engine"], e.get("role")) for e in stack.engines} == {
        "sim-0": ("sglang", "prefill"),
        "sim-1": ("sglang", "decode"),
    }
    config = json.loads(stack.agent_configs[0].read_text())
    (engine,) = config["engines"]
    assert (engine["kind"], engine["kv_offload"], engine["command"][-1]) == (
        "sglang",
        "nixl",
        "load.sim.sglang_launch",
    )
    seen = endpoints(stack)
    assert {k: (v["engine"], v["role"], v["healthy"]) for k, v in seen.items()} == {
        "sim-0": ("sglang", "prefill", True),
        "sim-1": ("sglang", "decode", True),
    }
    prefill, decode = registered(stack, "sim-0", "node-0"), registered(stack, "sim-1", "node-1")
    assert (prefill["engine"], prefill["role"], decode["engine"], decode["role"]) == (
        "sglang",
        "prefill",
        "sglang",
        "decode",
    )
    port = prefill["bootstrap_port"]
    assert isinstance(port, int) and port > 0 and decode.get("bootstrap_port") is None
    # the prefill engine's bootstrap server answers there (SGLang's GET /health on the bootstrap port)
    host = prefill["address"].rpartition(":")[0]
    got = http_get(f"http://{host}:{port}/health")
    assert got is not None and got[0] == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_long_request_is_prefilled_and_decoded_through_a_bootstrap_room(stack: Stack, stream: bool) -> None:
    prefilled = engine_counter(stack, "sim-0", "kvgate_sim_remote_decodes_total")
    received = engine_counter(stack, "sim-1", "kvgate_sim_remote_prefills_total")
    paired = gateway_counter(stack, "kvgate_pd_decisions_total", mode="disaggregated")
    assert ask_long(stack, 50 + stream, stream).startswith("sim-1")  # the decode engine streamed it
    assert engine_counter(stack, "sim-1", "kvgate_sim_remote_prefills_total") == received + 1
    assert engine_counter(stack, "sim-1", "kvgate_sim_remote_prefill_tokens_total") > THRESHOLD
    # the prefill engine's hand-over counter rises once its transfer is done
    poll(
        lambda: engine_counter(stack, "sim-0", "kvgate_sim_remote_decodes_total") == prefilled + 1 or None,
        10,
        "the prefill engine's hand-over",
    )
    assert gateway_counter(stack, "kvgate_pd_decisions_total", mode="disaggregated") == paired + 1
