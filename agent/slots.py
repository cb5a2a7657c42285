"""llama.cpp slot save/restore through kvcached: a prefix computed on one replica restored on another.

A llama-server started by the agent has ``--slot-save-path <state_dir>/slots/<engine id>``;
``POST /slots/N?action=save {"filename": F}`` writes slot N's KV cache (with the tokens it holds) to that
directory and ``action=restore`` loads such a file into a slot. :class:`SlotCache` moves these files
through kvcached so that a replica that never saw a prompt can start from another replica's prefill:

- **Key**: kvgate digests, ``contracts.digest.block_digests(chain_seed(model), tokens, block_size)`` (block
  size 16, the index's). A digest chains over every earlier block, so it names the whole prefix
  ``tokens[:k * block_size]``; the tokens past the last full block are recomputed by the engine.
- **Blob**: the slot file under the digest of its last full block. Value: a 16-byte header then the slot
  file as llama-server wrote it. Header (little-endian): magic ``b"KVSL"``, version (u8), pad (u8), block
  size (u16), prefix tokens the key covers (u32), tokens the slot file holds (u32, llama-server's
  ``n_saved``: the prompt plus what was generated after it). One value, so a put is atomic in kvcached;
  kvcached checksums the whole value on every read.
- **Markers** (:mod:`agent.slotfile`): :meth:`SlotCache.save_slot`, the automatic save
  (:mod:`agent.autosave`), also puts a 32-byte marker naming the blob under every earlier digest of the
  chain, blob first, markers after (a marker is never seen without its blob having been stored). Then
  kvcached's index feed announces the whole chain, and a lookup ending anywhere in it finds the file.
- **Tokens from the file**: :meth:`SlotCache.save_slot` reads the token ids from the saved file itself
  (:func:`agent.slotfile.state_tokens`), so what is keyed is exactly what the file holds, whatever request
  the slot served; a file whose list cannot be read stores nothing. :meth:`SlotCache.save` (the manual
  route with chat messages) checks that the file starts with the prompt's tokens, else stores nothing.
- **Restore**: :meth:`SlotCache.restore_chain` takes a request's chain (as the gateway computed it, up to
  a lead some node's kvcached holds): one ``contains`` over it; the chain's last digest is asked for first
  when this node lacks it (kvcached's ``Get`` then fetches it from a peer over QUIC), then the longest
  held digests; a marker leads to its blob (also fetched from a peer if need be); a marker whose blob is
  gone is a miss. The blob's token list must hash to the requested digest (else it is skipped), it is
  written into the slot directory under a unique name, restored into an **idle** slot (or a given one),
  and the file removed again. A restore replaces whatever the slot held.

Not thread-safe; one event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import struct
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import aiohttp
import msgspec

from agent.errors import AgentError, EngineError
from agent.slotfile import ChainMarker, decode_marker, encode_marker, state_tokens
from contracts.digest import Digest, block_digests, chain_seed
from engines.config import EngineConfig

log = logging.getLogger(__name__)

SLOT_BLOCK_SIZE = 16
"""Tokens per digest block (the gateway index's default block size)."""
SLOT_MAGIC = b"KVSL"
SLOT_VERSION = 1
_HEADER = struct.Struct("<4sBxHII")
SLOT_HEADER_BYTES = _HEADER.size
#: Values looked at, at most, by one restore walking down a chain (markers of a vanished blob, ...).
MAX_LOOKUPS = 8


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


@dataclass(frozen=True, slots=True)
class SaveOutcome:
    """What one :meth:`SlotCache.save_slot` did. ``outcome``: ``stored`` (blob and markers put), ``held``
    (the chain's last digest was in kvcached already: nothing put), ``short`` (fewer tokens than asked
    for), ``unreadable`` (no token list in the file: nothing put). ``tokens``: in the file; ``blocks``:
    full blocks of its chain; ``markers``: markers put; ``file_bytes``: the slot file's size."""

    outcome: str
    tokens: int = 0
    blocks: int = 0
    markers: int = 0
    file_bytes: int = 0


@dataclass(frozen=True, slots=True)
class RestoreOutcome:
    """What one restore did. ``outcome``: ``restored``, ``miss`` (no usable value for the chain) or
    ``busy`` (no idle slot when it came to it: nothing loaded). ``slot``: where it went; ``tokens``: what
    the slot holds now (the file's whole list); ``matched_tokens``: the prefix of the request's chain that
    it covers (a multiple of the block size)."""

    outcome: str
    slot: int | None = None
    tokens: int = 0
    matched_tokens: int = 0


#: Runs ``make`` once per key at a time (a single-flight group); the default runs it every time.
Flight = Callable[[bytes, Callable[[], Awaitable[RestoreOutcome]]], Awaitable[RestoreOutcome]]


async def _every_time(key: bytes, make: Callable[[], Awaitable[RestoreOutcome]]) -> RestoreOutcome:
    return await make()


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

    async def slots(self) -> list[dict[str, Any]]:
        """The engine's ``GET /slots`` (one object per slot: ``id``, ``is_processing``, ...)."""
        answer = await self._call("GET", "/slots", None)
        if not isinstance(answer, list) or not all(isinstance(s, dict) for s in answer):
            raise EngineError(self.engine_id, "/slots: not a list of slots")
        return answer

    async def idle_slot(self) -> int | None:
        """An idle slot to restore into (the one caching the fewest tokens), ``None`` when all are busy."""
        idle = [
            s for s in await self.slots() if s.get("is_processing") is False and isinstance(s.get("id"), int)
        ]
        if not idle:
            return None
        fewest = min(idle, key=lambda s: (_int(s.get("n_prompt_tokens")), s["id"]))
        return int(fewest["id"])

    async def _save_file(self, slot: int) -> tuple[bytes, dict[str, Any]]:
        """Save ``slot`` to a fresh file, read it and remove it: (file bytes, the engine's answer)."""
        name = _filename("save")
        answer = await self._call("POST", f"/slots/{slot}?action=save", {"filename": name})
        path = self.slot_dir / name
        try:
            return await asyncio.to_thread(path.read_bytes), answer
        except OSError as exc:
            raise EngineError(self.engine_id, f"slot {slot} saved but its file is unreadable: {exc}") from exc
        finally:
            await asyncio.to_thread(path.unlink, True)

    async def _load(self, slot: int, slot_file: bytes) -> int:
        """Restore ``slot_file`` into ``slot``; the tokens the engine says it restored."""
        name = _filename("restore")
        path = self.slot_dir / name
        await asyncio.to_thread(_write_new, path, slot_file)
        try:
            answer = await self._call("POST", f"/slots/{slot}?action=restore", {"filename": name})
        finally:
            await asyncio.to_thread(path.unlink, True)
        return _int(answer.get("n_restored"))

    # -- saving ----------------------------------------------------------------------------------------

    async def save(self, slot: int, token_ids: Sequence[int], model: str) -> bytes | None:
        """Save ``slot`` (which just served a prompt of ``token_ids`` for ``model``) into kvcached under the
        prompt's key; the key, or ``None`` when nothing was stored (prompt under one block, or the slot
        file does not start with the prompt). :class:`~agent.errors.EngineError` when the engine fails,
        :class:`AgentError` when kvcached does."""
        key = slot_key(model, token_ids, self.block_size)
        if key is None:
            return None
        digest, prefix = key
        slot_file, answer = await self._save_file(slot)
        held = state_tokens(slot_file)
        if held is None or held[:prefix] != list(token_ids[:prefix]):
            log.warning("engine %s slot %d: holds another prompt now; not stored", self.engine_id, slot)
            return None
        saved = answer.get("n_saved")
        record = SlotRecord(prefix, saved if isinstance(saved, int) else prefix, self.block_size, slot_file)
        await self._put(bytes(digest), encode_slot_record(record))
        log.info("engine %s slot %d: saved %d prefix tokens (%d bytes)", self.engine_id, slot, prefix,
                 len(slot_file))  # fmt: skip
        return bytes(digest)

    async def save_slot(self, slot: int, model: str, *, min_tokens: int = 0) -> SaveOutcome:
        """Save ``slot`` into kvcached keyed by the tokens its file holds: the blob under the chain's last
        digest, then a marker under every earlier digest kvcached lacks (module docstring). Nothing is put
        when the file has fewer than ``min_tokens`` tokens or no full block, when its token list cannot be
        read or disagrees with the engine's ``n_saved``, or when kvcached holds the chain's last digest
        already. Errors as :meth:`save`."""
        slot_file, answer = await self._save_file(slot)
        tokens = state_tokens(slot_file)
        saved = answer.get("n_saved")
        if tokens is None or (isinstance(saved, int) and saved != len(tokens)):
            return SaveOutcome("unreadable", file_bytes=len(slot_file))
        chain = block_digests(chain_seed(model), tokens, self.block_size)
        if not chain or len(tokens) < min_tokens:
            return SaveOutcome("short", len(tokens), len(chain), file_bytes=len(slot_file))
        keys = [bytes(d) for d in chain]
        held = await self._contains(keys)
        if held[-1]:
            return SaveOutcome("held", len(tokens), len(chain), file_bytes=len(slot_file))
        prefix = len(chain) * self.block_size
        await self._put(
            keys[-1], encode_slot_record(SlotRecord(prefix, len(tokens), self.block_size, slot_file))
        )
        markers = 0
        for i, key in enumerate(keys[:-1]):
            if not held[i]:
                marker = ChainMarker((i + 1) * self.block_size, keys[-1], prefix, self.block_size)
                await self._put(key, encode_marker(marker))
                markers += 1
        return SaveOutcome("stored", len(tokens), len(chain), markers, len(slot_file))

    # -- restoring -------------------------------------------------------------------------------------

    async def restore(self, slot: int, token_ids: Sequence[int], model: str) -> int:
        """Restore the longest saved prefix of ``token_ids`` into ``slot``; the prompt tokens the slot
        then holds (a multiple of the block size), 0 when kvcached has no prefix of them."""
        chain = block_digests(chain_seed(model), token_ids, self.block_size)
        outcome = await self.restore_chain(chain, model, slot=slot)
        return outcome.matched_tokens

    async def restore_chain(
        self, chain: Sequence[Digest], model: str, *, slot: int | None = None, once: Flight = _every_time
    ) -> RestoreOutcome:
        """Restore the longest prefix of ``chain`` kvcached can give (module docstring) into ``slot``, or
        into an idle slot when ``slot`` is ``None``. ``once(blob, load)`` runs the fetch-and-load of one
        blob (a single-flight group shares it between concurrent callers). Errors as :meth:`save`."""
        if not chain:
            return RestoreOutcome("miss")
        keys = [bytes(d) for d in chain]
        held = await self._contains(keys)
        order = [i for i in reversed(range(len(keys))) if held[i]]
        if not held[-1]:
            order.insert(0, len(keys) - 1)  # the gateway saw it on some node: let kvcached ask its peers
        failed: set[bytes] = set()
        for index in order[:MAX_LOOKUPS]:
            raw = await self._get(keys[index])
            if raw is None:
                continue
            record = decode_slot_record(raw)
            marker = None if record is not None else decode_marker(raw)
            prefix = (index + 1) * self.block_size
            if record is not None and record.prefix_tokens == prefix and record.block_size == self.block_size:
                blob = keys[index]
            elif (
                marker is not None and marker.prefix_tokens == prefix and marker.block_size == self.block_size
            ):
                blob = marker.blob
            else:
                log.warning("engine %s: value at block %d is neither a slot record nor a marker",
                            self.engine_id, index)  # fmt: skip
                continue
            if blob in failed:
                continue

            async def load(
                blob: bytes = blob, record: SlotRecord | None = record, index: int = index
            ) -> RestoreOutcome:
                return await self._fetch_and_load(blob, record, chain, index, model, slot)

            outcome = await once(blob, load)
            if outcome.outcome == "restored":  # a shared flight may have served a shorter request
                return dataclasses.replace(outcome, matched_tokens=(index + 1) * self.block_size)
            if outcome.outcome != "miss":
                return outcome
            failed.add(blob)
        return RestoreOutcome("miss")

    async def _fetch_and_load(
        self,
        blob: bytes,
        record: SlotRecord | None,
        chain: Sequence[Digest],
        index: int,
        model: str,
        slot: int | None,
    ) -> RestoreOutcome:
        if record is None:
            raw = await self._get(blob)
            record = None if raw is None else decode_slot_record(raw)
            if record is None or record.block_size != self.block_size:
                return RestoreOutcome("miss")  # the marker's blob is gone (or is not one)
        tokens = state_tokens(record.slot_file)
        matched = (index + 1) * self.block_size
        if tokens is None or len(tokens) < matched:
            log.warning("engine %s: slot record without a readable token list; skipped", self.engine_id)
            return RestoreOutcome("miss")
        if block_digests(chain_seed(model), tokens[:matched], self.block_size)[-1] != chain[index]:
            log.warning("engine %s: slot record does not hold the requested prefix; skipped", self.engine_id)
            return RestoreOutcome("miss")
        target = slot if slot is not None else await self.idle_slot()
        if target is None:
            return RestoreOutcome("busy")
        restored = await self._load(target, record.slot_file)
        log.info("engine %s slot %d: restored %d tokens (%d of the request's prefix)", self.engine_id, target,
                 restored or len(tokens), matched)  # fmt: skip
        return RestoreOutcome("restored", target, restored or len(tokens), matched)

    # -- kvcached --------------------------------------------------------------------------------------

    async def _contains(self, keys: Sequence[bytes]) -> list[bool]:
        try:
            return await self.store.contains(keys)
        except Exception as exc:  # the store's own errors (kvcached down, bad input): one family here
            raise AgentError(f"kvcached contains failed: {exc}") from exc

    async def _get(self, key: bytes) -> bytes | None:
        try:
            return await self.store.get(key)
        except Exception as exc:
            raise AgentError(f"kvcached get failed: {exc}") from exc

    async def _put(self, key: bytes, value: bytes) -> None:
        try:
            await self.store.put(key, value)
        except Exception as exc:
            raise AgentError(f"kvcached put failed: {exc}") from exc

    async def _call(self, method: str, path: str, body: Mapping[str, Any] | None) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
            self._owned = True
        where = path.split("?")[0]
        try:
            async with self._session.request(method, self.base_url + path, json=body) as resp:
                text = await resp.text(errors="replace")  # not UTF-8: "not JSON" below, no crash
                if resp.status != 200:
                    raise EngineError(self.engine_id, f"{where}: HTTP {resp.status}: {text[:300]}")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise EngineError(self.engine_id, f"{where}: {exc!r}") from exc
        try:
            answer = msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise EngineError(self.engine_id, f"{where}: not JSON") from exc
        if body is not None and not isinstance(answer, dict):
            raise EngineError(self.engine_id, f"{where}: not a JSON object")
        return answer


def slot_dir(engine: EngineConfig, state_dir: str) -> Path:
    """Where the agent points a llama-server's ``--slot-save-path`` (:mod:`engines.llama_cpp` renders it)."""
    return Path(state_dir, "slots", engine.id)


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _filename(action: str) -> str:
    """A fresh file name in the slot directory (llama-server refuses names with path separators)."""
    return f"kvgate-{action}-{secrets.token_hex(8)}.bin"


def _write_new(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
