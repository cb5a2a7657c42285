"""The approximate prefix index: learned from the gateway's own routing decisions (no engine events).

When the picker sends a request to an endpoint, the request's blocks are recorded there (speculatively:
the engine will have computed them). Each endpoint keeps a bounded LRU of digests with an expiry,
mirroring an engine's own eviction. It implements :class:`~extproc.index.interface.PrefixIndex`.

All times are monotonic seconds passed in by the caller (``now``); nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TypeAlias

from contracts.digest import Digest
from contracts.errors import ConfigError
from contracts.events import EndpointId
from extproc.index.interface import DEFAULT_MAX_MATCH_BLOCKS, require_positive_int

DEFAULT_CAPACITY_BLOCKS = 31_250
"""Blocks remembered per endpoint: 500,000 tokens of 16-token blocks, a large GPU's worth of KV cache."""

DEFAULT_TTL_S = 300.0
"""Seconds a recorded block is trusted without being routed again."""

SWEEP_BATCH = 64
"""Expired entries removed per endpoint per :meth:`ApproximateIndex.record` call (bounded lazy sweep)."""


_Holders: TypeAlias = "EndpointId | dict[EndpointId, float]"
"""The endpoints holding one digest: a sole holder's id, or holder -> expiry for two or more."""


class ApproximateIndex:
    """A prefix index learned from the gateway's own routing decisions.

    Two structures hold one expiry per (endpoint, digest), in monotonic seconds:

    - ``_lru[endpoint]``: an ``OrderedDict`` digest -> expiry, least recently recorded first, bounded to
      ``capacity_blocks_per_endpoint``;
    - ``_where[digest]``: the endpoints whose LRU holds the digest: the endpoint id itself when there is
      one (most blocks; its expiry is read from its LRU), else a dict endpoint -> expiry. About 160 bytes
      per (endpoint, block) entry, plus the digest.

    :meth:`record` inserts a chain tail first, so a chain's leading blocks are always more recent than its
    later ones: LRU eviction and TTL expiry then remove tails before heads, exactly as engines evict (vLLM
    frees a request's blocks in reverse order). Because every record starts at block 0 and ``now`` never
    decreases, the blocks one endpoint holds of any chain are always a contiguous prefix of it, and the
    endpoints holding block ``i + 1`` are a subset of those holding block ``i``. :meth:`match` relies on this
    to binary-search the end of each endpoint's prefix instead of walking every block.

    Expired entries never match; they are removed lazily, at most :data:`SWEEP_BATCH` per endpoint per
    :meth:`record` (the recorded endpoint and one other in turn), or by an explicit :meth:`sweep`.
    """

    __slots__ = ("_capacity", "_cursor", "_generation", "_lru", "_max_match", "_ring", "_ttl", "_where")

    def __init__(
        self,
        capacity_blocks_per_endpoint: int = DEFAULT_CAPACITY_BLOCKS,
        ttl_s: float = DEFAULT_TTL_S,
        max_match_blocks: int = DEFAULT_MAX_MATCH_BLOCKS,
    ) -> None:
        require_positive_int("capacity_blocks_per_endpoint", capacity_blocks_per_endpoint)
        require_positive_int("max_match_blocks", max_match_blocks)
        if not 0 < ttl_s < float("inf"):
            raise ConfigError(f"ttl_s must be positive and finite, got {ttl_s!r}")
        self._capacity = capacity_blocks_per_endpoint
        self._ttl = float(ttl_s)
        self._max_match = max_match_blocks
        self._lru: dict[EndpointId, OrderedDict[Digest, float]] = {}
        self._where: dict[Digest, _Holders] = {}
        self._ring: list[EndpointId] = []  # endpoints in sweep order
        self._cursor = 0
        self._generation = 0  # digests that left ``_where`` (:attr:`generation`)

    @property
    def max_match_blocks(self) -> int:
        """Leading blocks considered by :meth:`match` and :meth:`record`."""
        return self._max_match

    @property
    def generation(self) -> int:
        """How many times a digest left ``_where`` (:meth:`held` turned false): an LRU eviction, a sweep or
        :meth:`drop_endpoint` that removed its last holder (see
        :attr:`~extproc.index.interface.PrefixIndex.generation`)."""
        return self._generation

    def match(self, digests: Sequence[Digest], now: float) -> dict[EndpointId, int]:
        """Leading blocks of ``digests`` each endpoint holds, unexpired at ``now``.

        Cost: one lookup of the last block, then for endpoints that stop earlier a binary search shared by
        endpoints that stop at the same place: O(log n) lookups per distinct stopping point.
        """
        result: dict[EndpointId, int] = {}
        n = min(len(digests), self._max_match)
        if n == 0:
            return result
        head = digests[0]
        first = self._where.get(head)
        if first is None:
            return result
        lru = self._lru
        if isinstance(first, dict):
            valid = {ep for ep, expiry in first.items() if expiry > now}
        elif lru[first][head] > now:
            valid = {first}
        else:
            return result
        if n > 1:
            tail = digests[n - 1]
            last = self._where.get(tail)
            if last is None:
                full: set[EndpointId] = set()
            elif isinstance(last, dict):
                full = {ep for ep, expiry in last.items() if expiry > now}
            else:
                full = {last} if lru[last][tail] > now else set()
            partial = valid - full  # full is a subset of valid: holdings are prefix-closed
            if partial:
                # Every endpoint in ``partial`` holds block 0 and not block n - 1.
                self._settle(digests, partial, 1, n - 1, now, result)
            valid = full
        for endpoint in valid:
            result[endpoint] = n
        return result

    def _settle(
        self,
        digests: Sequence[Digest],
        group: set[EndpointId],
        lo: int,
        hi: int,
        now: float,
        result: dict[EndpointId, int],
    ) -> None:
        """Set ``result`` for ``group``, whose members all hold ``lo`` leading blocks and not block ``hi``."""
        where = self._where
        while lo < hi:
            mid = (lo + hi) // 2
            digest = digests[mid]
            holders = where.get(digest)
            if holders is None:
                hi = mid
                continue
            if not isinstance(holders, dict):
                held = {holders} if holders in group and self._lru[holders][digest] > now else set()
            elif len(holders) <= len(group):
                held = {ep for ep, expiry in holders.items() if expiry > now and ep in group}
            else:
                held = {ep for ep in group if holders.get(ep, now) > now}
            if not held:
                hi = mid
            elif len(held) == len(group):
                lo = mid + 1
            else:
                group = group - held  # a fresh set: ``held`` is settled on its own below
                self._settle(digests, held, mid + 1, hi, now, result)
                hi = mid
        for endpoint in group:
            result[endpoint] = lo

    def _expiry(self, holders: _Holders | None, endpoint: EndpointId, digest: Digest) -> float:
        """When ``endpoint``'s entry for ``digest`` expires (``-inf``: it has none)."""
        if holders is None:
            return -math.inf
        if isinstance(holders, dict):
            return holders.get(endpoint, -math.inf)
        return self._lru[holders][digest] if holders == endpoint else -math.inf

    def holders(self, digest: Digest, now: float) -> list[EndpointId]:
        """Endpoints holding ``digest`` unexpired at ``now`` (for inspection and tests)."""
        holders = self._where.get(digest)
        if holders is None:
            return []
        candidates = list(holders) if isinstance(holders, dict) else [holders]
        return [ep for ep in candidates if self._expiry(holders, ep, digest) > now]

    def held(self, digest: Digest) -> bool:
        """Whether some endpoint has an entry for ``digest``, expired or not (see
        :meth:`~extproc.index.interface.PrefixIndex.held`). One dict lookup."""
        return digest in self._where

    def unheld(self, digests: Sequence[Digest], start: int) -> int:
        """The first of ``digests[start:]`` without an entry (:meth:`held`), else ``len(digests)``."""
        where = self._where
        for i in range(start, len(digests)):
            if digests[i] not in where:
                return i
        return len(digests)

    def record(self, endpoint: EndpointId, digests: Sequence[Digest], now: float) -> None:
        """Remember that ``endpoint`` holds the chain ``digests`` (from block 0) until ``now + ttl_s``.

        Blocks beyond ``max_match_blocks`` are not recorded: they could never be matched.
        """
        lru = self._lru.get(endpoint)
        if lru is None:
            lru = self._lru[endpoint] = OrderedDict()
            self._ring.append(endpoint)
        where = self._where
        find = where.get
        move_to_end = lru.move_to_end
        expiry = now + self._ttl
        for digest in reversed(digests[: self._max_match]):  # tail first: the head ends up most recent
            if digest in lru:
                move_to_end(digest)
            lru[digest] = expiry
            holders = find(digest)
            if holders is None:
                where[digest] = endpoint
            elif isinstance(holders, dict):
                holders[endpoint] = expiry
            elif holders != endpoint:
                where[digest] = {holders: self._lru[holders][digest], endpoint: expiry}
        for _ in range(len(lru) - self._capacity):
            digest, _expiry = lru.popitem(last=False)
            self._unlink(digest, endpoint)
        self._sweep_one(endpoint, lru, now, SWEEP_BATCH)
        ring = self._ring
        if len(ring) > 1:
            self._cursor = (self._cursor + 1) % len(ring)
            other = ring[self._cursor]
            if other != endpoint:
                self._sweep_one(other, self._lru[other], now, SWEEP_BATCH)

    def sweep(self, now: float, max_entries: int) -> int:
        """Remove up to ``max_entries`` entries expired at ``now``, oldest first; returns how many."""
        removed = 0
        for endpoint, lru in self._lru.items():
            if removed >= max_entries:
                break
            removed += self._sweep_one(endpoint, lru, now, max_entries - removed)
        return removed

    def _sweep_one(
        self, endpoint: EndpointId, lru: OrderedDict[Digest, float], now: float, budget: int
    ) -> int:
        """Pop expired entries from the old end of one LRU (where expiries are earliest)."""
        removed = 0
        while removed < budget and lru:
            digest, expiry = next(iter(lru.items()))
            if expiry > now:
                break
            del lru[digest]
            self._unlink(digest, endpoint)
            removed += 1
        return removed

    def _unlink(self, digest: Digest, endpoint: EndpointId) -> None:
        """Remove ``endpoint`` from the holders of ``digest`` (its LRU entry is already gone)."""
        where = self._where
        holders = where.get(digest)
        if isinstance(holders, dict):
            holders.pop(endpoint, None)
            if len(holders) == 1:
                where[digest] = next(iter(holders))
            elif not holders:  # pragma: no cover - a dict always has two holders or more
                del where[digest]
                self._generation += 1
        elif holders == endpoint:
            del where[digest]
            self._generation += 1

    def is_precise(self, endpoint: EndpointId) -> bool:
        """Never: every entry here is learned from routing decisions."""
        return False

    def node_leads(self, endpoints: Iterable[EndpointId], digests: Sequence[Digest]) -> dict[EndpointId, int]:
        """Nothing: node tiers are reported by kvcached's events, which only a precise index keeps."""
        return {}

    def occupancy(self) -> dict[EndpointId, int]:
        """Blocks recorded per endpoint; may include entries expired since the last sweep."""
        return {endpoint: len(lru) for endpoint, lru in self._lru.items()}

    def drop_endpoint(self, endpoint: EndpointId) -> None:
        """Forget ``endpoint`` and every block recorded for it. O(blocks held)."""
        lru = self._lru.pop(endpoint, None)
        if lru is None:
            return
        for digest in lru:
            self._unlink(digest, endpoint)
        index = self._ring.index(endpoint)
        del self._ring[index]
        if index <= self._cursor and self._cursor > 0:
            self._cursor -= 1

    def __len__(self) -> int:
        """Distinct digests recorded on at least one endpoint."""
        return len(self._where)
