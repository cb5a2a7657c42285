"""Slot save/restore through a kvcached store: the record format, then two real llama-servers (SmolLM2,
small context, one thread each) run by :class:`~agent.supervisor.EngineSupervisor`: a prefix saved on
replica A is restored on replica B, whose next completion of that prompt is then served from cache."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.config import AgentSection
from agent.errors import AgentError, EngineError
from agent.slot_api import SlotAdmin
from agent.slots import (
    SLOT_HEADER_BYTES,
    SlotCache,
    SlotRecord,
    decode_slot_record,
    encode_slot_record,
    slot_dir,
    slot_key,
)
from agent.supervisor import EngineSupervisor
from contracts.digest import Digest, block_digests, chain_seed
from contracts.kvcached import StatsReply, StatsRequest
from contracts.versions import DIGEST_VERSION
from engines.config import EngineConfig
from kvcached.service import ApiServer, KvcachedService
from kvcached.tiers import TieredStore
from runtime.kvcached import KvcachedClient

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [
    {"role": "system", "content": "You answer questions about geography in detail, citing rivers, cities."},
    {"role": "user", "content": "Tell me about the Danube river and the countries it flows through, please."},
]


class MemoryStore:
    """A kvcached stand-in with the client's async put/get/contains (values kept as given)."""

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}

    async def put(self, digest: bytes, data: bytes) -> None:
        assert len(digest) == 16
        self.values[digest] = data

    async def get(self, digest: bytes) -> bytes | None:
        return self.values.get(digest)

    async def contains(self, digests: Sequence[bytes]) -> list[bool]:
        return [d in self.values for d in digests]


# -- the record and the key ------------------------------------------------------------------------------


def test_record_round_trip_and_rejects() -> None:
    record = SlotRecord(prefix_tokens=48, saved_tokens=57, block_size=16, slot_file=b"ggsq-state")
    raw = encode_slot_record(record)
    assert len(raw) == SLOT_HEADER_BYTES + len(b"ggsq-state")
    assert decode_slot_record(raw) == record
    assert decode_slot_record(raw[:10]) is None
    assert decode_slot_record(b"XXXX" + raw[4:]) is None
    assert decode_slot_record(raw[:4] + b"\x09" + raw[5:]) is None  # another version
    assert decode_slot_record(encode_slot_record(dataclasses.replace(record, prefix_tokens=47))) is None


def test_slot_key_is_the_last_full_block_digest() -> None:
    tokens = list(range(40))
    assert slot_key("m", tokens[:15]) is None
    digest, covered = slot_key("m", tokens) or (b"", 0)
    assert covered == 32 and digest == block_digests(chain_seed("m"), tokens, 16)[-1]
    assert slot_key("other", tokens) != slot_key("m", tokens)


# -- two real llama-servers ------------------------------------------------------------------------------


@dataclasses.dataclass
class Replica:
    config: EngineConfig
    supervisor: EngineSupervisor

    @property
    def url(self) -> str:
        assert self.supervisor.launch is not None
        return self.supervisor.launch.base_url

    @property
    def slots(self) -> Path:
        return slot_dir(self.config, self.supervisor.agent.state_dir)


@pytest.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[dict[str, Replica]]:
    agent = AgentSection(id="n", state_dir=str(tmp_path / "state"))
    made: dict[str, Replica] = {}
    try:
        for name in ("a", "b"):
            cfg = EngineConfig(
                id=f"llama-{name}", kind="llama_cpp", model=MODEL, model_path="smollm2",
                context=512, parallel=1, threads=1, metrics=False, ready_timeout_s=120,
            )  # fmt: skip
            sup = EngineSupervisor(cfg, agent, stop_grace_s=3.0)
            made[name] = Replica(cfg, sup)
            await sup.start()
        for rep in made.values():
            await rep.supervisor.wait_ready(timeout_s=120)
        yield made
    finally:
        for rep in made.values():
            await rep.supervisor.aclose()


@pytest.fixture
async def kvcached(tmp_path: Path) -> AsyncIterator[tuple[KvcachedClient, TieredStore]]:
    """The real kvcached API (store, service, gRPC on a unix socket) in this process, and a client."""
    store = TieredStore(64 << 20, tmp_path / "ssd", 256 << 20)
    server = ApiServer(KvcachedService(store), listen_unix=str(tmp_path / "kvcached.sock"))
    await server.start()
    client = KvcachedClient(f"unix:{tmp_path / 'kvcached.sock'}")
    try:
        yield client, store
    finally:
        await client.aclose()
        await server.aclose()
        store.close()


async def complete(
    session: aiohttp.ClientSession, url: str, messages: list[dict[str, Any]]
) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": 4, "temperature": 0}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
        return answer


async def test_save_on_a_restore_on_b(
    replicas: dict[str, Replica], kvcached: tuple[KvcachedClient, TieredStore]
) -> None:
    a, b = replicas["a"], replicas["b"]
    store, tiers = kvcached
    async with aiohttp.ClientSession() as session:
        cache_a = SlotCache(store, a.url, a.slots, session=session, engine_id="llama-a")
        cache_b = SlotCache(store, b.url, b.slots, session=session, engine_id="llama-b")
        tokens = await cache_a.prompt_tokens(MESSAGES)
        assert tokens == await cache_b.prompt_tokens(MESSAGES) and len(tokens) > 32
        assert await cache_b.restore(0, tokens, MODEL) == 0  # nothing saved yet
        first = await complete(session, a.url, MESSAGES)
        assert first["usage"]["prompt_tokens"] == len(tokens)

        other = await cache_a.prompt_tokens([{"role": "user", "content": "Something else entirely. " * 4}])
        assert await cache_a.save(0, other, MODEL) is None  # the slot holds the Danube prompt, not this
        key = await cache_a.save(0, tokens, MODEL)
        assert key == bytes(block_digests(chain_seed(MODEL), tokens, 16)[-1])
        assert tiers.tier_of(key) is not None
        assert list(a.slots.iterdir()) == []  # the saved file was read and removed

        restored = await cache_b.restore(0, tokens, MODEL)
        assert restored == len(tokens) // 16 * 16
        assert list(b.slots.iterdir()) == []
        second = await complete(session, b.url, MESSAGES)
        assert second["timings"]["cache_n"] >= restored
        assert second["timings"]["cache_n"] >= len(tokens) - 16

        # A longer conversation with the same start restores the same (shorter) prefix.
        turn = [{"role": "assistant", "content": "It is long."}, {"role": "user", "content": "And?"}]
        longer = [*MESSAGES, *turn]
        more = await cache_b.prompt_tokens(longer)
        assert await cache_b.restore(0, more, MODEL) == restored
        assert await cache_b.restore(0, tokens, "another-model") == 0


async def test_admin_routes(replicas: dict[str, Replica]) -> None:
    a, b = replicas["a"], replicas["b"]

    sim = Replica(EngineConfig(id="sim-0", kind="sim", model=MODEL, model_path="/unused"), a.supervisor)

    class Host:
        def __init__(self) -> None:
            self.engines = {r.config.id: r for r in (a, b, sim)}

    store = MemoryStore()
    app = web.Application()
    admin = SlotAdmin(Host(), store)
    app.add_routes(admin.routes())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:

            async def post(path: str, body: object) -> tuple[int, dict[str, Any]]:
                async with session.post(url + path, json=body) as resp:
                    return resp.status, await resp.json()

            assert (await post("/slots/save", {"engine": "nope", "slot": 0, "messages": MESSAGES}))[0] == 404
            assert (await post("/slots/save", {"engine": "llama-a", "messages": MESSAGES}))[0] == 400
            assert (await post("/slots/save", {"engine": "llama-a", "slot": -1, "messages": []}))[0] == 400
            extra = {"engine": "llama-a", "slot": 0, "messages": MESSAGES, "x": 1}
            assert (await post("/slots/save", extra))[0] == 400

            await complete(session, a.url, MESSAGES)
            status, saved = await post("/slots/save", {"engine": "llama-a", "slot": 0, "messages": MESSAGES})
            assert status == 200 and saved["saved"] and saved["tokens"] == saved["prompt_tokens"] // 16 * 16
            status, got = await post("/slots/restore", {"engine": "llama-b", "slot": 0, "messages": MESSAGES})
            assert status == 200 and got["tokens"] == saved["tokens"] > 0
            answer = await complete(session, b.url, MESSAGES)
            assert answer["timings"]["cache_n"] >= got["tokens"]
            # A value that is no slot file is skipped (never handed to the engine): nothing restored.
            (key,) = store.values
            good = decode_slot_record(store.values[key])
            assert good is not None
            store.values[key] = encode_slot_record(SlotRecord(saved["tokens"], 0, 16, b"not a slot file"))
            status, got = await post("/slots/restore", {"engine": "llama-b", "slot": 0, "messages": MESSAGES})
            assert status == 200 and got["tokens"] == 0
            # The right token list but a broken KV state: the engine refuses it, a clear 502 naming the
            # engine, and the file is gone.
            n = int.from_bytes(good.slot_file[8:12], "little")
            broken = good.slot_file[: 12 + 4 * n] + b"not a KV state"
            store.values[key] = encode_slot_record(dataclasses.replace(good, slot_file=broken))
            status, err = await post("/slots/restore", {"engine": "llama-b", "slot": 0, "messages": MESSAGES})
            assert status == 502 and "llama-b" in err["error"]["message"] and list(b.slots.iterdir()) == []
            status, err = await post("/slots/save", {"engine": "sim-0", "slot": 0, "messages": MESSAGES})
            assert status == 400 and "llama_cpp" in err["error"]["message"]
    finally:
        await runner.cleanup()
        await admin.aclose()


async def test_an_engine_answer_that_is_not_utf8_is_an_engine_error(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 in an engine's answer: an ``EngineError`` (not JSON; the HTTP status for an
    error answer), never a ``UnicodeDecodeError``."""

    async def slots(request: web.Request) -> web.Response:
        return web.Response(body=b"[\xff\xfe]", content_type="application/json")

    async def failing(request: web.Request) -> web.Response:
        return web.Response(body=b"\xff oops", status=500, content_type="text/plain", charset="utf-8")

    app = web.Application()
    app.router.add_get("/slots", slots)
    app.router.add_post("/tokenize", failing)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with SlotCache(MemoryStore(), base, tmp_path, engine_id="l") as cache:
            with pytest.raises(EngineError, match="/slots: not JSON"):
                await cache.slots()
            with pytest.raises(EngineError, match="/tokenize: HTTP 500"):
                await cache._call("POST", "/tokenize", {"content": "x"})
    finally:
        await runner.cleanup()


async def test_a_kvcached_over_its_concurrency_cap_is_a_failed_call_not_a_crash(tmp_path: Path) -> None:
    """A daemon serving its ``max_concurrent_rpcs`` calls answers one more RESOURCE_EXHAUSTED: the client
    raises ``KvcachedError`` and the slot cache turns it into ``AgentError`` (auto-save counts a failed
    save; a restore is answered 502, which the gateway counts as ``failed`` and routes on)."""
    store = TieredStore(1 << 20, None, 0)
    service = KvcachedService(store)
    release, entered = asyncio.Event(), asyncio.Event()

    async def held_stats(request: StatsRequest) -> StatsReply:
        entered.set()
        await release.wait()
        return StatsReply({}, DIGEST_VERSION)

    service.stats = held_stats  # type: ignore[method-assign]
    server = ApiServer(service, listen_unix=str(tmp_path / "api.sock"), max_concurrent_rpcs=1)
    await server.start()
    client = KvcachedClient(f"unix:{tmp_path / 'api.sock'}", timeout_s=5.0)
    holder = asyncio.ensure_future(client.stats())
    try:
        await asyncio.wait_for(entered.wait(), 5.0)
        async with SlotCache(client, "http://127.0.0.1:1", tmp_path, engine_id="l") as cache:
            with pytest.raises(AgentError, match=r"kvcached contains failed: .*RESOURCE_EXHAUSTED"):
                await cache.restore_chain([Digest(bytes(16))], MODEL)
            with pytest.raises(AgentError, match=r"kvcached put failed: .*RESOURCE_EXHAUSTED"):
                await cache._put(bytes(16), b"slot")
        assert store.contains([bytes(16)]) == [False]
    finally:
        release.set()
        await holder
        await client.aclose()
        await server.aclose()
        store.close()
