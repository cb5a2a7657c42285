"""An engine's vLLM KV events on the wire: decoding, sequence checking and the ZMQ subscriber.

vLLM (REFERENCE.md section 5) publishes on a ZMQ PUB socket one multipart message per engine step,
``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter from 0, ``payload`` msgpack of a batch
``[ts, events, data_parallel_rank]``. :func:`decode_payload` accepts every encoding vLLM has used: the
batch as an array or as a map, events as maps tagged by ``"type"`` (current) or as positional arrays
with the tag first (older releases), block hashes as integers (the low 64 bits of the engine's hash)
or raw bytes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``). Unknown map fields are ignored.

PUB/SUB loses messages (a slow joiner, a full high-water mark): :class:`SeqChecker` spots the holes in
``seq`` and :class:`KvEventSubscriber` asks the engine's ROUTER replay socket for what it missed
(request ``[b"", start_seq]``; answers ``[b"", seq, payload]`` then the end marker ``seq == -1``).
What replay cannot cover, and an engine restart (``seq`` starting again), is reported as
:class:`EventsLost`: the engine's blocks are no longer known, so the consumer should clear the endpoint.
vLLM's stream carries no instance id: a restarted engine is seen by its ``seq`` going back, except when
the new process's first batch received is numbered at or after the next one expected (its first batches
published while the SUB socket was reconnecting). So after the connection to the engine broke (a ZMQ
monitor's ``EVENT_DISCONNECTED``), the first batch received at or after the expected ``seq`` is checked:
the engine's replay of the last batch applied must be that batch, byte for byte; otherwise (another
payload, none, no replay socket) it is a restart, reported as one.

Bounds: a message over :data:`MAX_MESSAGE_BYTES` (``zmq.MAXMSGSIZE`` on both sockets) drops the connection
(ZMQ reconnects; what was published meanwhile is a gap); the SUB socket queues at most
:data:`LIVE_HWM` batches (ZMQ drops newer ones: a gap); a replay takes at most
``SubscriberConfig.max_replay_batches`` batches (:data:`MAX_REPLAY_BATCHES`): from there on, it is given
up and reported lost (``"replay_limit"``), its batches dropped, and the next batch received is applied.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

from agent.errors import AgentError
from contracts.errors import MSGPACK_ERRORS

log = logging.getLogger(__name__)

#: ``zmq.MAXMSGSIZE`` of the SUB and replay sockets: one engine step's batch is far smaller (a 64k-token
#: prefill stored at once is ~0.5 MiB of msgpack).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: ``zmq.RCVHWM`` of the SUB socket, in batches (ZMQ's default, 1000, is one second of a busy engine).
LIVE_HWM = 10_000
#: The most batches one replay takes (vLLM buffers 10,000 steps by default).
MAX_REPLAY_BATCHES = 20_000

EngineHash = int | bytes
"""An engine block hash as sent: an integer, or the engine's full digest as bytes."""


class KvEventDecodeError(AgentError, ValueError):
    """A message that is not a vLLM KV event batch."""


class BlockStored(msgspec.Struct, frozen=True, gc=False, tag=True):
    """Consecutive full blocks entered the engine's cache (``medium``: GPU, CPU or STORAGE).
    ``token_ids`` holds ``len(block_hashes) * block_size`` tokens; ``parent_block_hash`` is the hash
    of the block before the first (``None``: the sequence starts here)."""

    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, frozen=True, gc=False, tag=True):
    """Blocks left the engine's cache in ``medium``."""

    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False, tag=True):
    """The engine dropped its whole prefix cache."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class _StoredArray(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _RemovedArray(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedArray(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


_ArrayEvent = _StoredArray | _RemovedArray | _ClearedArray


E = TypeVar("E")


class _ArrayBatch(msgspec.Struct, Generic[E], array_like=True):
    ts: float
    events: list[E]
    data_parallel_rank: int | None = None


class _MapBatch(msgspec.Struct, Generic[E]):
    ts: float
    events: list[E]
    data_parallel_rank: int | None = None


_DECODERS: tuple[msgspec.msgpack.Decoder[Any], ...] = tuple(
    msgspec.msgpack.Decoder(t)
    for t in (_ArrayBatch[KvEvent], _ArrayBatch[_ArrayEvent], _MapBatch[KvEvent], _MapBatch[_ArrayEvent])
)
"""Tried in order: vLLM 0.33's encoding first."""


@dataclass(frozen=True, slots=True)
class KvBatch:
    """One decoded batch: the events of one engine step. ``ts``: the engine's wall clock (seconds since
    the epoch) when it built the batch; ``seq``: its position in the engine's stream."""

    seq: int
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class EventsLost:
    """Batches ``first_missing`` up to (not including) ``resumed_at`` are lost for good; ``reason``:
    ``"gap"`` (not replayable), ``"restart"`` (the engine's ``seq`` went back: a new engine process),
    ``"undecodable"`` (a batch arrived but did not decode), ``"replay_limit"`` (a replay longer than
    ``max_replay_batches``). Either is ``None`` when unknown (``resumed_at``: the next batch received)."""

    first_missing: int | None
    resumed_at: int | None
    reason: str


def _canonical(event: KvEvent | _ArrayEvent) -> KvEvent:
    if isinstance(event, _StoredArray):
        return BlockStored(**msgspec.structs.asdict(event))
    if isinstance(event, _RemovedArray):
        return BlockRemoved(**msgspec.structs.asdict(event))
    if isinstance(event, _ClearedArray):
        return AllBlocksCleared()
    return event


def decode_payload(payload: bytes, seq: int = 0) -> KvBatch:
    """The batch in a payload frame; :class:`KvEventDecodeError` when it is none of vLLM's encodings."""
    first: Exception | None = None
    for decoder in _DECODERS:
        try:
            raw = decoder.decode(payload)
        except MSGPACK_ERRORS as exc:
            first = first or exc
            continue
        events = raw.events
        if events and not isinstance(events[0], BlockStored | BlockRemoved | AllBlocksCleared):
            events = [_canonical(e) for e in events]
        return KvBatch(seq, raw.ts, events, raw.data_parallel_rank)
    raise KvEventDecodeError(f"not a vLLM KV event batch: {first}") from first


def decode_message(frames: list[bytes]) -> KvBatch:
    """A batch from a PUB message ``[topic, seq, payload]`` (or ``[seq, payload]`` without topic)."""
    if len(frames) not in (2, 3) or len(frames[-2]) != 8:
        raise KvEventDecodeError(f"expected [topic, seq(8 bytes), payload], got {len(frames)} frames")
    return decode_payload(frames[-1], int.from_bytes(frames[-2], "big"))


class SeqVerdict(enum.Enum):
    """What to do with a batch (:class:`SeqChecker`)."""

    APPLY = "apply"
    """The next batch in order (or the first one seen): apply it."""
    DUPLICATE = "duplicate"
    """Already applied (a replay overlapping the live stream): skip it."""
    GAP = "gap"
    """Batches before it are missing: recover them (replay) before applying it."""
    RESTART = "restart"
    """The live ``seq`` went back: the engine restarted; its cache is new. Position reset to it."""


@dataclass(slots=True)
class SeqChecker:
    """The position in one engine's stream: the next ``seq`` expected. Pure bookkeeping.

    ``next_seq`` ``None``: the first batch seen sets the position (a subscriber joining a running
    engine); ``0``: everything the engine published is wanted (catch up by replay).
    """

    next_seq: int | None = None
    _catching_up: bool = field(default=False, repr=False)

    def check(self, seq: int) -> SeqVerdict:
        """Classify a live batch; APPLY and RESTART move the position past it."""
        if self.next_seq is None or seq == self.next_seq:
            self.next_seq = seq + 1
            self._catching_up = False
            return SeqVerdict.APPLY
        if seq > self.next_seq:
            return SeqVerdict.GAP
        if self._catching_up:  # live batches queued while a replay delivered them
            return SeqVerdict.DUPLICATE
        self.next_seq = seq + 1
        return SeqVerdict.RESTART

    def check_replayed(self, seq: int) -> SeqVerdict:
        """Classify a replayed batch (or a live one right after a replay); APPLY moves the position.
        Older live batches still queued on the SUB socket are then duplicates, not a restart."""
        self._catching_up = True
        if self.next_seq is None or seq == self.next_seq:
            self.next_seq = seq + 1
            return SeqVerdict.APPLY
        return SeqVerdict.DUPLICATE if seq < self.next_seq else SeqVerdict.GAP

    def skip_to(self, seq: int) -> None:
        """Give up on the batches before ``seq``: it is the next one applied."""
        self.next_seq = seq


@dataclass(frozen=True, slots=True)
class SubscriberConfig:
    """Where one engine publishes: ``endpoint`` (its PUB socket, e.g. ``tcp://10.0.0.5:5557``),
    ``replay_endpoint`` (its ROUTER socket; ``None``: gaps cannot be recovered), ``topic`` (prefix
    filter). ``catch_up``: replay from seq 0 at start, to learn what the engine cached before the
    subscriber joined. ``replay_timeout_s``: seconds to wait for each replay message;
    ``max_replay_batches``: the most batches one replay takes (module docstring)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    catch_up: bool = False
    replay_timeout_s: float = 2.0
    max_replay_batches: int = MAX_REPLAY_BATCHES

    def __post_init__(self) -> None:
        if self.replay_timeout_s <= 0:
            raise ValueError("replay_timeout_s must be positive")
        if self.max_replay_batches < 1:
            raise ValueError("max_replay_batches must be at least 1")
        if self.catch_up and self.replay_endpoint is None:
            raise ValueError("catch_up needs a replay_endpoint")


@dataclass(slots=True)
class SubscriberStats:
    """Counters, in batches."""

    received: int = 0
    replayed: int = 0
    duplicates: int = 0
    lost_reports: int = 0
    undecodable: int = 0
    replay_requests: int = 0
    replay_timeouts: int = 0
    replay_truncated: int = 0
    """Replays given up at ``max_replay_batches`` (their batches reported lost)."""


class KvEventSubscriber:
    """One engine's KV event stream, in order: ``async for item in subscriber`` yields
    :class:`KvBatch` es, and :class:`EventsLost` where batches could not be recovered.

    :meth:`start` connects (in the running loop); :meth:`aclose` closes, after which iteration ends.
    Cancel the task that iterates, or close from it.
    """

    def __init__(self, config: SubscriberConfig) -> None:
        self.config = config
        self.stats = SubscriberStats()
        self.checker = SeqChecker(0 if config.catch_up else None)
        self._ready: deque[KvBatch | EventsLost] = deque()
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._initial_replay = config.catch_up
        self._closed = False
        #: ``EVENT_DISCONNECTED`` of the SUB socket (a synchronous view of its monitor socket).
        self._monitor: zmq.Socket[bytes] | None = None
        self._monitor_socket: zmq.asyncio.Socket | None = None
        #: The last batch emitted (seq, payload): what a replay must give back after a reconnection.
        self._last: tuple[int, bytes] | None = None

    async def start(self) -> None:
        """Connect to the engine's PUB socket (the replay socket is connected on first use)."""
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sub.setsockopt(zmq.RCVHWM, LIVE_HWM)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
        self._monitor_socket = self._sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._monitor = zmq.Socket.shadow(self._monitor_socket.underlying)
        self._sub.connect(self.config.endpoint)

    async def aclose(self) -> None:
        """Close the sockets (idempotent)."""
        self._closed = True
        if self._sub is not None and self._monitor_socket is not None:
            self._sub.disable_monitor()
        for sock in (self._monitor_socket, self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._dealer = self._monitor_socket = self._monitor = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __aiter__(self) -> KvEventSubscriber:
        return self

    async def __anext__(self) -> KvBatch | EventsLost:
        while not self._ready:
            if self._closed or self._sub is None:
                raise StopAsyncIteration
            try:
                await self._pump()
            except (asyncio.CancelledError, zmq.ZMQError):
                task = asyncio.current_task()
                if self._closed and (task is None or not task.cancelling()):
                    raise StopAsyncIteration from None  # closed under a pending receive
                raise
        return self._ready.popleft()

    def take_ready(self) -> list[KvBatch | EventsLost]:
        """The items already received and not yet iterated, oldest first; never waits. A replay (the
        catch-up at start, or a gap's) delivers its batches at once, so a caller can act on the run as a
        whole (:func:`agent.main.feed_batches`)."""
        items = list(self._ready)
        self._ready.clear()
        return items

    async def _pump(self) -> None:
        if self._initial_replay:
            self._initial_replay = False
            await self._recover(None)
            return
        assert self._sub is not None
        frames = await self._sub.recv_multipart()
        self.stats.received += 1
        if len(frames) not in (2, 3) or len(frames[-2]) != 8:
            self.stats.undecodable += 1
            log.warning("%s: ignoring a message of %d frames", self.config.endpoint, len(frames))
            return
        seq, payload = int.from_bytes(frames[-2], "big"), frames[-1]
        if self._disconnected() and await self._restarted_unseen(seq):
            self.checker.skip_to(seq + 1)  # as check() does for a seq that went back
            verdict = SeqVerdict.RESTART
        else:
            verdict = self.checker.check(seq)
        if verdict is SeqVerdict.GAP:
            await self._recover((seq, payload))
            return
        if verdict is SeqVerdict.DUPLICATE:
            self.stats.duplicates += 1
            return
        if verdict is SeqVerdict.RESTART:
            log.warning("%s: seq %d: the engine restarted", self.config.endpoint, seq)
            if self.config.replay_endpoint is not None:  # the new engine's first batches may be missed
                self._lost(None, 0, "restart")
                self.checker.skip_to(0)
                await self._recover((seq, payload))
                return
            self._lost(None, seq, "restart")
        self._emit(seq, payload)

    def _disconnected(self) -> bool:
        """Whether the connection to the engine broke since the last call (never waits)."""
        broke = False
        while self._monitor is not None and self._monitor.poll(0):
            self._monitor.recv_multipart()
            broke = True
        return broke

    async def _restarted_unseen(self, seq: int) -> bool:
        """After a broken connection, whether live ``seq`` (at or after the expected one: a seq that went
        back is a restart anyway) comes from a new engine process: the engine's replay of the last batch
        emitted is not that batch (module docstring)."""
        expected, last = self.checker.next_seq, self._last
        if expected is None or seq < expected or last is None:
            return False  # no position (anything applies), a restart seen anyway, or nothing held
        if self.config.replay_endpoint is None or last[0] != expected - 1:
            return True  # cannot be checked: taken as a restart (the endpoint is cleared)
        replies, _ = await self._replay(last[0])
        return not replies or replies[0] != last

    async def _recover(self, live: tuple[int, bytes] | None) -> None:
        """Replay from the first missing seq, then place the live batch that revealed the gap."""
        first = self.checker.next_seq
        replies, within = (
            await self._replay(first or 0) if self.config.replay_endpoint is not None else ([], True)
        )
        if not within:  # too long to hold: given up, the next batch received (re)starts the position
            self._lost(first, None if live is None else live[0], "replay_limit")
            self.checker.next_seq = None
            replies = []
        for seq, payload in [*replies, *([live] if live is not None else [])]:
            verdict = self.checker.check_replayed(seq)
            if verdict is SeqVerdict.DUPLICATE:
                self.stats.duplicates += 1
                continue
            if verdict is SeqVerdict.GAP:
                self._lost(self.checker.next_seq, seq, "gap")
                self.checker.skip_to(seq)
                self.checker.check_replayed(seq)
            self._emit(seq, payload)
        self.stats.replayed += len(replies)

    async def _replay(self, start: int) -> tuple[list[tuple[int, bytes]], bool]:
        """The engine's buffered batches from ``start`` on (what came before a timeout), and False instead
        of True when there were more than ``max_replay_batches`` (then none are returned)."""
        assert self._ctx is not None and self.config.replay_endpoint is not None
        limit = self.config.max_replay_batches
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self._dealer.setsockopt(zmq.RCVHWM, limit + 1)  # a whole replay and its end marker
            self._dealer.connect(self.config.replay_endpoint)
        self.stats.replay_requests += 1
        dealer = self._dealer
        out: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            for _ in range(limit + 1):  # at most limit batches and the end marker (bad messages count)
                frames = await asyncio.wait_for(dealer.recv_multipart(), self.config.replay_timeout_s)
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("%s: bad replay message (%d frames)", self.config.endpoint, len(frames))
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == -1:
                    return out, True
                if len(out) == limit:
                    break
                out.append((seq, frames[2]))
            log.warning(
                "%s: replay from seq %d over %d batches: given up", self.config.endpoint, start, limit
            )
            self.stats.replay_truncated += 1
            dealer.close(linger=0)  # the rest of the answer must not be taken for the next request's
            self._dealer = None
            return [], False
        except BaseException as exc:
            # Late answers would be taken for the next request's: the next replay uses a new socket.
            dealer.close(linger=0)
            self._dealer = None
            if not isinstance(exc, TimeoutError):
                raise
            log.warning("%s: replay from seq %d timed out", self.config.replay_endpoint, start)
            self.stats.replay_timeouts += 1
            return out, True

    def _emit(self, seq: int, payload: bytes) -> None:
        self._last = (seq, payload)
        try:
            self._ready.append(decode_payload(payload, seq))
        except KvEventDecodeError as exc:
            self.stats.undecodable += 1
            log.warning("%s: batch %d: %s", self.config.endpoint, seq, exc)
            self._lost(seq, seq + 1, "undecodable")

    def _lost(self, first_missing: int | None, resumed_at: int | None, reason: str) -> None:
        self.stats.lost_reports += 1
        self._ready.append(EventsLost(first_missing, resumed_at, reason))
