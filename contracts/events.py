"""Index events (DESIGN.md contract 2): their shape, wire encoding and sequence checking, in one place.

A *source* (a node agent translating its engines' KV events, or a kvcached daemon reporting its tiers)
tells every ext_proc replica what each endpoint holds:

- :class:`Stored`: ``endpoint`` now holds ``digests`` (chained block digests, :mod:`contracts.digest`) in
  ``tier``; ``parent`` is the digest of the block before the first (``None``: the chain starts at block 0);
- :class:`Removed`: ``endpoint`` no longer holds ``digests`` in ``tier``;
- :class:`Cleared`: ``endpoint`` holds nothing (in ``tier``, or in any tier when ``tier`` is ``None``);
- :class:`Load`: the endpoint's load signals, GPU telemetry and its node's power readings (:class:`Power`),
  sent on the same stream so ext_proc need not scrape engines that have an agent.

Events travel in :class:`Batch` es numbered per source: ``seq`` starts at 1 and grows by one per batch;
``epoch`` is chosen at random when the source starts, so a restarted source (whose ``seq`` restarts) is
told apart from a gap. A receiver checks each batch with a :class:`SequenceTracker`; on a gap it
resubscribes from the last ``seq`` it applied, and the source replays what it still buffers or sends a
``snapshot`` batch (a :class:`Cleared` per endpoint followed by everything held) that replaces all the
receiver knew of that source.

Tiers: ``gpu`` is the engine's device memory; ``cpu`` and ``disk`` are the engine's own offload tiers
(vLLM ``medium`` CPU and STORAGE), usable by that engine without a fetch; ``ram`` and ``ssd`` are the
node's kvcached tiers (usable after a local fetch).

Wire: msgpack via msgspec (array-like structs, tagged unions), carried as the messages of a gRPC
server-streaming method (:data:`SUBSCRIBE_METHOD`) with these functions as its (de)serialisers; a
generated protobuf module would need protoc pinned to the runtime, and msgpack decodes a batch of
digests into ``bytes`` objects with no per-field copying.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import NewType

import msgspec

from contracts.digest import DIGEST_BYTES
from contracts.errors import MSGPACK_ERRORS
from contracts.versions import DIGEST_VERSION, FEED_VERSION, LEGACY_VERSION, Skew, digest_matches, skew

TIERS = ("gpu", "cpu", "disk", "ram", "ssd")
"""Every tier name, fastest first."""

ENGINE_TIERS = frozenset({"gpu", "cpu", "disk"})
"""Tiers an engine reads without a fetch: a block held there counts as cached on that endpoint."""

EndpointId = NewType("EndpointId", str)
"""The id of an endpoint: an engine replica (etcd ``endpoints/<id>``), or a node's kvcached pseudo endpoint
(:func:`node_store_endpoint`). Events carry it as a plain string."""

NODE_STORE_PREFIX = "kvcached:"
"""kvcached reports its ``ram``/``ssd`` tiers under one pseudo endpoint per node, ``kvcached:<node>``: the
blocks any engine on that node (``Endpoint.node``) can load locally, and peers can fetch over QUIC."""


def node_store_endpoint(node: str) -> str:
    """The pseudo endpoint id under which node ``node``'s kvcached reports its tiers."""
    return NODE_STORE_PREFIX + node


SUBSCRIBE_METHOD = "/kvgate.events.v1.IndexEvents/Subscribe"
"""gRPC method (server streaming): request :class:`Subscribe`, responses :class:`Batch`."""
EPOCH_HEADER = "kvgate-feed-epoch"
"""Initial-metadata key a source sends once a subscription is attached: its ``epoch``."""


class EventError(ValueError):
    """A batch or request that does not decode or breaks the contract (unknown tier, bad digest)."""


class Stored(msgspec.Struct, tag="stored", array_like=True, frozen=True):
    endpoint: str
    digests: list[bytes]
    tier: str = "gpu"
    parent: bytes | None = None


class Removed(msgspec.Struct, tag="removed", array_like=True, frozen=True):
    endpoint: str
    digests: list[bytes]
    tier: str = "gpu"


class Cleared(msgspec.Struct, tag="cleared", array_like=True, frozen=True):
    endpoint: str
    tier: str | None = None


class Gpu(msgspec.Struct, array_like=True, frozen=True):
    """One GPU's telemetry (NVML). Units: watts, MHz, degrees Celsius, bytes, fraction 0..1;
    ``throttle_reasons``: NVML's clocks event reasons bitmask (``nvmlDeviceGetCurrentClocksEventReasons``,
    the same bits as DCGM's ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS``; agent/power/README.md);
    ``energy_mj``: NVML's energy counter (``nvmlDeviceGetTotalEnergyConsumption``: millijoules since the
    driver was loaded, Volta and later; only differences mean anything). A trailing field: an older
    decoder ignores it, and an older agent's GPUs decode with ``None``."""

    index: int
    name: str
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    temperature_c: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    utilization: float | None = None
    throttle_reasons: int | None = None
    energy_mj: int | None = None


class Power(msgspec.Struct, array_like=True, frozen=True):
    """One power source's latest reading of a node (agent/power/README.md says what each kind reads).

    ``source``: the name the node config gives it; ``kind``: ``nvml``, ``dcgm``, ``redfish`` or ``ipmi``.
    ``watts``: power drawn now (W); ``limit_w``: the power cap in force (W); ``energy_j``: a cumulative
    energy counter (J; only differences mean anything); ``temperature_c``: the hottest temperature read
    (degrees Celsius); ``throttled``: clocks are held down by a power or thermal limit; ``sm_clock_mhz``:
    mean SM clock of the GPUs read (MHz). ``None``: the source does not say. ``at``: the agent's wall clock
    (seconds since the epoch) of the latest attempt. ``error``: why that attempt failed ("" when it
    succeeded); with an error every value is ``None`` (a reader treats the source as silent).
    """

    source: str
    kind: str
    watts: float | None = None
    limit_w: float | None = None
    energy_j: float | None = None
    temperature_c: float | None = None
    throttled: bool | None = None
    sm_clock_mhz: float | None = None
    at: float = 0.0
    error: str = ""


class Load(msgspec.Struct, tag="load", array_like=True, frozen=True):
    """Load of one endpoint as its agent last saw it: requests waiting and running, KV use 0..1 (``None``:
    the engine does not say), whether the engine is healthy, whether it is draining, GPU telemetry, the
    power readings of its node (every source the agent reads; the same list on each of the node's loads),
    and the engine's output tokens/s (from its generated-tokens counter; ``None``: unknown).

    Fields are only ever added at the end, with defaults: an older receiver ignores the trailing ones it
    does not know, a newer one reads their defaults from an older sender."""

    endpoint: str
    waiting: float
    running: float
    kv_usage: float | None = None
    healthy: bool = True
    draining: bool = False
    gpus: list[Gpu] = msgspec.field(default_factory=list)
    power: list[Power] = msgspec.field(default_factory=list)
    output_tps: float | None = None
    #: LoRA adapters of the engine's running and waiting requests, its adapter slots and the slots in use
    #: (``engines.metrics.LoraState``; ``None``: the engine reports none).
    lora_running: list[str] | None = None
    lora_waiting: list[str] | None = None
    max_lora: int | None = None
    lora_slots_used: int | None = None
    #: The engine's prefix-cache counters since it started: prompt tokens found in its prefix cache and
    #: prompt tokens looked up there (vLLM's ``prefix_cache_hits``/``_queries``, the simulator's; the drift
    #: alarm's counter source, :mod:`extproc.drift.counters`). ``None``: the engine exports none, or an
    #: agent older than the fields.
    prefix_hits: float | None = None
    prefix_queries: float | None = None


IndexEvent = Stored | Removed | Cleared
Event = Stored | Removed | Cleared | Load


class Batch(msgspec.Struct, array_like=True, frozen=True):
    """Events from one source, in order. ``ts``: the source's wall clock (seconds since the epoch) when it
    sent the batch, for staleness measurements only. ``snapshot``: the batch replaces everything the
    receiver holds from this source (its endpoints' index entries). ``version``: the feed protocol's
    version and ``digest``: the digest chain version its digests were made under
    (:mod:`contracts.versions`; absent on the wire: 1, a sender older than the fields; every
    :class:`runtime.feed.log.FeedLog` batch carries the current ones). Receivers check them with
    :func:`batch_skew`."""

    source: str
    epoch: int
    seq: int
    events: list[Event]
    snapshot: bool = False
    ts: float = 0.0
    version: int = LEGACY_VERSION
    digest: int = LEGACY_VERSION


class Subscribe(msgspec.Struct, frozen=True):
    """A receiver's request: who it is (for logs), and where it stands: the source ``epoch`` and the last
    ``seq`` it applied (``epoch`` ``None`` or another epoch: start with a snapshot)."""

    subscriber: str
    epoch: int | None = None
    after_seq: int = 0


_batch_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(Batch)
_subscribe_decoder = msgspec.msgpack.Decoder(Subscribe)


def encode(message: Batch | Subscribe) -> bytes:
    """Wire bytes of a batch or a subscribe request."""
    return _batch_encoder.encode(message)


def decode_batch(data: bytes) -> Batch:
    """A batch from wire bytes, checked against the contract; :class:`EventError` if malformed."""
    try:
        batch = _batch_decoder.decode(data)
    except MSGPACK_ERRORS as exc:
        raise EventError(f"undecodable index event batch: {exc}") from exc
    check_batch(batch)
    return batch


class _Envelope(msgspec.Struct, array_like=True, frozen=True):
    """A batch whose events are left undecoded: what every feed version shares (a newer version may add
    event kinds, which the strict decoder refuses)."""

    source: str
    epoch: int
    seq: int
    events: list[msgspec.Raw]
    snapshot: bool = False
    ts: float = 0.0
    version: int = LEGACY_VERSION
    digest: int = LEGACY_VERSION


_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_load_decoder = msgspec.msgpack.Decoder(Event)


def batch_skew(batch: Batch) -> Skew:
    """:attr:`Skew.OK` when the receiver may apply ``batch`` as is (feed version N - 1 or N, digests of
    this process's version); otherwise what to do (:func:`kv_blind`)."""
    verdict = skew(batch.version, FEED_VERSION)
    if verdict is Skew.OK and not digest_matches(batch.digest):
        return Skew.NEWER if batch.digest > DIGEST_VERSION else Skew.TOO_OLD
    return verdict


def kv_blind(batch: Batch) -> Batch:
    """``batch`` without its index events (a skewed feed: its KV data is treated as absent), keeping its
    loads and its position (so sequence checks and snapshots work as usual). A snapshot keeps one
    :class:`Cleared` per endpoint, so whatever the receiver held from the source is dropped."""
    kept: list[Event] = [e for e in batch.events if isinstance(e, Load)]
    if batch.snapshot:
        endpoints = dict.fromkeys(e.endpoint for e in batch.events)
        kept = [Cleared(endpoint) for endpoint in endpoints] + kept
    return msgspec.structs.replace(batch, events=kept)


def decode_batch_skewed(data: bytes) -> Batch:
    """A batch as a receiver of this feed version takes it: :func:`decode_batch` when the batch is of a
    version it reads (:func:`batch_skew` OK), else the envelope and of its events only the loads that
    decode (index events and unknown event kinds dropped; :func:`kv_blind`). :class:`EventError` when a
    batch of a readable version is malformed, or not even the envelope decodes."""
    try:
        batch = decode_batch(data)
    except EventError as strict:
        try:
            envelope = _envelope_decoder.decode(data)
        except MSGPACK_ERRORS:
            raise strict from None
        if skew(envelope.version, FEED_VERSION) is Skew.OK:
            raise
        return _lenient(envelope)
    return batch if batch_skew(batch) is Skew.OK else kv_blind(batch)


def _lenient(envelope: _Envelope) -> Batch:
    events: list[Event] = []
    for raw in envelope.events:
        try:
            event = _load_decoder.decode(raw)
        except MSGPACK_ERRORS:
            continue
        events.append(event)
    batch = Batch(
        envelope.source,
        envelope.epoch,
        envelope.seq,
        events,
        snapshot=envelope.snapshot,
        ts=envelope.ts,
        version=envelope.version,
        digest=envelope.digest,
    )
    if batch.seq < 1:
        raise EventError(f"batch seq must be >= 1, got {batch.seq}")
    return kv_blind(batch)


def decode_subscribe(data: bytes) -> Subscribe:
    try:
        return _subscribe_decoder.decode(data)
    except MSGPACK_ERRORS as exc:
        raise EventError(f"undecodable subscribe request: {exc}") from exc


def load_problem(load: Load) -> str | None:
    """Why a receiver must not apply ``load`` (``None``: it may): ``waiting`` and ``running`` must be
    finite and >= 0, ``kv_usage`` finite, ``prefix_hits`` and ``prefix_queries`` (when given) finite and
    >= 0 (msgspec's types let NaN and infinities through; applied as is, every comparison with a NaN is
    false, so what filters and scorers make of it depends on how each one compares, and one NaN counter
    reading would hold the drift alarm's window at NaN, never tripping). Not a batch error: the batch's
    other events stay usable."""
    for name, value in (("waiting", load.waiting), ("running", load.running)):
        if not math.isfinite(value) or value < 0:
            return f"{name} {value!r} is not a finite count >= 0"
    for name, counter in (("prefix_hits", load.prefix_hits), ("prefix_queries", load.prefix_queries)):
        if counter is not None and (not math.isfinite(counter) or counter < 0):
            return f"{name} {counter!r} is not a finite count >= 0"
    if load.kv_usage is not None and not math.isfinite(load.kv_usage):
        return f"kv_usage {load.kv_usage!r} is not finite"
    return None


def check_batch(batch: Batch) -> None:
    """Contract checks msgspec's types cannot express: known tiers, digest width, positive seq."""
    if batch.seq < 1:
        raise EventError(f"batch seq must be >= 1, got {batch.seq}")
    for event in batch.events:
        tier = getattr(event, "tier", "gpu")
        if tier is not None and tier not in TIERS:
            raise EventError(f"unknown tier {tier!r}; known: {', '.join(TIERS)}")
        if isinstance(event, Stored | Removed):
            for digest in event.digests:
                if len(digest) != DIGEST_BYTES:
                    raise EventError(f"digest of {len(digest)} bytes, expected {DIGEST_BYTES}")
            if isinstance(event, Stored) and event.parent is not None and len(event.parent) != DIGEST_BYTES:
                raise EventError(f"parent digest of {len(event.parent)} bytes, expected {DIGEST_BYTES}")


class Verdict(enum.Enum):
    """What a receiver does with a batch (:meth:`SequenceTracker.check`)."""

    APPLY = "apply"
    """The next batch in order: apply it."""
    RESET = "reset"
    """A snapshot, or the first batch of a new epoch that is a snapshot: drop the source's state, apply."""
    DUPLICATE = "duplicate"
    """Already applied (a replay overlapping what was received): skip it."""
    GAP = "gap"
    """Batches are missing (or a new epoch started without a snapshot): skip it and resubscribe."""


@dataclass(slots=True)
class SequenceTracker:
    """Per-source position of a receiver: the epoch and the last applied ``seq``. Pure bookkeeping."""

    epoch: int | None = None
    last_seq: int = 0

    def check(self, batch: Batch) -> Verdict:
        """Classify ``batch`` and, for APPLY and RESET, advance the position to it."""
        if batch.snapshot:
            self.epoch, self.last_seq = batch.epoch, batch.seq
            return Verdict.RESET
        if batch.epoch != self.epoch:
            return Verdict.GAP
        if batch.seq <= self.last_seq:
            return Verdict.DUPLICATE
        if batch.seq != self.last_seq + 1:
            return Verdict.GAP
        self.last_seq = batch.seq
        return Verdict.APPLY

    def request(self, subscriber: str) -> Subscribe:
        """The subscribe request that resumes from this position."""
        return Subscribe(subscriber=subscriber, epoch=self.epoch, after_seq=self.last_seq)
