"""The router's working set: the distinct blocks routed to each endpoint lately (what ``cache-spread``
reads)."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

from contracts.digest import Digest
from contracts.errors import ConfigError
from contracts.events import EndpointId
from extproc.index.interface import DEFAULT_MAX_MATCH_BLOCKS, require_positive_int


class WorkingSet:
    """Distinct blocks routed to each endpoint in the last ``window_s`` seconds: the KV it is asked to hold.

    The ``cache-spread`` scorer reads it (:meth:`sizes`) to send a prefix no endpoint holds to the endpoint
    asked to hold the least. An engine's cache is full soon after start (its occupancy, what a precise
    index reports, is then the same everywhere and says nothing); what differs is how many distinct blocks
    the requests routed there keep needing. An endpoint asked for more than its KV holds evicts prefixes
    it will be sent again, which then move (BENCHMARKS.md: the routing section's spread study).

    Per endpoint, one ``OrderedDict`` digest -> when last routed, oldest first; a record moves its digests
    to the end, and entries older than the window are popped from the front, each once. :meth:`record`
    (the router calls it after the reply is out) pops for every endpoint; :meth:`sizes`, on the request
    path, then reads lengths, which may still count blocks that left the window since the last record
    (at most ``STALE_S`` worth; after a longer quiet spell it pops first). Measured on the 2-core VM, 8
    endpoints, 120-block chains at 24 records/s: :meth:`sizes` ~2 us, :meth:`record` ~40 us.
    """

    STALE_S = 1.0
    """The most a :meth:`sizes` answer lags the window by (seconds since the last record or pop)."""

    __slots__ = ("_max_blocks", "_popped_at", "_routed", "_window")

    def __init__(self, window_s: float, max_blocks: int = DEFAULT_MAX_MATCH_BLOCKS) -> None:
        if isinstance(window_s, bool) or not 0 < window_s < math.inf:
            raise ConfigError(f"working_set_s must be positive and finite, got {window_s!r}")
        require_positive_int("max_match_blocks", max_blocks)
        self._window = float(window_s)
        self._max_blocks = max_blocks
        self._routed: dict[EndpointId, OrderedDict[Digest, float]] = {}
        self._popped_at = -math.inf

    def record(self, endpoint: EndpointId, digests: Sequence[Digest], now: float) -> None:
        """Note that ``endpoint`` was sent the chain ``digests`` at ``now`` (its first ``max_blocks``)."""
        routed = self._routed.get(endpoint)
        if routed is None:
            routed = self._routed[endpoint] = OrderedDict()
        move_to_end = routed.move_to_end
        for digest in digests[: self._max_blocks]:
            if digest in routed:
                move_to_end(digest)
            routed[digest] = now
        self._pop(now)

    def sizes(self, now: float) -> dict[EndpointId, int]:
        """Distinct blocks routed to each endpoint within ``window_s`` before ``now`` (see the class)."""
        if now - self._popped_at > self.STALE_S:
            self._pop(now)
        return {endpoint: len(routed) for endpoint, routed in self._routed.items()}

    def _pop(self, now: float) -> None:
        """Drop entries older than the window, and endpoints left with none (one that left the fleet)."""
        oldest = now - self._window
        empty: list[EndpointId] = []
        for endpoint, routed in self._routed.items():
            while routed:
                digest, at = next(iter(routed.items()))
                if at > oldest:
                    break
                del routed[digest]
            if not routed:
                empty.append(endpoint)
        for endpoint in empty:
            del self._routed[endpoint]
        self._popped_at = max(self._popped_at, now)
