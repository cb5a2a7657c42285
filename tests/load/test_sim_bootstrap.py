"""SGLang's prefill/decode disaggregation in the simulator: the bootstrap fields, the prefill replica's
bootstrap server and rooms, and a pair of replicas (``--disaggregation-mode prefill|decode``) on
127.0.0.1 getting the same body at once, as SGLang's router sends it."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from load.sim.bootstrap import NO_ROOM, Bootstrap, Handshake, Prefilled, RoomFailed, Rooms, read_bootstrap
from load.sim.engine import EngineConfig
from load.sim.errors import SimError
from load.sim.server import REPLICA_HEADER, SimConfig, SimFleet, build_parser, config_from_args
from load.sim.serving import SglangPd
from load.sim.timing import TimingModel
from tests.load.test_sim_handoff import counters
from tests.load.test_sim_server import MESSAGES, MODEL, model_dir

__all__ = ["model_dir"]  # the fixture

FIELDS = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7}


def test_read_bootstrap() -> None:
    assert read_bootstrap({}, "null") is None
    assert read_bootstrap(FIELDS, "null") is None, "a plain server ignores them"
    assert read_bootstrap(FIELDS, "decode") == Bootstrap("127.0.0.1", 8998, 7)
    assert read_bootstrap({"bootstrap_room": 7}, "prefill") == Bootstrap("", 0, 7)
    for mode in ("prefill", "decode"):
        with pytest.raises(SimError) as refused:
            read_bootstrap({"bootstrap_host": "h", "bootstrap_port": 1}, mode)
        assert refused.value.status == 400 and NO_ROOM in refused.value.message
    for bad in ({"bootstrap_room": "7"}, {"bootstrap_room": -1}, {"bootstrap_room": 1 << 63}):
        with pytest.raises(SimError):
            read_bootstrap({**FIELDS, **bad}, "decode")
    for bad in ({"bootstrap_host": ""}, {"bootstrap_port": None}, {"bootstrap_port": 70000}):
        with pytest.raises(SimError):
            read_bootstrap({**FIELDS, **bad}, "decode")
    assert Bootstrap("::1", 9, 1).address == "[::1]:9"


async def test_rooms_pair_one_prefill_with_one_decode() -> None:
    rooms = Rooms()
    decode = asyncio.create_task(rooms.connect(1, Handshake("d", 32)))  # the decode side may come first
    handshake = await rooms.wait_decode(1, 1.0)
    assert handshake == Handshake("d", 32)
    with pytest.raises(RoomFailed, match="already has"):
        await rooms.connect(1, Handshake("d2", 0))
    rooms.prefilled(1, Prefilled("p", 100, 67))
    assert await decode == Prefilled("p", 100, 67)
    rooms.release(1)
    assert len(rooms) == 0
    # a prefill whose decode never connects times out; one that fails tells its decode why
    with pytest.raises(TimeoutError):
        await rooms.wait_decode(2, 0.01)
    rooms.release(2)
    assert len(rooms) == 0
    decode = asyncio.create_task(rooms.connect(3, Handshake("d", 0)))
    await rooms.wait_decode(3, 1.0)
    rooms.release(3)
    with pytest.raises(RoomFailed, match="ended before"):
        await decode
    assert len(rooms) == 0


def test_the_command_line_takes_sglangs_flags_and_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--model", "m", "--model-dir", "d"]
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "2.5")
    args = build_parser().parse_args([*argv, "--disaggregation-mode", "decode"])
    config = config_from_args(args)
    assert config.sglang_pd == SglangPd("decode", 300.0, 2.5) and config.bootstrap_port == 8998
    args = build_parser().parse_args([*argv, "--disaggregation-mode", "prefill", "--role", "prefill"])
    with pytest.raises(ValueError, match="exclude"):
        config_from_args(args)
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "0")
    with pytest.raises(ValueError, match="BOOTSTRAP_TIMEOUT"):
        config_from_args(build_parser().parse_args(argv))


async def both(
    http: aiohttp.ClientSession, prefill: str, decode: str, body: dict[str, Any]
) -> tuple[tuple[int, bytes], tuple[int, bytes]]:
    """The same body to both servers at once (SGLang's router); each one's status and body."""

    async def post(address: str) -> tuple[int, bytes]:
        async with http.post(f"http://{address}/v1/chat/completions", json=body) as r:
            assert r.headers[REPLICA_HEADER]
            return r.status, await r.read()

    p, d = await asyncio.gather(post(prefill), post(decode))
    return p, d


async def test_a_pair_on_the_wire(model_dir: Path) -> None:
    base = SimConfig(
        MODEL,
        model_dir,
        timing=TimingModel(time_scale=0.01),
        engine=EngineConfig(max_model_len=512),
        bootstrap_port=0,
    )
    async with (
        SimFleet(replace(base, sglang_pd=SglangPd("prefill")), prefix="p") as prefill,
        SimFleet(replace(base, sglang_pd=SglangPd("decode", 300, 0.5)), prefix="d") as decode,
        aiohttp.ClientSession() as http,
    ):
        (record,) = prefill.describe()
        port = record["bootstrap_port"]
        assert isinstance(port, int) and port > 0 and "bootstrap_port" not in decode.describe()[0]
        for address, mode in ((prefill.addresses[0], "prefill"), (decode.addresses[0], "decode")):
            async with http.get(f"http://{address}/get_server_info") as r:
                assert (await r.json())["disaggregation_mode"] == mode
        p_addr, d_addr = prefill.addresses[0], decode.addresses[0]
        boot = f"http://127.0.0.1:{port}"
        async with http.get(f"{boot}/health") as r:
            assert r.status == 200 and await r.text() == "OK"
        minus = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        async with http.get(f"{boot}/route?{minus}") as r:
            info = await r.json()
        assert info["page_size"] == 16 and info["dp_size"] == info["attn_tp_size"] == 1
        async with http.get(f"{boot}/route?{minus.replace('-1', '0')}") as r:
            assert (await r.json()) == {"rank_ip": "127.0.0.1", "rank_port": port}
        async with http.get(f"{boot}/route") as r:
            assert r.status == 400

        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": False}
        fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 42}
        (ps, pb), (ds, db) = await both(http, p_addr, d_addr, {**body, **fields})
        assert ps == 200 and ds == 200
        p_doc, d_doc = orjson.loads(pb), orjson.loads(db)
        assert p_doc["usage"]["completion_tokens"] == 1 and p_doc["choices"][0]["finish_reason"] == "length"
        assert d_doc["usage"]["completion_tokens"] == 5
        # streamed to the decode server (the prefill copy streams too, as SGLang's router sends it)
        (ps, _), (ds, stream) = await both(
            http, p_addr, d_addr, {**body, **fields, "bootstrap_room": 43, "stream": True}
        )
        assert ps == 200 and ds == 200 and stream.endswith(b"data: [DONE]\n\n")

        async with http.get(f"http://{p_addr}/metrics") as r:
            p = counters(await r.text())
        async with http.get(f"http://{d_addr}/metrics") as r:
            text = await r.text()
            d = counters(text)
        assert p["kvgate_sim_remote_decodes_total"] == 2 and p["vllm:prompt_tokens_total"] > 0
        assert d["kvgate_sim_remote_prefills_total"] == 2 and d["kvgate_sim_remote_prefill_tokens_total"] > 0
        assert d["vllm:generation_tokens_total"] == 5 + 5 and "sglang:num_running_reqs" in text
        assert d["sglang:generation_tokens_total"] == 10

        # SGLang's PD servers refuse requests without a room
        for address in (p_addr, d_addr):
            async with http.post(f"http://{address}/v1/chat/completions", json=body) as r:
                assert r.status == 400 and NO_ROOM in (await r.json())["error"]["message"]
        # a room never prefilled: the decode server gives up after its waiting timeout (0.5 s here)
        started = asyncio.get_running_loop().time()
        async with http.post(
            f"http://{d_addr}/v1/chat/completions", json={**body, **fields, "bootstrap_room": 44}
        ) as r:
            assert r.status == 500 and "KVPoll.WaitingForInput" in (await r.json())["error"]["message"]
        assert 0.5 <= asyncio.get_running_loop().time() - started < 5
        # a bootstrap server nobody listens on: 500 at once
        async with http.post(
            f"http://{d_addr}/v1/chat/completions",
            json={**body, **fields, "bootstrap_port": 1, "bootstrap_room": 45},
        ) as r:
            assert r.status == 500 and "Could not fetch prefill" in (await r.json())["error"]["message"]
        # a prefill refused before it reaches its room: the decode partner waits in vain, then fails
        async with http.post(f"http://{p_addr}/_sim/fail_next?n=1") as r:
            assert r.status == 200
        (ps, _), (ds, db) = await both(http, p_addr, d_addr, {**body, **fields, "bootstrap_room": 46})
        assert ps == 500 and ds == 500 and b"WaitingForInput" in db
        async with http.get(f"http://{d_addr}/metrics") as r:
            assert counters(await r.text())["vllm:generation_tokens_total"] == 10
        assert len(prefill.replicas[0].serving.rooms) == 0, "no room left behind"


async def test_a_prefill_whose_decode_never_connects_gives_up(model_dir: Path) -> None:
    config = SimConfig(
        MODEL,
        model_dir,
        timing=TimingModel(time_scale=0.01),
        engine=EngineConfig(max_model_len=512),
        sglang_pd=SglangPd("prefill", bootstrap_timeout_s=0.3),
        bootstrap_port=0,
    )
    async with SimFleet(config) as prefill, aiohttp.ClientSession() as http:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, **FIELDS}
        async with http.post(f"http://{prefill.addresses[0]}/v1/chat/completions", json=body) as r:
            assert r.status == 500 and "KVPoll.Bootstrapping" in (await r.json())["error"]["message"]
        assert len(prefill.replicas[0].serving.rooms) == 0
