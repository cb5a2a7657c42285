"""llama.cpp slot save/restore through kvcached: a prefix computed on one replica restored on another.

A llama-server started by the agent has ``--slot-save-path <state_dir>/slots/<engine id>``;
``POST /slots/N?action=save {"filename": F}`` writes slot N's KV cache (with the tokens it holds) to that
directory and ``action=restore`` loads such a file into a slot. :class:`SlotCache` moves these files
through kvcached so that a replica that never saw a prompt can start from another replica's prefill:

- **Key**: the kvgate digest of the prompt's last full block,
  ``extproc.digest.block_digests(chain_seed(model), tokens, block_size)[-1]`` (block size 16, the index's).
  The digest chains over every earlier block, so it names the whole prefix ``tokens[:k * block_size]``;
  the tokens past the last full block (at most ``block_size - 1``) are recomputed by the engine.
- **Value**: a 16-byte header then the slot file as llama-server wrote it. Header (little-endian):
  magic ``b"KVSL"``, version (u8), pad (u8), block size (u16), prefix tokens the key covers (u32), tokens
  the slot file holds (u32, llama-server's ``n_saved``: the prompt plus what was generated after it).
  One value, not a second key for the count: a put is atomic in kvcached, so the count can never be
  seen without its file (or the other way round). kvcached checksums the whole value on every read.
- **Guard on save**: a slot is reused by the next request, so the file saved may no longer hold this
  prompt. Before storing, the prompt's key prefix must appear in the file as little-endian 32-bit token
  ids near its start (where llama.cpp's state file keeps the token list); otherwise nothing is stored.
- **Restore**: the chain's digests are asked for in one ``contains`` call; the longest held one is
  fetched (a shorter one if it vanished in between), written into this engine's slot directory under a
  unique name, restored, and the file removed again (the engine has it in memory then). Files written by
  save are removed once read. A restore replaces whatever the slot held.

The tokens must be the ones the server caches: :meth:`SlotCache.prompt_tokens` renders the chat
messages with the server's own ``/apply-template`` and ``/tokenize`` (special tokens parsed).

Admin API (:func:`slot_routes`, mounted on the agent's admin app): ``POST /slots/save`` and
``POST /slots/restore`` with ``{"engine": id, "slot": n, "messages": [...]}``. The agent flow: after a
long prompt finished on replica A, save A's slot; before that prefix is sent to replica B, restore it
on B. Not thread-safe; one event loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import aiohttp
import msgspec
from aiohttp import web

from agent.config import EngineConfig
from agent.errors import AgentError, EngineError
from agent.supervisor import EngineState, EngineSupervisor
from extproc.digest import Digest, block_digests, chain_seed, pack_tokens

log = logging.getLogger(__name__)

SLOT_BLOCK_SIZE = 16
"""Tokens per digest block (the gateway index's default block size)."""
SLOT_MAGIC = b"KVSL"
SLOT_VERSION = 1
_HEADER = struct.Struct("<4sBxHII")
SLOT_HEADER_BYTES = _HEADER.size
#: How far into a slot file the prompt's token ids may start (llama.cpp writes a few u32 fields first).
_TOKENS_WITHIN = 256


class SlotStore(Protocol):
    """What :class:`SlotCache` needs of kvcached (``kvcached.service.KvcachedClient`` has it)."""

    async def put(self, digest: bytes, data: bytes) -> object: ...

    async def get(self, digest: bytes) -> bytes | None: ...

    async def contains(self, digests: Sequence[bytes]) -> list[bool]: ...


@dataclass(frozen=True, slots=True)
class SlotRecord:
    """A decoded kvcached value: the prefix tokens its key covers, the tokens the slot file holds, the
    block size of the key, and the llama-server slot file."""

    prefix_tokens: int
    saved_tokens: int
    block_size: int
    slot_file: bytes


def encode_slot_record(record: SlotRecord) -> bytes:
    """The kvcached value of ``record`` (header then slot file)."""
    r = record
    return _HEADER.pack(SLOT_MAGIC, SLOT_VERSION, r.block_size, r.prefix_tokens, r.saved_tokens) + r.slot_file


def decode_slot_record(raw: bytes) -> SlotRecord | None:
    """The record in ``raw``; ``None`` when it is not a slot record of this version."""
    if len(raw) < SLOT_HEADER_BYTES:
        return None
    magic, version, block_size, prefix, saved = _HEADER.unpack_from(raw)
    if magic != SLOT_MAGIC or version != SLOT_VERSION or block_size == 0 or prefix % block_size:
        return None
    return SlotRecord(prefix, saved, block_size, raw[SLOT_HEADER_BYTES:])


def slot_key(
    model: str, tokens: Sequence[int], block_size: int = SLOT_BLOCK_SIZE
) -> tuple[Digest, int] | None:
    """The key of a saved prefix of ``tokens`` and the tokens it covers; ``None`` under one full block."""
    chain = block_digests(chain_seed(model), tokens, block_size)
    return (chain[-1], len(chain) * block_size) if chain else None


def holds_tokens(slot_file: bytes, tokens: Sequence[int]) -> bool:
    """Whether ``slot_file`` lists ``tokens`` (as little-endian u32) within its first bytes."""
    packed = pack_tokens(tokens)
    return slot_file.find(packed, 0, _TOKENS_WITHIN + len(packed)) >= 0


class SlotCache:
    """Saves and restores one llama-server's slots through kvcached (module docstring).

    ``base_url``: the engine as the agent reaches it; ``slot_dir``: its ``--slot-save-path`` (on this
    host). ``timeout_s``: per engine HTTP call. Use as ``async with`` (or call :meth:`aclose`) when no
    ``session`` is given: the cache then owns one.
    """

    def __init__(
        self,
        store: SlotStore,
        base_url: str,
        slot_dir: Path,
        *,
        block_size: int = SLOT_BLOCK_SIZE,
        timeout_s: float = 60.0,
        session: aiohttp.ClientSession | None = None,
        engine_id: str = "llama_cpp",
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.store, self.base_url, self.slot_dir = store, base_url.rstrip("/"), slot_dir
        self.block_size, self.engine_id = block_size, engine_id
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session, self._owned = session, session is None

    async def __aenter__(self) -> SlotCache:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP session if this cache made it."""
        if self._owned and self._session is not None:
            await self._session.close()
        self._session = None

    # -- the engine ------------------------------------------------------------------------------------

    async def prompt_tokens(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The token ids the server caches for a chat request with ``messages`` (its own chat template
        and tokenizer, special tokens parsed)."""
        rendered = await self._call("POST", "/apply-template", {"messages": list(messages)})
        prompt = rendered.get("prompt")
        if not isinstance(prompt, str):
            raise EngineError(self.engine_id, "/apply-template answered without a prompt")
        tokenized = await self._call("POST", "/tokenize", {"content": prompt, "parse_special": True})
        tokens = tokenized.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise EngineError(self.engine_id, "/tokenize answered without token ids")
        return tokens

    async def save(self, slot: int, token_ids: Sequence[int], model: str) -> bytes | None:
        """Save ``slot`` (which just served a prompt of ``token_ids`` for ``model``) into kvcached; the
        key, or ``None`` when nothing was stored (prompt under one block, or the slot holds another
        prompt now). :class:`~agent.errors.EngineError` when the engine fails, :class:`AgentError` when
        kvcached does."""
        key = slot_key(model, token_ids, self.block_size)
        if key is None:
            return None
        digest, prefix = key
        name = _filename("save")
        answer = await self._call("POST", f"/slots/{slot}?action=save", {"filename": name})
        path = self.slot_dir / name
        try:
            slot_file = await asyncio.to_thread(path.read_bytes)
        except OSError as exc:
            raise EngineError(self.engine_id, f"slot {slot} saved but its file is unreadable: {exc}") from exc
        finally:
            await asyncio.to_thread(path.unlink, True)
        if not holds_tokens(slot_file, token_ids[:prefix]):
            log.warning("engine %s slot %d: holds another prompt now; not stored", self.engine_id, slot)
            return None
        saved = answer.get("n_saved")
        record = SlotRecord(prefix, saved if isinstance(saved, int) else prefix, self.block_size, slot_file)
        try:
            await self.store.put(bytes(digest), encode_slot_record(record))
        except Exception as exc:  # the store's own errors (kvcached down, oversize): one family here
            raise AgentError(f"kvcached put failed: {exc}") from exc
        log.info("engine %s slot %d: saved %d prefix tokens (%d bytes)", self.engine_id, slot, prefix,
                 len(slot_file))  # fmt: skip
        return bytes(digest)

    async def restore(self, slot: int, token_ids: Sequence[int], model: str) -> int:
        """Restore the longest saved prefix of ``token_ids`` into ``slot``; the prompt tokens the slot
        then holds (a multiple of the block size), 0 when kvcached has no prefix of them."""
        chain = block_digests(chain_seed(model), token_ids, self.block_size)
        if not chain:
            return 0
        try:
            held = await self.store.contains([bytes(d) for d in chain])
        except Exception as exc:
            raise AgentError(f"kvcached contains failed: {exc}") from exc
        for index in reversed([i for i, h in enumerate(held) if h]):
            try:
                raw = await self.store.get(bytes(chain[index]))
            except Exception as exc:
                raise AgentError(f"kvcached get failed: {exc}") from exc
            record = None if raw is None else decode_slot_record(raw)
            prefix = (index + 1) * self.block_size
            if record is None or record.prefix_tokens != prefix or record.block_size != self.block_size:
                if raw is not None:
                    log.warning("engine %s: value at block %d is no slot record", self.engine_id, index)
                continue
            await self._load(slot, record.slot_file)
            log.info("engine %s slot %d: restored %d prefix tokens", self.engine_id, slot, prefix)
            return prefix
        return 0

    async def _load(self, slot: int, slot_file: bytes) -> None:
        name = _filename("restore")
        path = self.slot_dir / name
        await asyncio.to_thread(_write_new, path, slot_file)
        try:
            await self._call("POST", f"/slots/{slot}?action=restore", {"filename": name})
        finally:
            await asyncio.to_thread(path.unlink, True)

    async def _call(self, method: str, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
            self._owned = True
        where = path.split("?")[0]
        try:
            async with self._session.request(method, self.base_url + path, json=body) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise EngineError(self.engine_id, f"{where}: HTTP {resp.status}: {text[:300]}")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise EngineError(self.engine_id, f"{where}: {exc!r}") from exc
        try:
            answer = msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise EngineError(self.engine_id, f"{where}: not JSON") from exc
        if not isinstance(answer, dict):
            raise EngineError(self.engine_id, f"{where}: not a JSON object")
        return answer


def _filename(action: str) -> str:
    """A fresh file name in the slot directory (llama-server refuses names with path separators)."""
    return f"kvgate-{action}-{secrets.token_hex(8)}.bin"


def _write_new(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)


# -- admin API -------------------------------------------------------------------------------------------


class _EngineHandle(Protocol):
    @property
    def config(self) -> EngineConfig: ...

    @property
    def supervisor(self) -> EngineSupervisor: ...


class SlotHost(Protocol):
    """What :func:`slot_routes` needs of the agent: its engines by id."""

    @property
    def engines(self) -> Mapping[str, _EngineHandle]: ...


class SlotRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The body of ``POST /slots/save`` and ``/slots/restore``."""

    engine: str
    slot: int
    messages: list[dict[str, Any]]


def slot_dir(engine: EngineConfig, state_dir: str) -> Path:
    """Where the agent points a llama-server's ``--slot-save-path`` (``agent.engines`` renders it)."""
    return Path(state_dir, "slots", engine.id)


def slot_routes(agent: SlotHost, store: SlotStore) -> list[web.RouteDef]:
    """The admin routes ``POST /slots/save`` and ``POST /slots/restore`` over ``agent``'s engines.

    Answers: 200 with ``{engine, slot, prompt_tokens, tokens, ms, ...}``; 400 for a bad body or an engine
    that is not a llama-server the agent runs; 404 for an unknown engine; 503 when the engine is not
    ready; 502 when the engine or kvcached failed.
    """

    async def handle(request: web.Request, action: str) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read(), type=SlotRequest)
        except msgspec.ValidationError as exc:
            return _error(400, f"bad request: {exc}")
        except msgspec.DecodeError:
            return _error(400, "bad request: body is not JSON")
        if body.slot < 0:
            return _error(400, "bad request: slot must be >= 0")
        eng = agent.engines.get(body.engine)
        if eng is None:
            return _error(404, f"no engine {body.engine!r}")
        cfg, launch = eng.config, eng.supervisor.launch
        if cfg.kind != "llama_cpp" or not cfg.started:
            return _error(400, f"engine {cfg.id}: slot save/restore needs a llama_cpp engine the agent runs")
        if launch is None or eng.supervisor.state is not EngineState.READY:
            return _error(503, f"engine {cfg.id} is not ready")
        directory = slot_dir(cfg, eng.supervisor.agent.state_dir)
        began = time.perf_counter()
        try:
            async with SlotCache(store, launch.base_url, directory, engine_id=cfg.id) as cache:
                tokens = await cache.prompt_tokens(body.messages)
                out: dict[str, Any] = {"engine": cfg.id, "slot": body.slot, "prompt_tokens": len(tokens)}
                if action == "save":
                    key = await cache.save(body.slot, tokens, cfg.model)
                    covered = len(tokens) // SLOT_BLOCK_SIZE * SLOT_BLOCK_SIZE if key is not None else 0
                    out |= {"saved": key is not None, "key": key.hex() if key else None, "tokens": covered}
                else:
                    out["tokens"] = await cache.restore(body.slot, tokens, cfg.model)
        except AgentError as exc:
            log.warning("slot %s on %s failed: %s", action, cfg.id, exc)
            return _error(502, str(exc))
        out["ms"] = round((time.perf_counter() - began) * 1000, 3)
        return web.json_response(out)

    async def save(request: web.Request) -> web.Response:
        return await handle(request, "save")

    async def restore(request: web.Request) -> web.Response:
        return await handle(request, "restore")

    return [web.post("/slots/save", save), web.post("/slots/restore", restore)]


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"code": status, "message": message}}, status=status)
