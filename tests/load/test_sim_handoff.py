"""Prefill/decode disaggregation in the simulator: the engine's remote prefill, the transfer time, and
two replicas (prefill, decode) speaking vLLM's ``kv_transfer_params`` on 127.0.0.1."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from contracts.digest import Digest, chain_seed
from load.sim.engine import Engine, EngineConfig
from load.sim.errors import SimError
from load.sim.handoff import NONE, Transfer, read_transfer
from load.sim.server import REPLICA_HEADER, SimConfig, SimFleet
from load.sim.timing import TimingModel
from tests.load.test_sim_engine import drain, out, prompt, ttft
from tests.load.test_sim_server import MESSAGES, MODEL, model_dir

__all__ = ["model_dir"]  # the fixture


class Stored:
    def __init__(self) -> None:
        self.blocks = 0

    def on_stored(
        self,
        digests: Sequence[Digest],
        token_ids: Sequence[int],
        parent: Digest | None,
        lora: str | None = None,
        salt: str | None = None,
    ) -> None:
        self.blocks += len(digests)

    def on_removed(self, digests: Sequence[Digest]) -> None: ...

    def on_cleared(self) -> None: ...


def test_transfer_time() -> None:
    timing = TimingModel()
    assert timing.transfer_s(6000) == pytest.approx(6000 * 131_072 / 50e9)
    assert TimingModel(time_scale=0.5, kv_bytes_per_token=1000, link_bytes_per_s=1e6).transfer_s(10) == 0.005
    with pytest.raises(ValueError):
        TimingModel(link_bytes_per_s=0)


def test_a_remote_prefill_decodes_without_computing_the_prompt() -> None:
    timing = TimingModel()
    listener = Stored()
    engine = Engine(EngineConfig(), timing, chain_seed("m"), listener)
    engine.add_request("d", prompt(3000), out(4), now=0.0, remote_prefill=True)
    events, _ = drain(engine)
    # one step with one prompt token (the last), not 3000 in two chunks
    assert ttft(events["d"]) == pytest.approx(timing.step_s(0, 1))
    assert engine.stats.remote_prefills == 1 and engine.stats.remote_prefill_tokens == 2999
    assert listener.blocks >= 3000 // 16, "the received blocks are registered (KV events)"
    local = Engine(EngineConfig(), timing, chain_seed("m"))
    local.add_request("a", prompt(3000), out(4), now=0.0)
    events, _ = drain(local)
    assert ttft(events["a"]) > 10 * timing.step_s(0, 1)


def test_a_remote_prefill_counts_only_what_is_not_cached() -> None:
    engine = Engine(EngineConfig(), TimingModel(), chain_seed("m"))
    engine.add_request("a", prompt(1600), out(1), now=0.0)
    drain(engine)
    assert engine.cached_prefix_tokens(prompt(3200)) == 1600
    engine.add_request("d", prompt(3200), out(1), now=1.0, remote_prefill=True)
    drain(engine, 1.0)
    assert engine.stats.remote_prefill_tokens == 3199 - 1600
    assert len(engine.prompt_blocks(prompt(3200))) == 200


@pytest.mark.parametrize(
    ("body", "role", "expected"),
    [
        ({}, "prefill", NONE),
        ({"kv_transfer_params": {"do_remote_decode": True}}, "both", NONE),
        ({"kv_transfer_params": {"do_remote_decode": True}}, "prefill", Transfer(remote_decode=True)),
        ({"kv_transfer_params": {"do_remote_decode": False}}, "decode", NONE),
    ],
)
def test_read_transfer(body: dict[str, Any], role: str, expected: Transfer) -> None:
    assert read_transfer(body, role) == expected


def test_read_transfer_refuses_unusable_params() -> None:
    with pytest.raises(SimError) as caught:
        read_transfer({"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "h"}}, "decode")
    assert caught.value.status == 400 and "remote_engine_id" in caught.value.message
    with pytest.raises(SimError):
        read_transfer({"kv_transfer_params": [1]}, "decode")


def counters(text: str) -> dict[str, float]:
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.endswith("_total")
    }


async def test_prefill_then_decode_on_the_wire(model_dir: Path) -> None:
    base = SimConfig(
        MODEL, model_dir, timing=TimingModel(time_scale=0.01), engine=EngineConfig(max_model_len=512)
    )
    async with (
        SimFleet(replace(base, role="prefill"), prefix="p") as prefill,
        SimFleet(replace(base, role="decode"), prefix="d") as decode,
        aiohttp.ClientSession() as http,
    ):
        chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "stream": False}
        params = {"do_remote_decode": True, "do_remote_prefill": False}
        url = f"http://{prefill.addresses[0]}/v1/chat/completions"
        async with http.post(url, json={**chat, "kv_transfer_params": params}) as r:
            assert r.status == 200 and r.headers[REPLICA_HEADER] == "p-0"
            answer = await r.json()
        handed = answer["kv_transfer_params"]
        host, port = prefill.addresses[0].rsplit(":", 1)
        assert handed["do_remote_prefill"] is True and handed["do_remote_decode"] is False
        assert (handed["remote_engine_id"], handed["remote_host"], handed["remote_port"]) == (
            "p-0",
            host,
            int(port),
        )
        assert handed["remote_block_ids"] and handed["tp_size"] == 1
        url = f"http://{decode.addresses[0]}/v1/chat/completions"
        async with http.post(
            url, json={**chat, "max_tokens": 5, "stream": True, "kv_transfer_params": handed}
        ) as r:
            assert r.status == 200 and r.headers[REPLICA_HEADER] == "d-0"
            assert (await r.read()).endswith(b"data: [DONE]\n\n")
        async with http.post(url, json={**chat, "kv_transfer_params": {"do_remote_prefill": True}}) as r:
            assert r.status == 400
        async with http.get(f"http://{prefill.addresses[0]}/metrics") as r:
            p = counters(await r.text())
        async with http.get(f"http://{decode.addresses[0]}/metrics") as r:
            d = counters(await r.text())
        assert p["kvgate_sim_remote_decodes_total"] == 1 and p["kvgate_sim_remote_prefills_total"] == 0
        assert d["kvgate_sim_remote_prefills_total"] == 1 and d["kvgate_sim_remote_prefill_tokens_total"] > 0
        assert d["vllm:generation_tokens_total"] == 5
        tokens = d["kvgate_sim_remote_prefill_tokens_total"]
        assert d["kvgate_sim_remote_prefill_seconds_total"] == pytest.approx(
            base.timing.transfer_s(int(tokens))
        )
        # the fault hook: the next request fails with a 500, the one after succeeds
        async with http.post(f"http://{prefill.addresses[0]}/_sim/fail_next?n=1") as r:
            assert r.status == 200
        url = f"http://{prefill.addresses[0]}/v1/chat/completions"
        async with http.post(url, json=chat) as r:
            assert r.status == 500 and (await r.json())["error"]["code"] == 500
        async with http.post(url, json=chat) as r:
            assert r.status == 200 and (await r.json())["kv_transfer_params"] is None
        async with http.post(f"http://{prefill.addresses[0]}/_sim/delay_next?n=1&s=0.3") as r:
            assert r.status == 200
        started = asyncio.get_running_loop().time()
        async with http.post(url, json=chat) as r:
            assert r.status == 200
        assert asyncio.get_running_loop().time() - started >= 0.3
        async with http.post(f"http://{prefill.addresses[0]}/_sim/delay_next?n=1&s=-1") as r:
            assert r.status == 400


def itl_of_a_decode_beside_a_long_prompt(remote_prefill: bool) -> float:
    """The longest gap between the tokens of a decoding request while a 6,000-token prompt arrives
    (computed on this replica, or prefilled elsewhere and received)."""
    engine = Engine(EngineConfig(), TimingModel(), chain_seed("m"))
    engine.add_request("a", prompt(100), out(40), now=0.0)
    times: list[float] = []
    t = 0.0
    while engine.has_work():
        step = engine.schedule(t)
        assert step is not None
        t = step.end
        times += [t for e in engine.complete(step) if e.request_id == "a"]
        if len(times) == 5:
            engine.add_request("b", prompt(6000, start=5000), out(10), now=t, remote_prefill=remote_prefill)
    return max(b - a for a, b in itertools.pairwise(times[1:]))


def test_prefill_interference_is_what_disaggregation_removes() -> None:
    timing = TimingModel()
    aggregated = itl_of_a_decode_beside_a_long_prompt(remote_prefill=False)
    decode_only = itl_of_a_decode_beside_a_long_prompt(remote_prefill=True)
    # a 2,048-token chunk shares the decode's step: ~108 ms instead of ~6 ms
    assert aggregated == pytest.approx(timing.step_s(1, 2047))
    assert decode_only == pytest.approx(timing.step_s(2, 0))  # one more sequence decoding, that is all
    assert aggregated > 10 * decode_only
