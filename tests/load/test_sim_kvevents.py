"""The simulator's vLLM KV events on the wire: a real replica on 127.0.0.1, read with plain ZMQ sockets
and a plain msgpack decoder (not the agent's), so the format itself is what is checked."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from contracts.digest import block_digests, chain_seed
from load.sim.engine import EngineConfig
from load.sim.kvevents import KvEventBuffer, KvEventPublisher, KvEventsConfig, endpoint_for_rank
from load.sim.server import SimConfig, SimFleet, SimReplica, build_parser, config_from_args, main
from load.sim.serving import SglangPd
from load.sim.timing import TimingModel
from load.sim.tokenizer import load_tokenizer
from tests.load.test_sim_server import MESSAGES, MODEL
from tests.load.test_sim_server import model_dir as model_dir  # the tiny tokenizer fixture

EVENTS = KvEventsConfig(
    enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0"
)
STORED_FIELDS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"}


def sim_config(model_dir: Path, **engine: Any) -> SimConfig:
    return SimConfig(
        MODEL,
        model_dir,
        timing=TimingModel(time_scale=0),
        engine=EngineConfig(max_model_len=512, **engine),
        kv_events=EVENTS,
    )


class Wire:
    """A subscriber made of raw sockets: SUB on the replica's PUB, DEALER on its ROUTER."""

    def __init__(self, replica: SimReplica, http: aiohttp.ClientSession) -> None:
        assert replica.kv_events is not None
        self.replica, self.http = replica, http
        self.base = f"http://{replica.address}"
        self.ctx = zmq.asyncio.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(replica.kv_events.address)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(replica.kv_events.replay_address)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.dealer.close(linger=0)
        self.ctx.term()

    async def post(self, path: str) -> Any:
        async with self.http.post(self.base + path) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.read()

    async def recv(self, wait_s: float = 5.0) -> tuple[int, list[Any], list[bytes]]:
        """The next live batch: (seq, decoded payload, frames)."""
        frames = await asyncio.wait_for(self.sub.recv_multipart(), wait_s)
        assert len(frames) == 3 and frames[0] == b"" and len(frames[1]) == 8
        return int.from_bytes(frames[1], "big"), msgspec.msgpack.decode(frames[2]), frames

    async def joined(self) -> int:
        """Wait until the subscription is live (PUB drops what a joining SUB misses): reset the cache
        until an AllBlocksCleared arrives; the seq of that batch."""
        deadline = time.monotonic() + 10
        while True:
            await self.post("/reset_prefix_cache")
            try:
                seq, payload, _ = await self.recv(0.05)
            except TimeoutError:
                assert time.monotonic() < deadline, "the SUB socket never received a batch"
                continue
            assert payload[1] == [{"type": "AllBlocksCleared"}]
            return seq

    async def until(self, pred: Any) -> list[tuple[int, list[Any]]]:
        """Live batches up to and including the first whose events satisfy ``pred``."""
        out = []
        while True:
            seq, payload, _ = await self.recv()
            out.append((seq, payload))
            if pred(payload[1]):
                return out

    async def replay(self, start: int) -> list[list[bytes]]:
        """Every reply to a replay request from ``start``, the end marker included."""
        await self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies = []
        while True:
            frames = await asyncio.wait_for(self.dealer.recv_multipart(), 5)
            replies.append(frames)
            if frames[1] == (-1).to_bytes(8, "big", signed=True):
                return replies


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def fleet(model_dir: Path) -> AsyncIterator[SimFleet]:
    async with SimFleet(sim_config(model_dir), 2) as fleet:
        yield fleet


@pytest.fixture
async def wire(fleet: SimFleet, http: aiohttp.ClientSession) -> AsyncIterator[Wire]:
    w = Wire(fleet.replicas[0], http)
    yield w
    w.close()


def has(kind: str) -> Any:
    return lambda events: any(e["type"] == kind for e in events)


async def test_chat_publishes_block_stored_that_rehashes_to_the_sims_digests(
    fleet: SimFleet, wire: Wire, http: aiohttp.ClientSession
) -> None:
    await wire.joined()
    async with http.post(f"{wire.base}/tokenize", json={"model": MODEL, "messages": MESSAGES}) as resp:
        prompt = (await resp.json())["tokens"]
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40}
    async with http.post(f"{wire.base}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
    n_blocks = (len(prompt) + 40 - 1) // 16  # full blocks of prompt + output (the last token: never computed)
    tokens: list[int] = []
    hashes: list[int] = []
    seqs = []
    while len(hashes) < n_blocks:
        seq, payload, _ = await wire.recv()
        seqs.append(seq)
        ts, events, rank = payload
        assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
        for event in events:
            assert event["type"] == "BlockStored"
            assert set(event) >= STORED_FIELDS and event["lora_name"] is None and event["lora_id"] is None
            assert event["medium"] == "GPU" and event["block_size"] == 16 and event.get("group_idx") == 0
            assert event["parent_block_hash"] == (hashes[-1] if hashes else None)
            assert len(event["token_ids"]) == 16 * len(event["block_hashes"])
            assert all(isinstance(h, int) and 0 <= h < 2**64 for h in event["block_hashes"])
            hashes += event["block_hashes"]
            tokens += event["token_ids"]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert len(hashes) == n_blocks and len(set(hashes)) == n_blocks
    assert tokens[: len(prompt) // 16 * 16] == prompt[: len(prompt) // 16 * 16]
    digests = block_digests(chain_seed(MODEL), tokens, 16)
    engine = fleet.replicas[0].engine
    assert engine.cache.match(digests) == n_blocks  # the sim's own digests of what it cached
    assert not {int.from_bytes(d[:8], "big") for d in digests} & set(hashes)  # engine hashes are not digests
    # The other replica is data-parallel rank 1 with its own sockets.
    records = fleet.describe()
    assert records[0]["kv_events"] == fleet.replicas[0].kv_events.address  # type: ignore[union-attr]
    assert records[0]["kv_events"] != records[1]["kv_events"] != records[1]["kv_events_replay"]
    assert all(r["kv_events"].startswith("tcp://127.0.0.1:") for r in records)


async def test_reset_publishes_all_blocks_cleared_and_replay_ends_with_minus_one(wire: Wire) -> None:
    first = await wire.joined()
    body = {"model": MODEL, "prompt": list(range(3, 40)), "max_tokens": 2}
    async with wire.http.post(f"{wire.base}/v1/completions", json=body) as resp:
        assert resp.status == 200
    live = await wire.until(has("BlockStored"))
    await wire.post("/reset_prefix_cache")
    live += await wire.until(has("AllBlocksCleared"))
    assert live[-1][1][1] == [{"type": "AllBlocksCleared"}]
    last = live[-1][0]
    replies = await wire.replay(first)
    assert replies[-1] == [b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert [int.from_bytes(r[1], "big") for r in replies[:-1]] == list(range(first, last + 1))
    assert all(r[0] == b"" for r in replies)
    replayed = {int.from_bytes(r[1], "big"): msgspec.msgpack.decode(r[2]) for r in replies[:-1]}
    assert all(replayed[seq] == payload for seq, payload in live)  # byte-identical batches
    assert (await wire.replay(last + 1)) == [[b"", (-1).to_bytes(8, "big", signed=True), b""]]


async def test_drop_hook_makes_a_gap_that_replay_fills(wire: Wire) -> None:
    first = await wire.joined()
    assert msgspec.json.decode(await wire.post("/_sim/drop_next_kv_batches?n=2")) == {"dropping": 2}
    for _ in range(3):
        await wire.post("/reset_prefix_cache")
    seq, payload, _ = await wire.recv()
    assert seq == first + 3 and payload[1] == [{"type": "AllBlocksCleared"}]
    replies = await wire.replay(first + 1)
    assert [int.from_bytes(r[1], "big") for r in replies[:-1]] == [first + 1, first + 2, first + 3]
    replica = wire.replica
    assert replica.kv_events is not None and replica.kv_events.skipped == 2


async def test_eviction_under_a_tiny_cache_publishes_block_removed(
    model_dir: Path, http: aiohttp.ClientSession
) -> None:
    async with SimFleet(sim_config(model_dir, num_blocks=34), 1) as fleet:
        wire = Wire(fleet.replicas[0], http)
        try:
            await wire.joined()
            stored: set[int] = set()
            # Two unrelated 300-token prompts: 19 blocks each, 34 in the cache.
            for prompt in (list(range(3, 303)), list(range(302, 2, -1))):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 8}
                async with http.post(f"{wire.base}/v1/completions", json=body) as resp:
                    assert resp.status == 200
            batches = await wire.until(has("BlockRemoved"))
            removed: list[int] = []
            for _, (_, events, _) in batches:
                for event in events:
                    if event["type"] == "BlockStored":
                        stored.update(event["block_hashes"])
                    elif event["type"] == "BlockRemoved":
                        assert event["medium"] == "GPU"
                        removed += event["block_hashes"]
            assert removed and set(removed) <= stored
        finally:
            wire.close()


def test_config_keys_are_vllms_and_unknown_ones_are_named() -> None:
    cfg = KvEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv",'
        ' "replay_endpoint": "tcp://*:5558", "buffer_steps": 8, "hwm": 10, "max_queue_size": 5}'
    )
    assert cfg.enabled and cfg.topic == "kv" and cfg.buffer_steps == 8
    assert KvEventsConfig.from_json('{"enable_kv_cache_events": true}').publisher == "zmq"
    assert not KvEventsConfig.from_json('{"enable_kv_cache_events": false}').enabled
    assert not KvEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    for bad, match in [
        ('{"enable_kv_cache_events": true, "endpoints": "x"}', "'endpoints'"),
        ('{"buffer_steps": "8"}', "'buffer_steps'"),
        ('{"publisher": "kafka"}', "kafka"),
        ('{"endpoint": "udp://x:1"}', "udp"),
        ("[1]", "object"),
        ("{", "JSON"),
    ]:
        with pytest.raises(ValueError, match=match):
            KvEventsConfig.from_json(bad)


@pytest.mark.parametrize(
    ("endpoint", "rank", "want"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 3, "tcp://*:5560"),
        ("tcp://127.0.0.1:0", 2, "tcp://127.0.0.1:0"),
        ("tcp://[::1]:7000", 1, "tcp://[::1]:7001"),
        ("ipc:///tmp/kv", 1, "ipc:///tmp/kv_dp1"),
    ],
)
def test_endpoint_for_rank(endpoint: str, rank: int, want: str) -> None:
    assert endpoint_for_rank(endpoint, rank) == want


def test_cli_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", MODEL, "--model-dir", str(tmp_path)]
    args = build_parser().parse_args([*base, "--kv-events-config", '{"enable_kv_cache_events": true}'])
    kv = config_from_args(args).kv_events
    assert kv is not None and kv.enabled and kv.endpoint == "tcp://*:5557"
    assert config_from_args(build_parser().parse_args(base)).kv_events is None
    assert main([*base, "--kv-events-config", '{"hwm": 1, "bogus": 2}']) == 2
    assert "'bogus'" in capsys.readouterr().err


def test_buffer_queues_one_burst_and_names_blocks_by_engine_hash() -> None:
    calls: list[None] = []
    buffer = KvEventBuffer(16, hash_key=b"k" * 16, on_pending=lambda: calls.append(None))
    seed = chain_seed(MODEL)
    d = block_digests(seed, list(range(48)), 16)
    buffer.on_stored(d[:2], list(range(32)), None)
    buffer.on_stored(d[2:], list(range(32, 48)), d[1])
    buffer.on_removed(d[2:])
    buffer.on_cleared()
    assert len(calls) == 1  # one flush per burst
    events = [msgspec.to_builtins(e) for e in buffer.take()]
    hashes = [buffer.engine_hash(x) for x in d]
    common = {"block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0}
    assert events == [
        {"type": "BlockStored", "block_hashes": hashes[:2], "parent_block_hash": None, **common,
         "token_ids": list(range(32))},
        {"type": "BlockStored", "block_hashes": hashes[2:], "parent_block_hash": hashes[1], **common,
         "token_ids": list(range(32, 48))},
        {"type": "BlockRemoved", "block_hashes": hashes[2:], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
    ]  # fmt: skip
    assert buffer.take() == []
    other = KvEventBuffer(16, hash_key=b"j" * 16)
    assert other.engine_hash(d[0]) != hashes[0]  # per-replica key, as vLLM's per-process NONE_HASH


async def test_a_replica_standing_for_sglang_publishes_sglangs_positional_events() -> None:
    """SGLang's publisher (``sglang/srt/disaggregation/kv_events.py``) encodes each event as an array
    tagged first, without vLLM's ``medium``/``lora_name``/``extra_keys``/``group_idx``, and the batch as
    ``[ts, events, attn_dp_rank]``."""
    publisher = KvEventPublisher(EVENTS, 0, 4, sglang=True)
    await publisher.start()
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.address)
    try:
        deadline = time.monotonic() + 10
        while True:  # PUB drops what a joining SUB misses: clear until one batch arrives
            publisher.buffer.on_cleared()
            publisher.flush()
            try:
                frames = await asyncio.wait_for(sub.recv_multipart(), 0.05)
                break
            except TimeoutError:
                assert time.monotonic() < deadline
        assert msgspec.msgpack.decode(frames[2])[1:] == [[["AllBlocksCleared"]], 0]
        digests = block_digests(chain_seed(MODEL), [1, 2, 3, 4, 5, 6, 7, 8], 4)
        publisher.buffer.on_stored(digests, [1, 2, 3, 4, 5, 6, 7, 8], None)
        publisher.buffer.on_removed(digests[1:])
        publisher.flush()
        ts, events, rank = msgspec.msgpack.decode((await asyncio.wait_for(sub.recv_multipart(), 5))[2])
        h = [publisher.buffer.engine_hash(d) for d in digests]
        assert isinstance(ts, float) and rank == 0
        stored = ["BlockStored", h, None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None]
        assert events == [stored, ["BlockRemoved", h[1:]]]
    finally:
        sub.close(linger=0)
        ctx.term()
        await publisher.aclose()


async def test_only_a_replica_in_sglangs_disaggregation_mode_publishes_sglangs_shape(
    model_dir: Path,
) -> None:
    """Construction only (no sockets bound): the mode that registers as engine kind ``sglang``."""
    tokenizer = load_tokenizer(model_dir)
    for mode, want in (("decode", True), ("prefill", True), ("null", False)):
        config = replace(sim_config(model_dir), sglang_pd=SglangPd(mode))
        replica = SimReplica("sim-0", config, tokenizer)
        assert replica.kv_events is not None and replica.kv_events.sglang is want
