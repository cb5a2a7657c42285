"""The prefix index's interface: which endpoint holds which KV blocks, keyed by block digest.

The scheduler asks one question per request: for the request's digest chain (see :mod:`contracts.digest`),
how many LEADING blocks does each endpoint hold? An engine can only reuse a cached prefix that is
contiguous from block 0, so a block held after a gap is worth nothing and is not counted. Two indexes
answer it: :class:`~extproc.index.approximate.ApproximateIndex` (learned from routing decisions) and
:class:`~extproc.index.precise.PreciseIndex` (fed by engine KV events, DESIGN.md contract 2);
:class:`~extproc.index.hybrid.HybridIndex` puts each endpoint in one or the other.

All times are monotonic seconds passed in by the caller (``now``); nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from contracts.digest import Digest
from contracts.errors import ConfigError
from contracts.events import EndpointId

DEFAULT_MAX_MATCH_BLOCKS = 256
"""At most this many leading blocks are matched or recorded (256 blocks of 16 tokens: 4,096 tokens)."""


def require_positive_int(key: str, value: int) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an ``int`` > 0 (``bool`` is refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")


class PrefixIndex(Protocol):
    """Where KV blocks are cached, as far as the gateway knows."""

    def match(self, digests: Sequence[Digest], now: float) -> dict[EndpointId, int]:
        """Leading blocks of the chain ``digests`` (from block 0) that each endpoint holds.

        Endpoints holding none are absent. At most ``max_match_blocks`` blocks are considered.
        """
        ...

    def held(self, digest: Digest) -> bool:
        """Whether any endpoint or node store may hold ``digest``, in any tier or speculatively. O(1).

        ``False`` is definite: no endpoint's :meth:`match` lead nor any :meth:`node_leads` lead can reach
        past this block at any ``now``, so (digests being chained) no later block of the chain can count
        either. ``True`` may include entries expired but not yet swept: a caller that stops at the first
        unheld block of a chain only ever looks at a few blocks too many, never too few.
        """
        ...

    def unheld(self, digests: Sequence[Digest], start: int) -> int:
        """The index of the first of ``digests[start:]`` that :meth:`held` says nobody holds, else
        ``len(digests)``: the same answer as calling :meth:`held` on each in turn, in one call (the lazy
        path checks every block of a follow-up's held history)."""
        ...

    @property
    def generation(self) -> int:
        """A count that grows whenever a digest :meth:`held` said was held may have stopped being so (an
        eviction, a removal or clear, an expiry swept, an endpoint dropped), and only then: while it reads
        the same as at an earlier read, every digest held then is still held (a record only adds). The
        history memo skips re-checking a remembered chain with it (:mod:`extproc.routing.history`)."""
        ...

    @property
    def max_match_blocks(self) -> int:
        """Leading blocks considered by :meth:`match` and :meth:`record` (a record holds at most these)."""
        ...

    def record(self, endpoint: EndpointId, digests: Sequence[Digest], now: float) -> None:
        """Note that ``endpoint`` was sent the chain ``digests`` (from block 0) at ``now``."""
        ...

    def occupancy(self) -> Mapping[EndpointId, int]:
        """Blocks each endpoint is known to hold in total (cache fill, for spreading cold prefixes)."""
        ...

    def drop_endpoint(self, endpoint: EndpointId) -> None:
        """Forget everything held by ``endpoint`` (removed, restarted or its cache cleared)."""
        ...

    def is_precise(self, endpoint: EndpointId) -> bool:
        """Whether what ``endpoint`` holds comes from its engine's KV events (so a lead it lost to eviction
        is gone from :meth:`match`), rather than from routing decisions alone."""
        ...

    def node_leads(self, endpoints: Iterable[EndpointId], digests: Sequence[Digest]) -> dict[EndpointId, int]:
        """Leading blocks of ``digests`` each of ``endpoints`` (nodes' kvcached pseudo endpoints, see
        :func:`contracts.events.node_store_endpoint`) holds in a node tier (``ram``, ``ssd``); endpoints
        holding none are absent."""
        ...
