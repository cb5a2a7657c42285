"""The source side of an index-event feed, sans IO: a numbered log of recent batches (DESIGN.md contract 2).

A source (a node agent, a kvcached daemon) publishes each batch once; every ext_proc replica subscribes
(active-active: each replica holds the whole index). :class:`FeedLog` numbers batches (``seq`` from 1
within a random 63-bit ``epoch``; an empty batch is published at creation, so ``seq >= 1`` always), keeps
the recent ones in a ring bounded by count and by total encoded bytes, answers "replay everything after
``(epoch, seq)``" when the ring still covers it, and builds snapshot batches (a
:class:`~contracts.events.Cleared` per endpoint, what the caller says is held, then the latest
:class:`~contracts.events.Load` per endpoint). :mod:`runtime.feed.server` serves it over gRPC.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import islice

from contracts.events import Batch, Cleared, Event, IndexEvent, Load, encode
from contracts.versions import DIGEST_VERSION, FEED_VERSION

DEFAULT_MAX_BATCHES = 4096
"""Batches the ring keeps for replay."""
DEFAULT_MAX_BYTES = 32 * 1024 * 1024
"""Total encoded bytes the ring keeps for replay."""


class FeedLog:
    """Numbered batches of one source and the ring that replays them (see the module docstring).

    ``max_batches``/``max_bytes``: bounds of the ring (the oldest batches go first; a batch larger than
    ``max_bytes`` is not kept at all). ``epoch``: fixed for tests; default a random 63-bit integer.
    ``ts``: wall-clock seconds stamped on the initial empty batch.
    """

    def __init__(
        self,
        source: str,
        *,
        max_batches: int = DEFAULT_MAX_BATCHES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        epoch: int | None = None,
        ts: float = 0.0,
    ) -> None:
        if max_batches < 1 or max_bytes < 1:
            raise ValueError("max_batches and max_bytes must be >= 1")
        self.source = source
        self.epoch = secrets.randbits(63) if epoch is None else epoch
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self._seq = 0
        self._ring: deque[tuple[Batch, int]] = deque()
        self._bytes = 0
        self._endpoints: set[str] = set()
        self._loads: dict[str, Load] = {}
        self.publish([], ts)

    @property
    def seq(self) -> int:
        """The last published ``seq``."""
        return self._seq

    @property
    def held_batches(self) -> int:
        return len(self._ring)

    @property
    def held_bytes(self) -> int:
        """Encoded bytes of the batches in the ring."""
        return self._bytes

    @property
    def oldest_seq(self) -> int | None:
        """The oldest ``seq`` still in the ring (``None``: the ring is empty)."""
        return self._ring[0][0].seq if self._ring else None

    @property
    def endpoints(self) -> frozenset[str]:
        """Every endpoint this source has mentioned (each gets a ``Cleared`` in a snapshot)."""
        return frozenset(self._endpoints)

    def publish(self, events: Sequence[Event], ts: float) -> Batch:
        """Number ``events`` as the next batch, keep it for replay and return it."""
        self._seq += 1
        batch = Batch(
            self.source,
            self.epoch,
            self._seq,
            list(events),
            ts=ts,
            version=FEED_VERSION,
            digest=DIGEST_VERSION,
        )
        for event in events:
            self._endpoints.add(event.endpoint)
            if isinstance(event, Load):
                self._loads[event.endpoint] = event
        size = len(encode(batch))
        self._ring.append((batch, size))
        self._bytes += size
        while self._ring and (len(self._ring) > self.max_batches or self._bytes > self.max_bytes):
            _, dropped = self._ring.popleft()
            self._bytes -= dropped
        return batch

    def replay_after(self, epoch: int | None, after_seq: int) -> list[Batch] | None:
        """The batches after ``after_seq`` of ``epoch``, oldest first; ``None`` when the ring cannot cover
        them (another epoch, a position this log never reached, or batches already dropped): the
        subscriber needs a snapshot."""
        if epoch != self.epoch or after_seq < 0 or after_seq > self._seq:
            return None
        if after_seq == self._seq:
            return []
        oldest = self.oldest_seq
        if oldest is None or after_seq + 1 < oldest:
            return None
        return [batch for batch, _ in islice(self._ring, after_seq + 1 - oldest, None)]

    def snapshot(self, held: Iterable[IndexEvent], ts: float) -> Batch:
        """A snapshot batch at the last published ``seq``: ``Cleared`` for every endpoint, ``held`` (what
        the caller's translators hold now), then the latest ``Load`` of each endpoint. Not kept in the
        ring; the receiver applies live batches after it from ``seq + 1``."""
        held = list(held)
        for event in held:
            self._endpoints.add(event.endpoint)
        events: list[Event] = [Cleared(endpoint) for endpoint in sorted(self._endpoints)]
        events.extend(held)
        events.extend(self._loads[endpoint] for endpoint in sorted(self._loads))
        return Batch(
            self.source,
            self.epoch,
            self._seq,
            events,
            snapshot=True,
            ts=ts,
            version=FEED_VERSION,
            digest=DIGEST_VERSION,
        )

    def forget(self, endpoint: str) -> None:
        """Stop mentioning ``endpoint`` in snapshots (after its engine was removed and a ``Cleared`` for
        it was published)."""
        self._endpoints.discard(endpoint)
        self._loads.pop(endpoint, None)
