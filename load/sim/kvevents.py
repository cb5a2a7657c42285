"""vLLM KV cache events from a simulated replica: the wire format of vLLM's ``ZmqEventPublisher``.

A replica started with ``--kv-events-config`` publishes what its prefix cache stores, evicts and clears
exactly as vLLM 0.33 does, so the node agent is tested against the real format:

- a ZMQ PUB socket sends one multipart message per engine step that changed the cache:
  ``[topic, seq, payload]``, ``seq`` an unsigned 8-byte big-endian counter starting at 0 and ``payload``
  the msgpack array ``[ts, events, data_parallel_rank]`` (``ts`` in seconds since the epoch);
- each event is a msgpack map tagged by ``"type"``: ``BlockStored`` (``block_hashes``,
  ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``, ``lora_name``,
  ``group_idx``; fields at their default are omitted, as vLLM's ``omit_defaults``), ``BlockRemoved``
  (``block_hashes``, ``medium``, ``group_idx``) or ``AllBlocksCleared``;
- an optional ROUTER socket replays the last ``buffer_steps`` batches: a request
  ``[identity, b"", start_seq]`` is answered with ``[identity, b"", seq, payload]`` for every buffered
  batch from ``start_seq`` on, then the end marker ``[identity, b"", seq -1, b""]``.

A replica in SGLang's disaggregation mode stands for SGLang and encodes as SGLang's publisher does
(``sglang/srt/disaggregation/kv_events.py``): the batch ``[ts, events, attn_dp_rank]``, each event a
positional array with its tag first (``BlockStored``: hashes, parent, token ids, block size, ``lora_id``;
``BlockRemoved``: hashes; ``AllBlocksCleared``), none of vLLM's later fields.

Block hashes are engine hashes, not kvgate digests: like vLLM's they are 64-bit integers determined by
the block's parent and tokens (here a keyed BLAKE2b of the block's chain digest, the key random per
replica as vLLM's ``NONE_HASH`` is per process). They are one-way, so a subscriber must rebuild
kvgate digests from ``token_ids``, as the agent does for a real engine.

:class:`KvEventBuffer` is the sans-IO part (a :class:`~load.sim.cache.CacheListener` that queues
events); :class:`KvEventPublisher` owns the sockets and publishes the queued events as one batch at
the end of each event-loop turn that produced any, i.e. once per engine step (plus one for a
``/reset_prefix_cache``). Sends never block: a batch the PUB socket cannot take (a subscriber's pipe
is at the high-water mark) is dropped and counted, and stays replayable; vLLM's PUB socket drops past
its high-water mark too, silently and per subscriber.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from contracts.digest import Digest
from load.sim.cache import CacheListener

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The seq frame of the replay end marker."""


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """vLLM's ``--kv-events-config`` (same keys and defaults). ``publisher`` ``None`` means ``"zmq"``
    when events are enabled, else ``"null"``. ``endpoint``/``replay_endpoint``: ZMQ addresses the
    replica binds (port 0: an ephemeral port; replica ``i`` of a process adds ``i`` to a non-zero
    port; unlike vLLM, a PUB endpoint without a wildcard host is bound too, never connected).
    ``buffer_steps``: batches kept for replay. ``hwm``: the PUB socket's send high-water mark in
    messages. ``max_queue_size`` is accepted for compatibility (the simulator has no publish queue)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv events publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"kv events {name} must be >= 0")
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv events endpoint {endpoint!r} is not a tcp://, ipc:// or inproc:// one")

    @property
    def enabled(self) -> bool:
        """Whether events are published at all."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KvEventsConfig:
        """Parse the ``--kv-events-config`` JSON object; ``ValueError`` naming a bad or unknown key."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        for key, value in raw.items():
            want = _CONFIG_TYPES.get(key)
            if want is None:
                raise ValueError(f"unknown --kv-events-config key {key!r}; known: {', '.join(_CONFIG_TYPES)}")
            if value is None and key in ("publisher", "replay_endpoint"):
                continue
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise ValueError(f"--kv-events-config key {key!r} must be a {want.__name__}")
        return cls(**raw)


_CONFIG_TYPES: dict[str, type] = {
    "enable_kv_cache_events": bool,
    "publisher": str,
    "endpoint": str,
    "replay_endpoint": str,
    "buffer_steps": int,
    "hwm": int,
    "max_queue_size": int,
    "topic": str,
}


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """The endpoint of data-parallel rank ``rank``: vLLM's rule (tcp port + rank, ``_dp<rank>`` suffix
    for ipc/inproc), except that port 0 stays 0 (each rank binds its own ephemeral port)."""
    if rank == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"kv events endpoint {endpoint!r} has no port")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag_field="type"):
    """vLLM's ``KVCacheEvent``: a msgpack map tagged by ``"type"``."""


class _BlockStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class _AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``KVEventBatch``: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[_BlockStored | _BlockRemoved | _AllBlocksCleared]
    data_parallel_rank: int | None = None


class _SglangStored(msgspec.Struct, array_like=True, gc=False, tag="BlockStored"):
    """SGLang's ``BlockStored`` (``sglang/srt/disaggregation/kv_events.py``): a positional array."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class _SglangRemoved(msgspec.Struct, array_like=True, gc=False, tag="BlockRemoved"):
    block_hashes: list[int]


class _SglangCleared(msgspec.Struct, array_like=True, gc=False, tag="AllBlocksCleared"):
    pass


class _SglangBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """SGLang's ``KVEventBatch``: ``[ts, events, attn_dp_rank]``."""

    ts: float
    events: list[_SglangStored | _SglangRemoved | _SglangCleared]
    attn_dp_rank: int | None = None


def _as_sglang(event: _BlockStored | _BlockRemoved | _AllBlocksCleared) -> Any:
    """``event`` in SGLang's shape (it has no ``medium``, ``lora_name``, ``extra_keys``, ``group_idx``)."""
    if isinstance(event, _BlockStored):
        return _SglangStored(
            event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size, event.lora_id
        )
    if isinstance(event, _BlockRemoved):
        return _SglangRemoved(event.block_hashes)
    return _SglangCleared()


class KvEventBuffer:
    """Queues vLLM events for one replica's cache changes (sans IO). ``on_pending`` is called when an
    event enters an empty queue, so the owner can schedule one flush per burst of changes."""

    def __init__(
        self,
        block_size: int,
        *,
        hash_key: bytes,
        medium: str = "GPU",
        on_pending: Callable[[], None] | None = None,
    ) -> None:
        self.block_size = block_size
        self.medium = medium
        self.on_pending = on_pending
        self._key = hash_key
        self._events: list[_BlockStored | _BlockRemoved | _AllBlocksCleared] = []

    def engine_hash(self, digest: Digest) -> int:
        """The engine hash of the block whose kvgate chain digest is ``digest`` (64-bit, unsigned)."""
        return int.from_bytes(hashlib.blake2b(digest, digest_size=8, key=self._key).digest(), "big")

    def on_stored(
        self,
        digests: Sequence[Digest],
        token_ids: Sequence[int],
        parent: Digest | None,
        lora: str | None = None,
        salt: str | None = None,
    ) -> None:
        h = self.engine_hash
        self._add(
            _BlockStored(
                block_hashes=[h(d) for d in digests],
                parent_block_hash=None if parent is None else h(parent),
                token_ids=list(token_ids),
                block_size=self.block_size,
                lora_id=None if lora is None else lora_int_id(lora),
                medium=self.medium,
                lora_name=lora,
                extra_keys=extra_keys(len(digests), parent is None, lora, salt),
                group_idx=0,
            )
        )

    def on_removed(self, digests: Sequence[Digest]) -> None:
        h = self.engine_hash
        self._add(_BlockRemoved(block_hashes=[h(d) for d in digests], medium=self.medium, group_idx=0))

    def on_cleared(self) -> None:
        self._add(_AllBlocksCleared())

    def take(self) -> list[_BlockStored | _BlockRemoved | _AllBlocksCleared]:
        """The queued events, oldest first; the queue is left empty."""
        events, self._events = self._events, []
        return events

    def _add(self, event: _BlockStored | _BlockRemoved | _AllBlocksCleared) -> None:
        self._events.append(event)
        if len(self._events) == 1 and self.on_pending is not None:
            self.on_pending()


def lora_int_id(name: str) -> int:
    """A stable positive id for an adapter name (vLLM numbers adapters from 1 as they are registered)."""
    return 1 + zlib.crc32(name.encode()) % 1_000_000


def extra_keys(n: int, first: bool, lora: str | None, salt: str | None) -> list[Any] | None:
    """vLLM's per-block extra keys for ``n`` blocks: the adapter's name on each, the salt on the
    sequence's first block (``first``: the run starts the sequence); ``None`` when no block has any."""
    if lora is None and (salt is None or not first):
        return None
    keys: list[Any] = []
    for i in range(n):
        block = [lora] if lora is not None else []
        if salt is not None and first and i == 0:
            block.append(salt)
        keys.append(tuple(block) if block else None)
    return keys


class TeeListener:
    """Forwards every cache change to several listeners, in order."""

    def __init__(self, *listeners: CacheListener) -> None:
        self._listeners = listeners

    def on_stored(
        self,
        digests: Sequence[Digest],
        token_ids: Sequence[int],
        parent: Digest | None,
        lora: str | None = None,
        salt: str | None = None,
    ) -> None:
        for listener in self._listeners:
            listener.on_stored(digests, token_ids, parent, lora, salt)

    def on_removed(self, digests: Sequence[Digest]) -> None:
        for listener in self._listeners:
            listener.on_removed(digests)

    def on_cleared(self) -> None:
        for listener in self._listeners:
            listener.on_cleared()


class KvEventPublisher:
    """The sockets of one replica (data-parallel rank ``rank``): PUB for live batches, ROUTER for replay.

    ``buffer`` is the replica's cache listener. :meth:`start` binds (in the running loop),
    :meth:`aclose` publishes what is queued and closes. ``address``/``replay_address``: the bound
    ``tcp://host:port`` or ``ipc://PATH`` (``replay_address`` ``""`` without a replay endpoint).
    """

    def __init__(self, config: KvEventsConfig, rank: int, block_size: int, sglang: bool = False) -> None:
        self.config = config
        self.rank = rank
        #: Publish in SGLang's encoding (a replica in SGLang's disaggregation mode stands for SGLang).
        self.sglang = sglang
        self.buffer = KvEventBuffer(block_size, hash_key=os.urandom(16), on_pending=self._schedule_flush)
        self.address = ""
        self.replay_address = ""
        self.published = 0
        """Batches sent on the PUB socket."""
        self.dropped = 0
        """Batches the PUB socket refused (high-water mark): they stay replayable."""
        self.skipped = 0
        """Batches withheld from PUB by :meth:`drop_next` (test hook): they stay replayable."""
        self._topic = config.topic.encode()
        self._seq = 0
        self._replay_buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._drop_next = 0
        self._flush_scheduled = False
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind the PUB (and ROUTER) sockets and start serving replay requests."""
        ctx = self._ctx = zmq.asyncio.Context()
        endpoint = endpoint_for_rank(self.config.endpoint, self.rank)
        try:
            self._pub = zmq.Socket(ctx, zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            self._pub.setsockopt(zmq.XPUB_NODROP, 1)  # a full pipe refuses the send: the drop is counted
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(endpoint)
            self.address = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.config.replay_endpoint is not None:
                endpoint = endpoint_for_rank(self.config.replay_endpoint, self.rank)
                self._router = ctx.socket(zmq.ROUTER)
                # One replay must fit the pipe: a ROUTER drops what a peer's full pipe cannot take.
                self._router.setsockopt(zmq.SNDHWM, self.config.buffer_steps + 2)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(endpoint)
                self.replay_address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
                self._replay_task = asyncio.create_task(self._serve_replay(), name="sim-kv-replay")
        except BaseException as exc:
            await self.aclose()
            if isinstance(exc, zmq.ZMQError):
                raise OSError(exc.errno, f"cannot bind KV events endpoint {endpoint}: {exc}") from exc
            raise
        replay = self.replay_address or "-"
        log.info("rank %d publishes KV events on %s (replay %s)", self.rank, self.address, replay)

    @property
    def next_seq(self) -> int:
        """The seq the next batch will get (batches so far: ``0 .. next_seq - 1``)."""
        return self._seq

    def drop_next(self, n: int) -> None:
        """Withhold the next ``n`` batches from PUB (they are still numbered and replayable)."""
        self._drop_next += n

    def flush(self) -> None:
        """Publish the queued events as one batch (nothing when none is queued)."""
        self._flush_scheduled = False
        events = self.buffer.take()
        if not events or self._pub is None:
            return
        seq = self._seq
        self._seq += 1
        if self.sglang:
            sglang = [_as_sglang(e) for e in events]
            payload = self._encoder.encode(_SglangBatch(time.time(), sglang, self.rank))
        else:
            payload = self._encoder.encode(_EventBatch(time.time(), events, self.rank))
        self._replay_buffer.append((seq, payload))
        if self._drop_next:
            self._drop_next -= 1
            self.skipped += 1
            return
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            return
        self.published += 1

    async def aclose(self) -> None:
        """Publish what is queued, stop replay and close the sockets (idempotent)."""
        self.flush()
        if self._replay_task is not None:
            self._replay_task.cancel()
            await asyncio.gather(self._replay_task, return_exceptions=True)
            self._replay_task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _schedule_flush(self) -> None:
        if self._flush_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a cache change outside the loop (tests driving the engine): flush now
            self.flush()
            return
        self._flush_scheduled = True
        loop.call_soon(self.flush)

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("rank %d: malformed replay request (%d frames)", self.rank, len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            # A snapshot: the engine keeps appending while the replies are written.
            batches = [(seq, payload) for seq, payload in self._replay_buffer if seq >= start]
            for seq, payload in batches:
                await router.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
            await router.send_multipart((identity, b"", END_SEQ, b""))
            log.debug("rank %d replayed %d batches from seq %d", self.rank, len(batches), start)


def sink(publisher: KvEventPublisher | None, listener: CacheListener | None) -> CacheListener | None:
    """The cache listener of a replica: the publisher's buffer, ``listener``, or both."""
    if publisher is None:
        return listener
    if listener is None:
        return publisher.buffer
    return TeeListener(publisher.buffer, listener)
