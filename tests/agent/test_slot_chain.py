"""Slot files keyed by their own tokens, chain markers, and restores by digest chain, against a real
llama-server (SmolLM2, one thread, one slot) run by :class:`~agent.supervisor.EngineSupervisor`: the
state file's token list, ``SlotCache.save_slot`` (blob + markers), the ``/slots/restore-chain`` route
(bad input, unknown engine, no idle slot, marker -> blob, miss, single flight) and automatic saves fed by
the telemetry scraper's ``/slots`` reading."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.autosave import SlotAutoSaver
from agent.config import AgentSection
from agent.slot_api import RESTORE_CHAIN_PATH, SlotAdmin
from agent.slotfile import decode_marker, state_tokens
from agent.slots import SlotCache, decode_slot_record, slot_dir
from agent.supervisor import EngineState, EngineSupervisor
from agent.telemetry import EngineScraper
from contracts.digest import Digest, block_digests, chain_seed
from engines.config import EngineConfig
from tests.agent.test_slots import complete

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [
    {
        "role": "system",
        "content": "You answer questions about geography in detail, citing rivers, cities. " * 3,
    },
    {"role": "user", "content": "Tell me about the Danube river and the countries it flows through, please."},
]


class MemoryStore:
    """kvcached's put/get/contains over a dict; ``gate`` holds gets of the digests in ``gated``."""

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}
        self.gets: list[bytes] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.gated: set[bytes] = set()

    async def put(self, digest: bytes, data: bytes) -> None:
        assert len(digest) == 16
        self.values.setdefault(digest, data)  # kvcached keeps the first bytes of a digest

    async def get(self, digest: bytes) -> bytes | None:
        self.gets.append(digest)
        if digest in self.gated:
            await self.gate.wait()
        return self.values.get(digest)

    async def contains(self, digests: Sequence[bytes]) -> list[bool]:
        return [d in self.values for d in digests]


@dataclasses.dataclass
class Engine:
    config: EngineConfig
    supervisor: Any

    @property
    def url(self) -> str:
        launch = self.supervisor.launch
        assert launch is not None
        return str(launch.base_url)

    @property
    def slots(self) -> Path:
        return slot_dir(self.config, self.supervisor.agent.state_dir)


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    agent = AgentSection(id="n", state_dir=str(tmp_path / "state"))
    cfg = EngineConfig(
        id="llama-0", kind="llama_cpp", model=MODEL, model_path="smollm2", context=1024, parallel=1,
        threads=1, ready_timeout_s=120,
    )  # fmt: skip
    sup = EngineSupervisor(cfg, agent, stop_grace_s=3.0)
    await sup.start()
    try:
        await sup.wait_ready(timeout_s=120)
        yield Engine(cfg, sup)
    finally:
        await sup.aclose()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def post(session: aiohttp.ClientSession, url: str, body: object = None) -> tuple[int, Any]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


def chain(tokens: Sequence[int]) -> list[Digest]:
    return block_digests(chain_seed(MODEL), tokens, 16)


async def test_state_file_tokens_and_save_slot(engine: Engine, session: aiohttp.ClientSession) -> None:
    cache = SlotCache(MemoryStore(), engine.url, engine.slots, session=session, engine_id="llama-0")
    prompt = await cache.prompt_tokens(MESSAGES)
    await complete(session, engine.url, MESSAGES)

    # The file llama-server writes: its token list is the prompt then what was generated.
    status, answer = await post(session, f"{engine.url}/slots/0?action=save", {"filename": "probe.bin"})
    assert status == 200
    data = (engine.slots / "probe.bin").read_bytes()
    tokens = state_tokens(data)
    assert tokens is not None and tokens[: len(prompt)] == prompt and len(tokens) == answer["n_saved"]
    assert data[:4] == b"qsgg" and int.from_bytes(data[12:16], "little", signed=True) == -1  # packed form
    n = int.from_bytes(data[8:12], "little")
    assert state_tokens(data[: 12 + 4 * n - 1]) is None  # cut inside the list
    assert state_tokens(b"qsgX" + data[4:]) is None
    assert state_tokens(data[: 12 + 4 * n]) == tokens  # the KV state is not needed to read the list

    store = MemoryStore()
    cache = SlotCache(store, engine.url, engine.slots, session=session, engine_id="llama-0")
    assert (await cache.save_slot(0, MODEL, min_tokens=len(tokens) + 1)).outcome == "short"
    assert store.values == {}
    saved = await cache.save_slot(0, MODEL, min_tokens=64)
    keys = [bytes(d) for d in chain(tokens)]
    assert (saved.outcome, saved.tokens, saved.blocks, saved.markers) == (
        "stored",
        len(tokens),
        len(keys),
        len(keys) - 1,
    )
    assert set(store.values) == set(keys)
    record = decode_slot_record(store.values[keys[-1]])
    assert (
        record is not None and record.prefix_tokens == len(keys) * 16 and record.saved_tokens == len(tokens)
    )
    for i, key in enumerate(keys[:-1]):
        marker = decode_marker(store.values[key])
        assert marker is not None and marker.blob == keys[-1] and marker.prefix_tokens == (i + 1) * 16
        assert marker.blob_tokens == record.prefix_tokens
    assert (await cache.save_slot(0, MODEL)).outcome == "held"  # nothing new: nothing put
    assert list(engine.slots.iterdir()) == [engine.slots / "probe.bin"]  # save_slot's files are removed


@pytest.fixture
async def busy_engine(tmp_path: Path) -> AsyncIterator[Engine]:
    """A stand-in llama-server whose only slot is always busy."""

    async def slots(request: web.Request) -> web.Response:
        return web.json_response([{"id": 0, "n_ctx": 1024, "is_processing": True, "id_task": 9}])

    app = web.Application()
    app.add_routes([web.get("/slots", slots)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    cfg = EngineConfig(id="busy-0", kind="llama_cpp", model=MODEL, model_path="smollm2")
    supervisor = SimpleNamespace(
        launch=SimpleNamespace(base_url=f"http://127.0.0.1:{runner.addresses[0][1]}"),
        state=EngineState.READY,
        agent=SimpleNamespace(state_dir=str(tmp_path / "busy")),
    )
    try:
        yield Engine(cfg, supervisor)
    finally:
        await runner.cleanup()


@pytest.fixture
async def admin(engine: Engine, busy_engine: Engine) -> AsyncIterator[tuple[SlotAdmin, MemoryStore, str]]:
    class Host:
        def __init__(self) -> None:
            self.engines = {e.config.id: e for e in (engine, busy_engine)}

    store = MemoryStore()
    slot_admin = SlotAdmin(Host(), store)  # type: ignore[arg-type]
    app = web.Application()
    app.add_routes(slot_admin.routes())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield slot_admin, store, f"http://127.0.0.1:{runner.addresses[0][1]}{RESTORE_CHAIN_PATH}"
    finally:
        await runner.cleanup()
        await slot_admin.aclose()


async def test_restore_chain_route(
    engine: Engine, admin: tuple[SlotAdmin, MemoryStore, str], session: aiohttp.ClientSession
) -> None:
    slot_admin, store, url = admin
    cache = slot_admin.cache("llama-0")
    assert cache is not None
    prompt = await cache.prompt_tokens(MESSAGES)
    wanted = [d.hex() for d in chain(prompt)]

    for body, message in [
        (None, "not JSON"),
        ({"engine": "llama-0"}, "digests"),
        ({"engine": "llama-0", "digests": []}, "expected 1 to"),
        ({"engine": "llama-0", "digests": ["zz" * 16]}, "digests[0]"),
        ({"engine": "llama-0", "digests": [wanted[0][:-2]]}, "digests[0]"),
        ({"engine": "llama-0", "digests": wanted, "slot": 0}, "unknown field"),
    ]:
        status, err = await post(session, url, body)
        assert status == 400 and message in err["error"]["message"], (body, err)
    status, err = await post(session, url, {"engine": "nope", "digests": wanted})
    assert status == 404 and err["error"]["code"] == 404

    status, got = await post(session, url, {"engine": "llama-0", "digests": wanted})  # nothing saved yet
    assert (status, got["outcome"], got["restored"], got["tokens"]) == (200, "miss", False, 0)

    await complete(session, engine.url, MESSAGES)
    saved = await cache.save_slot(0, MODEL)
    assert saved.outcome == "stored"
    status, _ = await post(session, f"{engine.url}/slots/0?action=erase")
    assert status == 200
    # A request's chain ending inside the saved one (before its last block): a marker, which leads to
    # the blob.
    wanted = wanted[: saved.blocks - 1]
    assert decode_marker(store.values[bytes.fromhex(wanted[-1])]) is not None
    status, got = await post(session, url, {"engine": "llama-0", "digests": wanted})
    assert status == 200 and got["restored"] and got["slot"] == 0
    assert (got["tokens"], got["matched_tokens"]) == (saved.tokens, len(wanted) * 16)
    answer = await complete(session, engine.url, MESSAGES)
    assert answer["timings"]["cache_n"] >= len(wanted) * 16
    assert list(engine.slots.iterdir()) == []

    # No idle slot: 409, and nothing was fetched.
    gets = len(store.gets)
    status, err = await post(session, url, {"engine": "busy-0", "digests": wanted})
    assert status == 409 and "no idle slot" in err["error"]["message"] and len(store.gets) == gets

    # A marker whose blob is gone is a miss.
    blob = decode_marker(store.values[bytes.fromhex(wanted[-1])])
    assert blob is not None
    del store.values[blob.blob]
    status, got = await post(session, url, {"engine": "llama-0", "digests": wanted})
    assert status == 200 and got["outcome"] == "miss"
    stats = slot_admin.stats["llama-0"]
    assert (stats.restored, stats.miss, stats.failed) == (1, 2, 0) and slot_admin.stats["busy-0"].busy == 1


async def test_concurrent_restores_of_one_blob_share_one_flight(
    engine: Engine, admin: tuple[SlotAdmin, MemoryStore, str], session: aiohttp.ClientSession
) -> None:
    slot_admin, store, url = admin
    cache = slot_admin.cache("llama-0")
    assert cache is not None
    prompt = await cache.prompt_tokens(MESSAGES)
    await complete(session, engine.url, MESSAGES)
    saved = await cache.save_slot(0, MODEL)
    assert saved.outcome == "stored"
    wanted = [d.hex() for d in chain(prompt)][: saved.blocks - 1]
    marker = decode_marker(store.values[bytes.fromhex(wanted[-1])])
    assert marker is not None
    store.gated, store.gate = {marker.blob}, asyncio.Event()  # the blob fetch waits for all three

    body = {"engine": "llama-0", "digests": wanted}
    calls = [asyncio.create_task(post(session, url, body)) for _ in range(3)]
    async with asyncio.timeout(30):
        while True:  # two callers joined the first one's flight
            stats = slot_admin.stats.get("llama-0")
            if stats is not None and stats.joined >= 2:
                break
            await asyncio.sleep(0.01)  # poll interval of the condition, not a stand-in for it
    store.gate.set()
    answers = await asyncio.gather(*calls)
    assert all(status == 200 and got["restored"] for status, got in answers), answers
    assert len({got["slot"] for _, got in answers}) == 1
    assert store.gets.count(marker.blob) == 1  # one fetch, one restore
    assert slot_admin.stats["llama-0"].restored == 3


async def test_finished_slot_is_saved_from_the_telemetry_reading(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    store = MemoryStore()
    cache = SlotCache(store, engine.url, engine.slots, session=session, engine_id="llama-0")
    prompt = await cache.prompt_tokens(MESSAGES)
    saver = SlotAutoSaver("llama-0", MODEL, lambda: cache, min_tokens=64)
    scraper = EngineScraper("llama_cpp", f"{engine.url}/metrics", session=session)
    scraper.on_slots = saver.observe
    try:
        assert await scraper.scrape() is not None  # an idle, fresh engine: nothing to save
        await complete(session, engine.url, MESSAGES)
        assert await scraper.scrape() is not None
        await saver.idle()
        keys = [bytes(d) for d in chain(prompt)]
        assert all(k in store.values for k in keys) and saver.stats.stored == 1
        assert await scraper.scrape() is not None  # the same finished task: not saved again
        await saver.idle()
        assert saver.stats.stored + saver.stats.held == 1
    finally:
        await saver.aclose()
