"""The gateway's index: precise where an endpoint's engine streams KV events, approximate elsewhere.

The ext_proc runs one :class:`HybridIndex` in either ``index.mode``: ``precise`` follows the events of
endpoints registered with ``kv_events`` (and of the nodes' kvcached daemons); ``approximate``
(``events=False``) keeps every endpoint in the approximate index and ignores all events.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from contracts.digest import Digest
from contracts.errors import ConfigError
from contracts.events import EndpointId, IndexEvent
from extproc.index.approximate import ApproximateIndex
from extproc.index.precise import PreciseIndex


class HybridIndex:
    """Precise where an endpoint's KV events are fed, approximate elsewhere (llama.cpp, hosted endpoints).

    Every endpoint lives in exactly one of the two indexes; :meth:`set_precise` moves it (dropping what
    the other index knew of it). :meth:`match` and :meth:`occupancy` merge both; :meth:`record` goes to
    the endpoint's index; :meth:`apply` and :meth:`clear_endpoint` act on the precise one only: events
    for endpoints not marked precise are ignored (counted in ``ignored_events``), so the caller marks an
    endpoint precise before subscribing to its events (the snapshot that starts a feed then fills it).
    ``events=False`` (``index.mode = "approximate"``): no endpoint is ever made precise, so every
    endpoint is learned from routing decisions and every event is ignored.
    """

    __slots__ = ("_precise_ids", "approximate", "events", "ignored_events", "precise")

    def __init__(
        self,
        precise: PreciseIndex | None = None,
        approximate: ApproximateIndex | None = None,
        *,
        events: bool = True,
    ) -> None:
        self.precise = precise if precise is not None else PreciseIndex()
        self.approximate = approximate if approximate is not None else ApproximateIndex()
        if self.precise.max_match_blocks != self.approximate.max_match_blocks:
            raise ConfigError(
                f"max_match_blocks differ: precise {self.precise.max_match_blocks}, "
                f"approximate {self.approximate.max_match_blocks}"
            )
        self._precise_ids: set[EndpointId] = set()
        self.ignored_events = 0
        #: Whether engine KV events are followed at all (``False``: :meth:`set_precise` keeps everything
        #: approximate).
        self.events = events

    @property
    def max_match_blocks(self) -> int:
        return self.precise.max_match_blocks

    @property
    def generation(self) -> int:
        """Both indexes' :attr:`~extproc.index.interface.PrefixIndex.generation` added: it grows when
        either's does (a :meth:`set_precise` move drops the endpoint from the other one)."""
        return self.precise.generation + self.approximate.generation

    def set_precise(self, endpoint: EndpointId, precise: bool) -> None:
        """Make ``endpoint`` precise (fed by events) or approximate; a move forgets its old entries.
        Without ``events`` every endpoint stays approximate."""
        precise = precise and self.events
        if precise == (endpoint in self._precise_ids):
            return
        if precise:
            self.approximate.drop_endpoint(endpoint)
            self._precise_ids.add(endpoint)
        else:
            self.precise.drop_endpoint(endpoint)
            self._precise_ids.discard(endpoint)

    def is_precise(self, endpoint: EndpointId) -> bool:
        """Whether ``endpoint`` lives in the precise index (:meth:`set_precise`)."""
        return endpoint in self._precise_ids

    @property
    def speculative_ttl_s(self) -> float:
        """Seconds a routing decision counts for an event-fed endpoint (the precise index's)."""
        return self.precise.speculative_ttl_s

    @speculative_ttl_s.setter
    def speculative_ttl_s(self, value: float) -> None:
        self.precise.speculative_ttl_s = value

    def match(self, digests: Sequence[Digest], now: float) -> dict[EndpointId, int]:
        """Both indexes' matches (each endpoint appears in at most one)."""
        result = self.precise.match(digests, now)
        if len(self.approximate):
            result.update(self.approximate.match(digests, now))
        return result

    def match_tiers(self, digests: Sequence[Digest], now: float) -> dict[EndpointId, dict[str, int]]:
        """:meth:`PreciseIndex.match_tiers`; approximate endpoints' leads count as ``gpu``."""
        result = self.precise.match_tiers(digests, now)
        if len(self.approximate):
            for endpoint, blocks in self.approximate.match(digests, now).items():
                result[endpoint] = {"gpu": blocks}
        return result

    def node_leads(self, endpoints: Iterable[EndpointId], digests: Sequence[Digest]) -> dict[EndpointId, int]:
        """:meth:`PreciseIndex.node_leads` (node-store pseudo endpoints live in the precise index)."""
        return self.precise.node_leads(endpoints, digests)

    def held(self, digest: Digest) -> bool:
        """Whether either index may hold ``digest`` (node stores live in the precise one)."""
        return self.precise.held(digest) or self.approximate.held(digest)

    def unheld(self, digests: Sequence[Digest], start: int) -> int:
        """The first of ``digests[start:]`` neither index holds, else ``len(digests)``: runs of blocks
        each index holds, taken in turn."""
        n = len(digests)
        i = start
        while i < n:
            i = self.approximate.unheld(digests, i)
            if i == n:
                return n
            j = self.precise.unheld(digests, i)
            if j == i:
                return i
            i = j
        return n

    def record(self, endpoint: EndpointId, digests: Sequence[Digest], now: float) -> None:
        if endpoint in self._precise_ids:
            self.precise.record(endpoint, digests, now)
        else:
            self.approximate.record(endpoint, digests, now)

    def apply(self, events: Sequence[IndexEvent], now: float) -> None:
        """Feed the precise index the events of endpoints marked precise."""
        ids = self._precise_ids
        kept = [event for event in events if event.endpoint in ids]
        self.ignored_events += len(events) - len(kept)
        self.precise.apply(kept, now)

    def occupancy(self) -> dict[EndpointId, int]:
        result = self.approximate.occupancy()
        result.update(self.precise.occupancy())
        return result

    def node_occupancy(self) -> dict[EndpointId, dict[str, int]]:
        """:meth:`PreciseIndex.node_occupancy` (node stores live in the precise index)."""
        return self.precise.node_occupancy()

    def clear_endpoint(self, endpoint: EndpointId) -> None:
        """Forget what the events said ``endpoint`` holds (a feed reset); for an approximate endpoint,
        whose entries come from routing decisions, nothing to do."""
        if endpoint in self._precise_ids:
            self.precise.clear_endpoint(endpoint)

    def drop_endpoint(self, endpoint: EndpointId) -> None:
        """Forget ``endpoint`` in both indexes; it is approximate again if it comes back."""
        self._precise_ids.discard(endpoint)
        self.precise.drop_endpoint(endpoint)
        self.approximate.drop_endpoint(endpoint)
