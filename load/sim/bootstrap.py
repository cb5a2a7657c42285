"""Prefill/decode disaggregation in the simulator, SGLang's way: bootstrap fields and rooms.

An SGLang server started with ``--disaggregation-mode prefill|decode`` serves only requests that carry
``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room`` (its router sends the same body to a prefill
and a decode server at once); anything else is refused with 400 ``Disaggregated request received without
bootstrap room id``. The pair meets in the room:

* the **prefill** server runs a bootstrap HTTP server on ``--disaggregation-bootstrap-port`` (SGLang's
  ``CommonKVBootstrapServer``: ``GET /health``, ``GET /route``); its request waits in the bootstrap queue
  until the decode server of its room has connected (at most ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``
  s, 300), then prefills, samples one token, pushes the KV the decode side lacks and answers with that
  one token (``finish_reason: "length"``);
* the **decode** server connects to the prefill server named by the request (``host:bootstrap_port``),
  waits for the room's KV (at most ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` s, 300) and decodes without
  computing the prompt. An unreachable bootstrap server or a room that never gets its KV ends the request
  with a 500.

In SGLang the KV and the "done" signal travel over ZMQ and RDMA (NIXL, Mooncake) between the ranks the
bootstrap server names. The simulator's stand-in is one long-polled route on the prefill replica's
bootstrap server, ``POST /_sim/kv/{room}`` (the decode side's handshake: its replica id and how many
prompt tokens it already holds), answered once the prompt is computed, with how many tokens' KV move; both
sides then take ``TimingModel.transfer_s`` of them. :class:`Rooms` is that table (sans IO but for asyncio
futures); :func:`read_bootstrap` reads a request's fields.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any

from load.sim.errors import SimError

#: SGLang's ``--disaggregation-mode`` values (``null``: a plain server).
MODES = ("null", "prefill", "decode")
#: SGLang's default ``--disaggregation-bootstrap-port``.
DEFAULT_BOOTSTRAP_PORT = 8998
#: SGLang's environment variables bounding the two waits (seconds; its defaults).
BOOTSTRAP_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
WAITING_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
#: SGLang's refusal of a request without a room on a disaggregated server (HTTP 400).
NO_ROOM = "Disaggregated request received without bootstrap room id"
#: The largest room id (a signed 64-bit integer in SGLang).
MAX_ROOM = (1 << 63) - 1


def env_timeout(name: str, environ: dict[str, str] | None = None) -> float:
    """Seconds from SGLang's environment variable ``name`` (its default 300 when unset); ``ValueError``
    when it is not a positive number."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    value = float(raw)
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {raw!r}")
    return value


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """A request's bootstrap fields: the prefill server's ``host``, its bootstrap ``port``, the ``room``."""

    host: str
    port: int
    room: int

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def read_bootstrap(body: dict[str, Any], mode: str) -> Bootstrap | None:
    """The bootstrap fields of a request to a server in ``mode`` (``None`` for a plain server, which
    ignores them as SGLang does); 400 without a room (or with fields of the wrong type) on a prefill or
    decode server. Batched fields (lists, one per prompt) are refused: the simulator pairs one prompt."""
    if mode == "null":
        return None
    room, host, port = body.get("bootstrap_room"), body.get("bootstrap_host"), body.get("bootstrap_port")
    if room is None:
        raise SimError(400, f"Invalid request: {NO_ROOM}")
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
        raise SimError(400, "bootstrap_room must be an integer in [0, 2^63)", param="bootstrap_room")
    if mode == "prefill":  # the prefill server is the host; it reads only the room
        return Bootstrap(host if isinstance(host, str) else "", port if isinstance(port, int) else 0, room)
    if not isinstance(host, str) or not host:
        raise SimError(400, "bootstrap_host must be the prefill server's host", param="bootstrap_host")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise SimError(
            400, "bootstrap_port must be the prefill server's bootstrap port", param="bootstrap_port"
        )
    return Bootstrap(host, port, room)


@dataclass(frozen=True, slots=True)
class Handshake:
    """The decode side of a room connected: its replica id and how many prompt tokens it holds."""

    decode: str
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Prefilled:
    """The prefill side computed the room's prompt: its replica id, the prompt's length and the tokens
    whose KV moves to the decode side (the prompt less what the decode holds, less the last token)."""

    engine_id: str
    prompt_tokens: int
    tokens: int


@dataclass(slots=True)
class _Room:
    decode: asyncio.Future[Handshake] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    kv: asyncio.Future[Prefilled] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    waiters: int = 0


class RoomFailed(Exception):
    """The room's other side gave up (its reason)."""


class Rooms:
    """The rooms of one prefill replica: each pairs its prefill request with one decode handshake. A room
    lives while a side waits on it and is dropped when the last one leaves, so the table stays bounded
    by the requests in flight."""

    def __init__(self) -> None:
        self._rooms: dict[int, _Room] = {}

    def __len__(self) -> int:
        return len(self._rooms)

    def _enter(self, room: int) -> _Room:
        state = self._rooms.get(room)
        if state is None:
            state = self._rooms[room] = _Room()
        state.waiters += 1
        return state

    def _leave(self, room: int, state: _Room) -> None:
        state.waiters -= 1
        if state.waiters <= 0 and self._rooms.get(room) is state:
            del self._rooms[room]

    async def wait_decode(self, room: int, timeout_s: float) -> Handshake:
        """The prefill request of ``room``: wait until its decode side connects; ``TimeoutError`` past
        ``timeout_s``. Call :meth:`prefilled` or :meth:`fail` then, and :meth:`release` when done."""
        state = self._enter(room)
        return await asyncio.wait_for(asyncio.shield(state.decode), timeout_s)

    def prefilled(self, room: int, result: Prefilled) -> None:
        state = self._rooms.get(room)
        if state is not None and not state.kv.done():
            state.kv.set_result(result)

    def fail(self, room: int, reason: str) -> None:
        """The prefill side of ``room`` failed or was aborted: its decode side learns why."""
        state = self._rooms.get(room)
        if state is not None and not state.kv.done():
            state.kv.set_exception(RoomFailed(reason))
            state.kv.exception()  # retrieved: no "never retrieved" warning when nobody waits

    def release(self, room: int) -> None:
        """The prefill request of ``room`` ended (after :meth:`wait_decode`, however it ended)."""
        state = self._rooms.get(room)
        if state is not None:
            if not state.kv.done():
                self.fail(room, "the prefill request ended before its KV was sent")
            self._leave(room, state)

    async def connect(self, room: int, handshake: Handshake) -> Prefilled:
        """The decode side of ``room`` connects and waits for its KV (bounded by the caller);
        :class:`RoomFailed` when the prefill side failed, or when another decode already holds the room."""
        state = self._enter(room)
        try:
            if state.decode.done():
                raise RoomFailed(f"room {room} already has a decode receiver")
            state.decode.set_result(handshake)
            return await asyncio.shield(state.kv)
        finally:
            self._leave(room, state)
