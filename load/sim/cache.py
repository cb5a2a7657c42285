"""A paged KV cache with automatic prefix caching, after vLLM's block manager. Pure: no IO, no clock.

The cache owns ``num_blocks`` physical blocks of ``block_size`` tokens. A request (an *owner*) asks for
all the blocks its prompt and output will need at once (:meth:`PrefixCache.allocate`); the leading
blocks whose chain digests are already cached are shared with it (hits) instead of fresh ones. Every
block a running request holds is pinned (reference counted). As the engine computes full blocks it
registers their digests (:meth:`PrefixCache.commit`) so later requests can hit them. When a request
ends (:meth:`PrefixCache.free`), its registered blocks become evictable and join an LRU list; its
unregistered blocks go straight back to the free list. A fresh block comes from the free list first,
then by evicting the least recently used cached block. Blocks of a request are released tail first,
so a chain's later blocks are evicted before its prefix, as in vLLM.

Digests are opaque here: the engine computes them (``contracts.digest.block_digests``) and an identical
chunk at another position has another digest because each folds in its predecessor.

An optional :class:`CacheListener` hears about blocks stored, evicted and cleared; it is the seam for
publishing vLLM KV events.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from contracts.digest import Digest


class CacheListener(Protocol):
    """Observer of cache contents (the future source of vLLM ``BlockStored``/``BlockRemoved`` events)."""

    def on_stored(
        self,
        digests: Sequence[Digest],
        token_ids: Sequence[int],
        parent: Digest | None,
        lora: str | None = None,
        salt: str | None = None,
    ) -> None:
        """Consecutive full blocks became cached: their digests, their ``len(digests) * block_size``
        tokens, and the digest of the block before the first (``None`` at the start of a sequence)."""

    def on_removed(self, digests: Sequence[Digest]) -> None:
        """Cached blocks were evicted."""

    def on_cleared(self) -> None:
        """Every cached block was dropped."""


@dataclass(slots=True)
class _Allocation:
    """The blocks one owner holds, in sequence order; ``committed`` leading ones have digests."""

    blocks: list[int]
    committed: int


class PrefixCache:
    """Block pool with prefix reuse, reference counts and LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int, listener: CacheListener | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.listener = listener
        self._ref = [0] * num_blocks
        self._digest: list[Digest | None] = [None] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # unregistered, unpinned; pop() = 0 first
        self._lru: OrderedDict[int, None] = OrderedDict()  # registered, unpinned; oldest first
        self._table: dict[Digest, int] = {}
        self._owners: dict[str, _Allocation] = {}
        self._pinned = 0

    @property
    def num_pinned(self) -> int:
        """Blocks held by at least one running request."""
        return self._pinned

    @property
    def num_cached(self) -> int:
        """Blocks whose digests are registered (pinned or evictable)."""
        return len(self._table)

    @property
    def kv_usage(self) -> float:
        """Fraction 0..1 of blocks pinned by running requests (vLLM's ``kv_cache_usage_perc``)."""
        return self._pinned / self.num_blocks

    def match(self, digests: Sequence[Digest]) -> int:
        """How many leading ``digests`` are cached right now (no side effects)."""
        n = 0
        for digest in digests:
            if digest not in self._table:
                break
            n += 1
        return n

    def block_ids(self, digests: Sequence[Digest]) -> list[int]:
        """The block numbers of the leading ``digests`` that are cached (no side effects)."""
        return [self._table[d] for d in digests[: self.match(digests)]]

    def allocate(self, owner: str, prefix: Sequence[Digest], num_blocks: int) -> int | None:
        """Give ``owner`` ``num_blocks`` blocks, sharing the cached leading blocks of ``prefix``.

        ``prefix`` holds the digests that may be hits (at most ``num_blocks``). Returns the number of
        hit blocks, or ``None`` (and changes nothing) when too few blocks are free or evictable.
        """
        if owner in self._owners:
            raise ValueError(f"owner {owner!r} already holds blocks")
        hits = self.match(prefix[:num_blocks])
        hit_blocks = [self._table[d] for d in prefix[:hits]]
        evictable_hits = sum(1 for b in hit_blocks if self._ref[b] == 0)
        fresh = num_blocks - hits
        if fresh > len(self._free) + len(self._lru) - evictable_hits:
            return None
        for block in hit_blocks:
            self._pin(block)
        evicted: list[Digest] = []
        blocks = hit_blocks
        for _ in range(fresh):
            block = self._take(evicted)
            self._pin(block)
            blocks.append(block)
        if evicted and self.listener is not None:
            self.listener.on_removed(evicted)
        self._owners[owner] = _Allocation(blocks, hits)
        return hits

    def commit(
        self,
        owner: str,
        digests: Sequence[Digest],
        token_ids: Sequence[int],
        lora: str | None = None,
        salt: str | None = None,
    ) -> None:
        """Register the owner's computed full blocks: ``digests`` is its chain from block 0 and
        ``token_ids`` its tokens; blocks beyond those already committed are registered. ``lora`` and
        ``salt``: the owner's adapter and cache salt, for the listener (its events name them).

        A digest another block registered meanwhile (two requests computing the same prefix at once)
        leaves this block unregistered, so it is freed rather than cached when the owner ends.
        """
        alloc = self._owners[owner]
        end = min(len(digests), len(alloc.blocks))
        run_start = alloc.committed
        for i in range(alloc.committed, end):
            digest = digests[i]
            if digest in self._table:
                self._announce(digests, token_ids, run_start, i, lora, salt)
                run_start = i + 1
                continue
            block = alloc.blocks[i]
            self._digest[block] = digest
            self._table[digest] = block
        self._announce(digests, token_ids, run_start, end, lora, salt)
        alloc.committed = max(alloc.committed, end)

    def free(self, owner: str) -> None:
        """Release the owner's blocks (tail first); unknown owners are ignored."""
        alloc = self._owners.pop(owner, None)
        if alloc is None:
            return
        for block in reversed(alloc.blocks):
            self._ref[block] -= 1
            if self._ref[block]:
                continue
            self._pinned -= 1
            if self._digest[block] is None:
                self._free.append(block)
            else:
                self._lru[block] = None

    def reset(self) -> bool:
        """Drop every cached block, as vLLM's ``reset_prefix_cache``; refused (False) while any is pinned."""
        if self._pinned:
            return False
        for block in self._lru:
            self._digest[block] = None
            self._free.append(block)
        self._lru.clear()
        self._table.clear()
        if self.listener is not None:
            self.listener.on_cleared()
        return True

    def _pin(self, block: int) -> None:
        if self._ref[block] == 0:
            self._pinned += 1
            self._lru.pop(block, None)
        self._ref[block] += 1

    def _take(self, evicted: list[Digest]) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._lru.popitem(last=False)
        digest = self._digest[block]
        assert digest is not None
        del self._table[digest]
        self._digest[block] = None
        evicted.append(digest)
        return block

    def _announce(
        self,
        digests: Sequence[Digest],
        token_ids: Sequence[int],
        start: int,
        end: int,
        lora: str | None,
        salt: str | None,
    ) -> None:
        if end <= start or self.listener is None:
            return
        bs = self.block_size
        parent = digests[start - 1] if start else None
        self.listener.on_stored(digests[start:end], token_ids[start * bs : end * bs], parent, lora, salt)
