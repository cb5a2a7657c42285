"""vLLM KV events on the agent side: decoder tables, sequence checking, and the subscriber against a
fake engine (test-owned ZMQ sockets) and against a real simulated replica, translated end to end."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq

from agent.config import AgentSection
from agent.kvevents import (
    LIVE_HWM,
    MAX_MESSAGE_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventsLost,
    KvBatch,
    KvEventDecodeError,
    KvEventSubscriber,
    SeqChecker,
    SeqVerdict,
    SubscriberConfig,
    decode_message,
    decode_payload,
)
from agent.launch import render
from agent.main import feed_batches
from agent.supervisor import make_private_dir
from agent.translate import Translator
from contracts.digest import block_digests, chain_seed
from contracts.events import Cleared, EndpointId, IndexEvent, Stored
from engines.config import EngineConfig as EngineSpec
from extproc.index.precise import PreciseIndex
from load.sim.engine import EngineConfig
from load.sim.kvevents import KvEventsConfig
from load.sim.server import SimConfig, SimFleet, SimReplica
from load.sim.timing import TimingModel
from tests.agent.conftest import FakeEngine
from tests.load.test_sim_server import MODEL
from tests.load.test_sim_server import model_dir as model_dir  # the tiny tokenizer fixture

pack = msgspec.msgpack.encode
TOKENS = list(range(32))
STORED_MAP = {
    "type": "BlockStored",
    "block_hashes": [1, 2**64 - 1],
    "parent_block_hash": None,
    "token_ids": TOKENS,
    "block_size": 16,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "group_idx": 0,
}
STORED = BlockStored([1, 2**64 - 1], None, TOKENS, 16, None, "GPU", None, None, 0)


@pytest.mark.parametrize(
    ("payload", "events", "rank"),
    [
        # vLLM 0.33: array batch, map events (defaults omitted), rank stamped.
        ([1.5, [STORED_MAP], 0], [STORED], 0),
        (
            [1.5, [{"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"}], 2],
            [BlockRemoved([7], "CPU")],
            2,
        ),
        ([1.5, [{"type": "AllBlocksCleared"}], None], [AllBlocksCleared()], None),
        # Map batch (vLLM main), fields vLLM may add later ignored.
        (
            {"ts": 1.5, "events": [{**STORED_MAP, "kv_cache_spec_kind": "full", "locality": "x"}]},
            [STORED],
            None,
        ),
        # Older releases: positional events with the tag first, batch without a rank.
        (
            [1.5, [["BlockStored", [1, 2**64 - 1], None, TOKENS, 16, None], ["BlockRemoved", [1]]]],
            [BlockStored([1, 2**64 - 1], None, TOKENS, 16), BlockRemoved([1])],
            None,
        ),
        (
            [1.5, [["BlockStored", [3], 9, TOKENS[:16], 16, 4, "CPU", "adapter"], ["AllBlocksCleared"]], 1],
            [BlockStored([3], 9, TOKENS[:16], 16, 4, "CPU", "adapter"), AllBlocksCleared()],
            1,
        ),
        # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: raw digests as bytes.
        (
            [1.5, [{**STORED_MAP, "block_hashes": [b"\x01" * 32], "parent_block_hash": b"\x02" * 32}], 0],
            [BlockStored([b"\x01" * 32], b"\x02" * 32, TOKENS, 16, None, "GPU", None, None, 0)],
            0,
        ),
        ([1.5, [], 0], [], 0),
    ],
)
def test_decode_payload(payload: Any, events: list[Any], rank: int | None) -> None:
    batch = decode_payload(pack(payload), 7)
    assert batch == KvBatch(7, 1.5, events, rank)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        pack([1.5, [{"type": "BlockMoved", "block_hashes": [1]}], 0]),
        pack([1.5, [{**STORED_MAP, "token_ids": ["a"]}], 0]),
        pack([1.5, [["BlockRemoved", "x"]], 0]),
        pack({"events": []}),
        pack("batch"),
    ],
)
def test_decode_payload_rejects(payload: bytes) -> None:
    with pytest.raises(KvEventDecodeError, match="not a vLLM KV event batch"):
        decode_payload(payload)


def test_decode_message() -> None:
    payload = pack([1.5, [{"type": "AllBlocksCleared"}], 0])
    assert decode_message([b"kv", (2**40).to_bytes(8, "big"), payload]).seq == 2**40
    assert decode_message([(3).to_bytes(8, "big"), payload]).seq == 3
    for frames in ([payload], [b"", b"\x00", payload], [b"", b"", b"", payload]):
        with pytest.raises(KvEventDecodeError, match="frames"):
            decode_message(frames)


@pytest.mark.parametrize(
    ("start", "steps"),
    [
        (None, [("live", 5, SeqVerdict.APPLY, 6), ("live", 6, SeqVerdict.APPLY, 7)]),
        (0, [("live", 0, SeqVerdict.APPLY, 1), ("live", 3, SeqVerdict.GAP, 1)]),
        (
            4,
            [
                ("live", 7, SeqVerdict.GAP, 4),
                ("replay", 4, SeqVerdict.APPLY, 5),
                ("replay", 5, SeqVerdict.APPLY, 6),
                ("replay", 6, SeqVerdict.APPLY, 7),
                ("replay", 7, SeqVerdict.APPLY, 8),
                ("replay", 7, SeqVerdict.DUPLICATE, 8),  # the live one that revealed the gap
                ("live", 6, SeqVerdict.DUPLICATE, 8),  # queued on SUB during the replay
                ("live", 8, SeqVerdict.APPLY, 9),
                ("live", 0, SeqVerdict.RESTART, 1),  # caught up: going back is a new engine
            ],
        ),
        (2, [("replay", 5, SeqVerdict.GAP, 2), ("live", 1, SeqVerdict.DUPLICATE, 2)]),
        (9, [("live", 3, SeqVerdict.RESTART, 4), ("live", 4, SeqVerdict.APPLY, 5)]),
    ],
)
def test_seq_checker(start: int | None, steps: list[tuple[str, int, SeqVerdict, int]]) -> None:
    checker = SeqChecker(start)
    for kind, seq, verdict, next_seq in steps:
        got = checker.check(seq) if kind == "live" else checker.check_replayed(seq)
        assert (got, checker.next_seq) == (verdict, next_seq), (kind, seq)


class Collector:
    """Runs a subscriber in a task and queues what it yields."""

    def __init__(self, subscriber: KvEventSubscriber) -> None:
        self.subscriber = subscriber
        self.items: asyncio.Queue[KvBatch | EventsLost] = asyncio.Queue()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for item in self.subscriber:
            self.items.put_nowait(item)

    async def next(self) -> KvBatch | EventsLost:
        return await asyncio.wait_for(self.items.get(), 5)

    async def until(self, pred: Callable[[KvBatch | EventsLost], bool]) -> list[KvBatch | EventsLost]:
        out = [await self.next()]
        while not pred(out[-1]):
            out.append(await self.next())
        return out

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.subscriber.aclose()


async def joined(engine: FakeEngine, collector: Collector) -> int:
    """Publish numbered batches until the subscriber has one; the next seq to publish."""
    deadline = time.monotonic() + 10
    while collector.items.empty():
        assert time.monotonic() < deadline
        engine.send()
        await asyncio.sleep(0.02)  # pacing the handshake batches; the loop condition is the check
    await collector.until(lambda item: isinstance(item, KvBatch) and item.seq == engine.seq - 1)
    return engine.seq


async def subscribe(config: SubscriberConfig) -> Collector:
    subscriber = KvEventSubscriber(config)
    await subscriber.start()
    return Collector(subscriber)


async def test_gap_without_replay_restart_and_undecodable_are_reported(fake_engine: FakeEngine) -> None:
    pub, _ = fake_engine.endpoints()
    collector = await subscribe(SubscriberConfig(pub))
    try:
        n = await joined(fake_engine, collector)
        fake_engine.send(n + 2)  # n, n + 1 never sent
        assert await collector.next() == EventsLost(n, n + 2, "gap")
        assert (await collector.next()).seq == n + 2  # type: ignore[union-attr]
        fake_engine.send(n + 3, b"\xc1")
        assert await collector.next() == EventsLost(n + 3, n + 4, "undecodable")
        fake_engine.send(0)  # the engine restarted
        assert await collector.next() == EventsLost(None, 0, "restart")
        batch = await collector.next()
        assert isinstance(batch, KvBatch) and batch.seq == 0 and batch.events == [AllBlocksCleared()]
        stats = collector.subscriber.stats
        assert (stats.lost_reports, stats.undecodable, stats.replay_requests) == (3, 1, 0)
    finally:
        await collector.close()


async def test_replay_that_does_not_answer_reports_the_gap(fake_engine: FakeEngine) -> None:
    pub, replay = fake_engine.endpoints()
    collector = await subscribe(SubscriberConfig(pub, replay, replay_timeout_s=0.2))
    try:
        n = await joined(fake_engine, collector)
        fake_engine.send(n + 1)
        assert await collector.next() == EventsLost(n, n + 1, "gap")
        assert (await collector.next()).seq == n + 1  # type: ignore[union-attr]
        assert collector.subscriber.stats.replay_timeouts == 1
    finally:
        await collector.close()


@pytest.mark.parametrize("buffered", [3, 4])
async def test_a_replay_over_max_replay_batches_is_given_up_as_lost(
    fake_engine: FakeEngine, buffered: int
) -> None:
    """At most ``max_replay_batches`` are taken from a replay: a longer one is reported lost (its batches
    dropped) and the next live batch sets the position."""
    fake_engine.answer_replays(buffered)
    pub, replay = fake_engine.endpoints()
    collector = await subscribe(SubscriberConfig(pub, replay, catch_up=True, max_replay_batches=3))
    try:
        first = await collector.next()
        stats = collector.subscriber.stats
        if buffered == 3:
            assert [first, await collector.next(), await collector.next()] == [
                KvBatch(seq, 1.5, [AllBlocksCleared()], 0) for seq in range(3)
            ]
            assert stats.replay_truncated == 0
            return
        assert first == EventsLost(0, None, "replay_limit")
        assert (stats.replay_truncated, stats.replayed, stats.lost_reports) == (1, 0, 1)
        fake_engine.seq = 100  # the engine is far ahead of its buffer's start
        assert await joined(fake_engine, collector) > 100  # followed live from the first batch received
        dealer = collector.subscriber._dealer
        assert dealer is None  # closed: the rest of the answer is not read as the next replay's
    finally:
        await collector.close()


async def test_sockets_bound_message_size_and_queue(fake_engine: FakeEngine) -> None:
    fake_engine.answer_replays()
    pub, replay = fake_engine.endpoints()
    collector = await subscribe(SubscriberConfig(pub, replay, catch_up=True, max_replay_batches=7))
    try:
        n = await joined(fake_engine, collector)
        assert n > 0
        sub, dealer = collector.subscriber._sub, collector.subscriber._dealer
        assert sub is not None and dealer is not None
        assert sub.getsockopt(zmq.MAXMSGSIZE) == dealer.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES
        assert (sub.getsockopt(zmq.RCVHWM), dealer.getsockopt(zmq.RCVHWM)) == (LIVE_HWM, 8)
    finally:
        await collector.close()


def test_subscriber_config() -> None:
    with pytest.raises(ValueError, match="max_replay_batches"):
        SubscriberConfig("tcp://127.0.0.1:1", max_replay_batches=0)
    with pytest.raises(ValueError, match="replay_endpoint"):
        SubscriberConfig("tcp://127.0.0.1:1", catch_up=True)
    with pytest.raises(ValueError, match="replay_timeout_s"):
        SubscriberConfig("tcp://127.0.0.1:1", replay_timeout_s=0)


def sim_config(model_dir: Path, **events: Any) -> SimConfig:
    kv = KvEventsConfig(True, "zmq", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", **events)
    engine = EngineConfig(max_model_len=512)
    return SimConfig(MODEL, model_dir, timing=TimingModel(time_scale=0), engine=engine, kv_events=kv)


class Replica:
    """A simulated replica's HTTP side, as the tests drive it."""

    def __init__(self, replica: SimReplica, http: aiohttp.ClientSession) -> None:
        assert replica.kv_events is not None
        self.replica, self.publisher, self.http = replica, replica.kv_events, http
        self.base = f"http://{replica.address}"

    def config(self) -> SubscriberConfig:
        return SubscriberConfig(self.publisher.address, self.publisher.replay_address, catch_up=True)

    async def post(self, path: str, body: Any = None) -> None:
        async with self.http.post(self.base + path, json=body) as resp:
            assert resp.status == 200, await resp.text()

    async def complete(self, prompt: list[int], max_tokens: int) -> None:
        await self.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})

    async def joined(self, collector: Collector) -> list[KvBatch | EventsLost]:
        """Reset the cache until the subscriber receives a live batch (the SUB socket has joined), then
        read up to the last batch published."""
        deadline = time.monotonic() + 10
        while collector.subscriber.stats.received == 0:
            assert time.monotonic() < deadline
            await self.post("/reset_prefix_cache")
            await asyncio.sleep(0.02)  # pacing; the loop condition is the check
        return await self.caught_up(collector)

    async def caught_up(self, collector: Collector) -> list[KvBatch | EventsLost]:
        last = self.publisher.next_seq - 1
        return await collector.until(lambda item: isinstance(item, KvBatch) and item.seq == last)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_subscriber_replays_gaps_and_translation_matches_the_sim(
    model_dir: Path, http: aiohttp.ClientSession
) -> None:
    async with SimFleet(sim_config(model_dir), 1) as fleet:
        sim = Replica(fleet.replicas[0], http)
        await sim.complete(list(range(3, 40)), 2)  # published before anyone subscribes
        collector = await subscribe(sim.config())
        try:
            items = await sim.joined(collector)
            assert [i.seq for i in items if isinstance(i, KvBatch)] == list(range(sim.publisher.next_seq))
            assert not [i for i in items if isinstance(i, EventsLost)]  # catch-up replayed from seq 0
            same = Translator("sim-0", MODEL, 16)
            coarse = Translator("sim-0", MODEL, 32)  # index blocks of two engine blocks
            a, b = list(range(3, 103)), list(range(300, 200, -1))
            await sim.post("/_sim/drop_next_kv_batches?n=2")
            await sim.complete(a, 20)
            await sim.complete(b, 20)
            items = await sim.caught_up(collector)
            assert not [i for i in items if isinstance(i, EventsLost)]
            seqs = [i.seq for i in items if isinstance(i, KvBatch)]
            assert seqs == list(range(seqs[0], seqs[-1] + 1))
            assert collector.subscriber.stats.replay_requests == 2  # the catch-up and the gap
            stored: dict[int, list[bytes]] = {16: [], 32: []}
            for item in items:
                assert isinstance(item, KvBatch)
                for translator in (same, coarse):
                    for event in translator.apply(item.events):
                        assert isinstance(event, Stored) and event.tier == "gpu"
                        stored[translator.block_size] += event.digests
            cache, seed = fleet.replicas[0].engine.cache, chain_seed(MODEL)
            for prompt in (a, b):
                want = block_digests(seed, prompt, 16)
                assert cache.match(want) == len(want)  # the sim holds the prompt's blocks
                assert set(want) <= set(stored[16])
                assert set(block_digests(seed, prompt, 32)) <= set(stored[32])
            # What the translator believes the engine holds is exactly what the sim's cache holds.
            held = {d for event in same.snapshot() if isinstance(event, Stored) for d in event.digests}
            assert len(held) == cache.num_cached and all(cache.match([d]) for d in held)
        finally:
            await collector.close()


async def test_a_catch_up_arrives_at_once_and_folds_into_the_engines_state(
    model_dir: Path, http: aiohttp.ClientSession
) -> None:
    """The catch-up replay is received whole (``take_ready`` hands over the rest of it after the first
    batch), and :func:`feed_batches` sends it as one ``Cleared`` + snapshot batch that leaves a gateway's
    index where the batch-by-batch translation does: with what the engine holds."""
    async with SimFleet(sim_config(model_dir), 1) as fleet:
        sim = Replica(fleet.replicas[0], http)
        gone, kept = list(range(3, 103)), [list(range(110 + 60 * k, 174 + 60 * k)) for k in range(3)]
        await sim.complete(gone, 4)
        await sim.post("/reset_prefix_cache")  # in the history, not in the engine's state
        for prompt in kept:
            await sim.complete(prompt, 4)
        published = sim.publisher.next_seq  # all before anyone subscribes
        subscriber = KvEventSubscriber(sim.config())
        await subscriber.start()
        try:
            first = await asyncio.wait_for(anext(subscriber), 10)
            items = [first, *subscriber.take_ready()]
            assert [i.seq for i in items if isinstance(i, KvBatch)] == list(range(published))
            assert subscriber.take_ready() == []
        finally:
            await subscriber.aclose()
    folded = feed_batches(Translator("sim-0", MODEL, 16), items, coalesce_at=4)
    stepwise = feed_batches(Translator("sim-0", MODEL, 16), items, coalesce_at=len(items) + 1)
    assert len(folded) == 1 and folded[0][0] == Cleared("sim-0", None) and len(stepwise) > 4
    cache, seed, endpoint = fleet.replicas[0].engine.cache, chain_seed(MODEL), EndpointId("sim-0")
    for batches in (folded, stepwise):
        index = PreciseIndex()
        for events in batches:
            index.apply(events, 0.0)
        assert index.occupancy() == {endpoint: cache.num_cached}
        assert index.match(block_digests(seed, gone, 16), 0.0) == {}
        for prompt in kept:
            want = block_digests(seed, prompt, 16)
            assert index.match(want, 0.0) == {endpoint: cache.match(want)} == {endpoint: len(want)}


def test_feed_batches_below_the_threshold_keeps_each_batch_and_maps_losses_to_clears() -> None:
    translator = Translator("e", MODEL, 16)
    tokens = list(range(1000, 1032))
    stored = BlockStored([1, 2], None, tokens, 16, None, "GPU", None, None, 0)
    items: list[KvBatch | EventsLost] = [
        KvBatch(0, 0.0, [stored]),
        KvBatch(1, 0.0, []),  # nothing to say: no feed batch
        EventsLost(2, 3, "gap"),
    ]
    out: list[list[IndexEvent]] = feed_batches(translator, items)
    assert out == [
        [Stored("e", block_digests(chain_seed(MODEL), tokens, 16), "gpu", None)],
        [Cleared("e", None)],
    ]
    assert translator.num_blocks == 0


async def test_gap_beyond_the_replay_buffer_is_reported(model_dir: Path, http: aiohttp.ClientSession) -> None:
    async with SimFleet(sim_config(model_dir, buffer_steps=1), 1) as fleet:
        sim = Replica(fleet.replicas[0], http)
        collector = await subscribe(sim.config())
        try:
            await sim.joined(collector)
            first = sim.publisher.next_seq
            await sim.post("/_sim/drop_next_kv_batches?n=3")
            for _ in range(4):
                await sim.post("/reset_prefix_cache")
            items = await sim.caught_up(collector)
            assert items == [
                EventsLost(first, first + 3, "gap"),
                KvBatch(first + 3, items[-1].ts, [AllBlocksCleared()], 0),  # type: ignore[union-attr]
            ]
        finally:
            await collector.close()


async def test_aclose_ends_an_iteration_waiting_for_a_batch(fake_engine: FakeEngine) -> None:
    pub, _ = fake_engine.endpoints()
    subscriber = KvEventSubscriber(SubscriberConfig(pub))
    await subscriber.start()
    items = [item async for item in _close_soon(subscriber)]
    assert items == []
    assert [item async for item in subscriber] == []  # closed: stays ended


async def _close_soon(subscriber: KvEventSubscriber) -> AsyncIterator[KvBatch | EventsLost]:
    closer = asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(subscriber.aclose()))
    try:
        async for item in subscriber:
            yield item
    finally:
        closer.cancel()


def test_a_batch_the_translator_fails_on_is_lost_events_not_a_pump_failure() -> None:
    """Counted, reported as a ``Cleared`` (as lost events are), and the engine's later batches go on."""

    class Failing(Translator):
        def apply(self, events: Any) -> list[IndexEvent]:
            if any(isinstance(e, BlockStored) and e.block_hashes == [666] for e in events):
                raise TypeError("malformed")
            return super().apply(events)

    translator = Failing("e", MODEL, 16)
    tokens = list(range(1000, 1016))
    seed = chain_seed(MODEL)
    items: list[KvBatch | EventsLost] = [
        KvBatch(0, 0.0, [BlockStored([1], None, tokens, 16, None, "GPU", None, None, 0)]),
        KvBatch(1, 0.0, [BlockStored([666], None, tokens, 16, None, "GPU", None, None, 0)]),
        KvBatch(2, 0.0, [BlockStored([2], None, tokens, 16, None, "GPU", None, None, 0)]),
    ]
    assert feed_batches(translator, items) == [
        [Stored("e", block_digests(seed, tokens, 16), "gpu", None)],
        [Cleared("e", None)],
        [Stored("e", block_digests(seed, tokens, 16), "gpu", None)],
    ]
    assert translator.stats.failed_batches == 1


async def test_an_agent_launched_engine_publishes_on_a_private_unix_socket(
    tmp_path: Path, model_dir: Path, http: aiohttp.ClientSession
) -> None:
    """The real path, end to end but in process: the ``--kv-events-config`` the agent renders for a sim
    it starts (``ipc://`` sockets under its state directory, in a directory it makes mode 0700), read by
    the sim as its server reads it, and the agent's subscriber (as :meth:`agent.main.Agent._subscribe`
    builds it) catching up over the replay socket and following live batches there."""
    agent = AgentSection(id="node-a", state_dir=str(tmp_path / "state"))
    spec = EngineSpec(id="sim-0", kind="sim", model=MODEL, model_path=str(model_dir), kv_events=True)
    launch = render(spec, agent, port=8000)
    argv = launch.argv
    rendered = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert rendered["endpoint"] == launch.kv_events_endpoint and launch.kv_events_endpoint is not None
    assert rendered["replay_endpoint"] == launch.kv_replay_endpoint and launch.kv_replay_endpoint is not None
    assert launch.kv_events_endpoint.startswith(f"ipc://{tmp_path}/state/kv/kv-")
    assert not [a for a in argv if "tcp://" in a]
    (private,) = launch.private_dirs
    make_private_dir(private)  # what the supervisor does before the start
    kv = KvEventsConfig.from_json(argv[argv.index("--kv-events-config") + 1])
    config = SimConfig(
        MODEL, model_dir, timing=TimingModel(time_scale=0), engine=EngineConfig(), kv_events=kv
    )
    async with SimFleet(config, 1) as fleet:
        sim = Replica(fleet.replicas[0], http)
        assert (sim.publisher.address, sim.publisher.replay_address) == (
            launch.kv_events_endpoint,
            launch.kv_replay_endpoint,
        )
        for endpoint in (launch.kv_events_endpoint, launch.kv_replay_endpoint):
            path = endpoint.removeprefix("ipc://")
            assert os.path.dirname(path) == private and stat.S_ISSOCK(os.stat(path).st_mode)
        info = os.stat(private)
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
        await sim.complete(list(range(3, 40)), 2)  # before anyone subscribes: replayed
        collector = await subscribe(
            SubscriberConfig(launch.kv_events_endpoint, launch.kv_replay_endpoint, catch_up=True)
        )
        try:
            items = await sim.joined(collector)
            assert [i.seq for i in items if isinstance(i, KvBatch)] == list(range(sim.publisher.next_seq))
            stored = [
                e for i in items if isinstance(i, KvBatch) for e in i.events if isinstance(e, BlockStored)
            ]
            assert stored and stored[0].token_ids[:3] == [3, 4, 5]
        finally:
            await collector.close()


async def restarted_pub(engine: FakeEngine) -> zmq.asyncio.Socket:
    """``engine``'s PUB socket closed and a new one (an XPUB, to see the subscriber come back) bound at
    the same address: what a remote engine's restart looks like to a subscriber. Returns once the
    subscriber has subscribed again (it reconnected)."""
    address = engine.pub.getsockopt_string(zmq.LAST_ENDPOINT)
    engine.pub.close(linger=0)
    engine.pub = engine.ctx.socket(zmq.XPUB)
    deadline = time.monotonic() + 10
    while True:  # the old socket's port is released by ZMQ's I/O thread
        try:
            engine.pub.bind(address)
            break
        except zmq.ZMQError:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
    await asyncio.wait_for(engine.pub.recv(), 10)  # the subscription: the subscriber is back
    return engine.pub


async def test_a_restart_numbered_as_the_next_batch_is_still_a_restart(fake_engine: FakeEngine) -> None:
    """A remote engine restarted while the connection was down, whose first batch received bears the seq
    expected next: the connection broke, and without a replay socket nothing shows it is the same
    process, so it is reported as a restart (the endpoint cleared), not applied on top of the old cache."""
    pub, _ = fake_engine.endpoints()
    collector = await subscribe(SubscriberConfig(pub))
    try:
        n = await joined(fake_engine, collector)
        await restarted_pub(fake_engine)
        fake_engine.send(n)
        assert await collector.next() == EventsLost(None, n, "restart")
        batch = await collector.next()
        assert isinstance(batch, KvBatch) and batch.seq == n
    finally:
        await collector.close()


@pytest.mark.parametrize("restarted", [True, False])
async def test_after_a_reconnection_the_replay_tells_a_restart_from_a_broken_connection(
    fake_engine: FakeEngine, restarted: bool
) -> None:
    """After the connection broke, the engine's replay of the last batch applied tells: the same bytes,
    the same engine (the stream goes on, nothing lost); other bytes, a new process numbered on from where
    the old one stopped: a restart, caught up from its seq 0 like one whose seq went back."""
    pub, replay = fake_engine.endpoints()
    collector = await subscribe(SubscriberConfig(pub, replay))
    fake_engine.answer_replays(1)  # each replay: one batch (CLEARED) from the seq asked, then the end
    try:
        n = await joined(fake_engine, collector)
        if restarted:  # the old engine's last batch is not what the new one replays at its seq
            fake_engine.send(payload=msgspec.msgpack.encode([2.5, [{"type": "AllBlocksCleared"}], 0]))
            await collector.until(lambda item: isinstance(item, KvBatch) and item.seq == n)
            n += 1
        await restarted_pub(fake_engine)
        fake_engine.send(n)
        items = await collector.until(lambda item: isinstance(item, KvBatch) and item.seq == n)
        if restarted:
            assert items[0] == EventsLost(None, 0, "restart") and EventsLost(1, n, "gap") in items
        else:
            assert [type(i) for i in items] == [KvBatch]
    finally:
        await collector.close()
