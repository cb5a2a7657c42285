"""The agent's llama.cpp slot routes (admin API, with ``[agent] kvcached``): :class:`SlotAdmin`.

- ``POST /slots/restore-chain`` ``{"engine": id, "digests": [hex, ...]}``: what a gateway sends before it
  routes a request to ``engine`` (:mod:`extproc.control.restore`): the request's digest chain (32 hex digits
  each, the gateway's own chain, up to the lead some node's kvcached holds). The longest prefix kvcached can
  give is restored into an idle slot (:meth:`agent.slots.SlotCache.restore_chain`). Concurrent requests for
  the same blob on the same engine share one fetch and restore (single flight). Answers 200 with
  ``{engine, outcome: "restored"|"miss", restored, slot, tokens, matched_tokens, ms}``; 409 when no slot
  is idle (nothing is restored); 400 for a bad body or an engine that is not a llama-server the agent runs;
  404 for an unknown engine; 503 when it is not ready; 502 when the engine or kvcached failed.
- ``POST /slots/save`` and ``POST /slots/restore`` ``{"engine": id, "slot": n, "messages": [...]}``: the
  manual flow; the prompt's tokens come from the engine's own ``/apply-template`` and ``/tokenize``.
  Answers 200 with ``{engine, slot, prompt_tokens, tokens, ms, ...}``, errors as above.

Errors are OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}``
(:func:`agent.admin.error_response`); with ``[agent.tls]`` every route here needs a client certificate of
an allowed role (401 without, 403 for another role, :mod:`agent.admin`). No prompt
or token is ever logged.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import msgspec
from aiohttp import web

from agent.admin import error_response
from agent.errors import AgentError
from agent.slots import SLOT_BLOCK_SIZE, RestoreOutcome, SlotCache, SlotStore, slot_dir
from agent.supervisor import EngineState, EngineSupervisor
from contracts.digest import DIGEST_BYTES, Digest
from engines.config import EngineConfig

log = logging.getLogger(__name__)

RESTORE_CHAIN_PATH = "/slots/restore-chain"
#: Longest chain accepted (blocks): the gateway sends at most its ``max_match_blocks`` (default 256).
MAX_CHAIN_BLOCKS = 8192
#: Deadline of one engine HTTP call (a slot file of a long context takes a while to write or load).
ENGINE_TIMEOUT_S = 60.0


class _EngineHandle(Protocol):
    @property
    def config(self) -> EngineConfig: ...

    @property
    def supervisor(self) -> EngineSupervisor: ...


class SlotHost(Protocol):
    """What :class:`SlotAdmin` needs of the agent: its engines by id."""

    @property
    def engines(self) -> Mapping[str, _EngineHandle]: ...


class SlotRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The body of ``POST /slots/save`` and ``/slots/restore``."""

    engine: str
    slot: int
    messages: list[dict[str, Any]]


class ChainRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The body of ``POST /slots/restore-chain``."""

    engine: str
    digests: list[str]


@dataclass(slots=True)
class RestoreStats:
    """Per engine: restores by outcome (``restored``, ``miss``, ``busy``: 409, ``failed``: 502) and
    ``joined``: requests that shared a restore already under way (single flight)."""

    restored: int = 0
    miss: int = 0
    busy: int = 0
    failed: int = 0
    joined: int = 0


class SlotAdmin:
    """The slot routes over ``host``'s engines and the node's kvcached ``store`` (module docstring).

    Keeps one :class:`~agent.slots.SlotCache` per engine on one HTTP session (also used by
    :mod:`agent.autosave`), the restores in flight and per-engine :class:`RestoreStats`. ``block_size``:
    tokens per digest block, the gateways' index block size (set it before the first engine is ready).
    """

    def __init__(self, host: SlotHost, store: SlotStore, *, block_size: int = SLOT_BLOCK_SIZE) -> None:
        self._host, self._store, self.block_size = host, store, block_size
        self._session: aiohttp.ClientSession | None = None
        self._caches: dict[str, SlotCache] = {}
        self._flights: dict[tuple[str, bytes], asyncio.Task[RestoreOutcome]] = {}
        self.stats: dict[str, RestoreStats] = {}

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/slots/save", self._save),
            web.post("/slots/restore", self._restore),
            web.post(RESTORE_CHAIN_PATH, self._restore_chain),
        ]

    def cache(self, engine_id: str) -> SlotCache | None:
        """The slot cache of a llama_cpp engine the agent runs, as currently launched (``None`` if it has
        no launch yet)."""
        eng = self._host.engines.get(engine_id)
        if eng is None or eng.supervisor.launch is None:
            return None
        base_url = eng.supervisor.launch.base_url
        cache = self._caches.get(engine_id)
        if cache is None or cache.base_url != base_url.rstrip("/") or cache.block_size != self.block_size:
            if self._session is None:
                self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ENGINE_TIMEOUT_S))
            directory = slot_dir(eng.config, eng.supervisor.agent.state_dir)
            cache = SlotCache(
                self._store, base_url, directory, block_size=self.block_size, session=self._session,
                engine_id=engine_id,
            )  # fmt: skip
            self._caches[engine_id] = cache
        return cache

    async def aclose(self) -> None:
        """Cancel restores in flight and close the HTTP session."""
        for task in list(self._flights.values()):
            task.cancel()
        await asyncio.gather(*self._flights.values(), return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- routes ----------------------------------------------------------------------------------------

    async def _restore_chain(self, request: web.Request) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read(), type=ChainRequest)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return error_response(400, f"bad request: {_reason(exc)}")
        chain = _parse_chain(body.digests)
        if isinstance(chain, str):
            return error_response(400, f"bad request: {chain}")
        found = self._engine(body.engine)
        if isinstance(found, web.Response):
            return found
        cfg, cache = found
        stats = self.stats.setdefault(cfg.id, RestoreStats())
        began = time.perf_counter()
        try:
            if await cache.idle_slot() is None:
                stats.busy += 1
                return error_response(409, f"engine {cfg.id}: no idle slot")
            once = functools.partial(self._once, cfg.id)
            outcome = await cache.restore_chain(chain, cfg.model, once=once)
        except AgentError as exc:
            stats.failed += 1
            log.warning("slot restore on %s failed: %s", cfg.id, exc)
            return error_response(502, str(exc))
        if outcome.outcome == "busy":
            stats.busy += 1
            return error_response(409, f"engine {cfg.id}: no idle slot")
        if outcome.outcome == "restored":
            stats.restored += 1
        else:
            stats.miss += 1
        return web.json_response(
            {
                "engine": cfg.id,
                "outcome": outcome.outcome,
                "restored": outcome.outcome == "restored",
                "slot": outcome.slot,
                "tokens": outcome.tokens,
                "matched_tokens": outcome.matched_tokens,
                "ms": round((time.perf_counter() - began) * 1000, 3),
            }
        )

    async def _save(self, request: web.Request) -> web.Response:
        return await self._messages(request, "save")

    async def _restore(self, request: web.Request) -> web.Response:
        return await self._messages(request, "restore")

    async def _messages(self, request: web.Request, action: str) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read(), type=SlotRequest)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return error_response(400, f"bad request: {_reason(exc)}")
        if body.slot < 0:
            return error_response(400, "bad request: slot must be >= 0")
        found = self._engine(body.engine)
        if isinstance(found, web.Response):
            return found
        cfg, cache = found
        began = time.perf_counter()
        try:
            tokens = await cache.prompt_tokens(body.messages)
            out: dict[str, Any] = {"engine": cfg.id, "slot": body.slot, "prompt_tokens": len(tokens)}
            if action == "save":
                key = await cache.save(body.slot, tokens, cfg.model)
                covered = len(tokens) // cache.block_size * cache.block_size if key is not None else 0
                out |= {"saved": key is not None, "key": key.hex() if key else None, "tokens": covered}
            else:
                out["tokens"] = await cache.restore(body.slot, tokens, cfg.model)
        except AgentError as exc:
            log.warning("slot %s on %s failed: %s", action, cfg.id, exc)
            return error_response(502, str(exc))
        out["ms"] = round((time.perf_counter() - began) * 1000, 3)
        return web.json_response(out)

    def _engine(self, engine_id: str) -> tuple[EngineConfig, SlotCache] | web.Response:
        """The engine's config and slot cache, or the error answer (404, 400, 503)."""
        eng = self._host.engines.get(engine_id)
        if eng is None:
            return error_response(404, f"no engine {engine_id!r}")
        cfg = eng.config
        if cfg.kind != "llama_cpp" or not cfg.started:
            return error_response(
                400, f"engine {cfg.id}: slot save/restore needs a llama_cpp engine the agent runs"
            )
        cache = self.cache(cfg.id)
        if cache is None or eng.supervisor.state is not EngineState.READY:
            return error_response(503, f"engine {cfg.id} is not ready")
        return cfg, cache

    async def _once(
        self, engine_id: str, blob: bytes, make: Callable[[], Awaitable[RestoreOutcome]]
    ) -> RestoreOutcome:
        """Run ``make`` unless a restore of ``blob`` into ``engine_id`` is under way; then share its
        outcome. The restore runs to its end even if every caller stops waiting."""
        key = (engine_id, blob)
        task = self._flights.get(key)
        if task is None:
            task = asyncio.ensure_future(make())
            self._flights[key] = task
            task.add_done_callback(functools.partial(self._landed, key))
        else:
            self.stats.setdefault(engine_id, RestoreStats()).joined += 1
        return await asyncio.shield(task)

    def _landed(self, key: tuple[str, bytes], task: asyncio.Task[RestoreOutcome]) -> None:
        if self._flights.get(key) is task:
            del self._flights[key]
        if not task.cancelled() and task.exception() is not None:  # seen by its callers, if any are left
            log.debug("slot restore on %s ended with %r", key[0], task.exception())


def _parse_chain(values: list[str]) -> list[Digest] | str:
    """The digests of a ``restore-chain`` body, or why they are not acceptable."""
    if not values or len(values) > MAX_CHAIN_BLOCKS:
        return f"digests: expected 1 to {MAX_CHAIN_BLOCKS} hex digests, got {len(values)}"
    chain: list[Digest] = []
    for i, value in enumerate(values):
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raw = b""
        if len(raw) != DIGEST_BYTES:
            return f"digests[{i}]: expected {2 * DIGEST_BYTES} hex digits"
        chain.append(Digest(raw))
    return chain


def _reason(exc: Exception) -> str:
    return str(exc) if isinstance(exc, msgspec.ValidationError) else "body is not JSON"
