"""The router's working set: the distinct blocks routed to each endpoint lately (what ``cache-spread``
reads)."""

from __future__ import annotations

import math
from collections import OrderedDict, deque
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
    to the end, and entries older than the window are popped from the front, each once. The records
    themselves are queued (when, endpoint) in time order, so a pop visits only the endpoints whose records
    left the window, not every endpoint; each endpoint's count is kept as it changes. :meth:`record` (the
    router calls it after the reply is out) pops; :meth:`sizes`, on the request path, copies the counts,
    which may still count blocks that left the window since the last record (at most ``STALE_S`` worth;
    after a longer quiet spell it pops first). Measured on the 2-core VM, 64 endpoints, a 270-block chain:
    :meth:`sizes` ~0.6 us, the pop a record does ~0.7 us with nothing due (BENCHMARKS.md, issue 27: ~10 and
    ~24 us when both walked every endpoint).
    """

    STALE_S = 1.0
    """The most a :meth:`sizes` answer lags the window by (seconds since the last record or pop)."""

    __slots__ = ("_max_blocks", "_popped_at", "_records", "_routed", "_sizes", "_window")

    def __init__(self, window_s: float, max_blocks: int = DEFAULT_MAX_MATCH_BLOCKS) -> None:
        if isinstance(window_s, bool) or not 0 < window_s < math.inf:
            raise ConfigError(f"working_set_s must be positive and finite, got {window_s!r}")
        require_positive_int("max_match_blocks", max_blocks)
        self._window = float(window_s)
        self._max_blocks = max_blocks
        self._routed: dict[EndpointId, OrderedDict[Digest, float]] = {}
        #: ``len(self._routed[endpoint])`` for each endpoint, in the same order.
        self._sizes: dict[EndpointId, int] = {}
        #: (when, endpoint) of each record, oldest first (``when`` never below the one before).
        self._records: deque[tuple[float, EndpointId]] = deque()
        self._popped_at = -math.inf

    def record(self, endpoint: EndpointId, digests: Sequence[Digest], now: float) -> None:
        """Note that ``endpoint`` was sent the chain ``digests`` at ``now`` (its first ``max_blocks``)."""
        chain = digests[: self._max_blocks]
        if chain:
            routed = self._routed.get(endpoint)
            if routed is None:
                routed = self._routed[endpoint] = OrderedDict()
            move_to_end = routed.move_to_end
            for digest in chain:
                if digest in routed:
                    move_to_end(digest)
                routed[digest] = now
            self._sizes[endpoint] = len(routed)
            records = self._records
            records.append((max(now, records[-1][0]) if records else now, endpoint))
        self._pop(now)

    def sizes(self, now: float) -> dict[EndpointId, int]:
        """Distinct blocks routed to each endpoint within ``window_s`` before ``now`` (see the class)."""
        if now - self._popped_at > self.STALE_S:
            self._pop(now)
        return self._sizes.copy()

    def _pop(self, now: float) -> None:
        """Drop entries older than the window, and endpoints left with none (one that left the fleet).

        Only the endpoints of records that left the window are visited: an entry routed at ``at`` was
        routed by a record at ``at`` (or, when clocks went back, queued at a later time, so popped that
        much later), which leaves the queue once ``at`` is out of the window."""
        oldest = now - self._window
        records = self._records
        while records and records[0][0] <= oldest:
            endpoint = records.popleft()[1]
            routed = self._routed.get(endpoint)
            if routed is None:
                continue  # emptied by an earlier record's pop
            while routed:
                digest, at = next(iter(routed.items()))
                if at > oldest:
                    break
                del routed[digest]
            if routed:
                self._sizes[endpoint] = len(routed)
            else:
                del self._routed[endpoint], self._sizes[endpoint]
        self._popped_at = max(self._popped_at, now)
