"""The simulated prefix cache: hits, chain positions, LRU eviction, pinning, usage and listener events."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from contracts.digest import Digest, block_digests, chain_seed
from load.sim.cache import PrefixCache

B = 4
SEED = chain_seed("m")


def chain(tokens: Sequence[int]) -> list[Digest]:
    return block_digests(SEED, list(tokens), B)


class Recorder:
    def __init__(self) -> None:
        self.stored: list[tuple[list[Digest], list[int], Digest | None]] = []
        self.removed: list[Digest] = []
        self.cleared = 0

    def on_stored(
        self,
        digests: Sequence[Digest],
        token_ids: Sequence[int],
        parent: Digest | None,
        lora: str | None = None,
        salt: str | None = None,
    ) -> None:
        self.stored.append((list(digests), list(token_ids), parent))

    def on_removed(self, digests: Sequence[Digest]) -> None:
        self.removed.extend(digests)

    def on_cleared(self) -> None:
        self.cleared += 1


def run(cache: PrefixCache, owner: str, tokens: list[int], n_blocks: int | None = None) -> int:
    """Allocate, compute every full block, free; returns the hit blocks."""
    digests = chain(tokens)
    hits = cache.allocate(owner, digests, n_blocks or len(digests))
    assert hits is not None
    cache.commit(owner, digests, tokens)
    cache.free(owner)
    return hits


def test_shared_prefix_hits_and_divergence_stops_matching() -> None:
    cache = PrefixCache(16, B)
    assert run(cache, "a", list(range(12))) == 0
    assert run(cache, "b", [*range(8), 99, 98, 97, 96]) == 2
    assert run(cache, "c", list(range(12))) == 3


def test_same_chunk_at_another_position_does_not_hit() -> None:
    cache = PrefixCache(16, B)
    run(cache, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.match(chain([5, 6, 7, 8])) == 0
    assert cache.match(chain([9, 9, 9, 9, 5, 6, 7, 8])) == 0
    assert cache.match(chain([1, 2, 3, 4, 5, 6, 7, 8])) == 2


def test_lru_evicts_least_recently_used_tail_first() -> None:
    rec = Recorder()
    cache = PrefixCache(4, B, rec)
    a, b = list(range(8)), list(range(100, 108))
    run(cache, "a", a)
    run(cache, "b", b)
    assert run(cache, "a2", a) == 2  # touching a makes b the least recently used
    assert run(cache, "c", list(range(200, 208))) == 0
    db = chain(b)
    assert rec.removed == [db[1], db[0]]  # a chain's tail goes before its prefix
    assert cache.match(chain(a)) == 2
    assert run(cache, "d", list(range(300, 304))) == 0
    assert rec.removed[2:] == [chain(a)[1]]  # then a, tail first
    assert cache.match(chain(a)) == 1


def test_pinned_blocks_are_never_evicted() -> None:
    cache = PrefixCache(4, B)
    held = chain(range(8))
    assert cache.allocate("running", held, 2) == 0
    cache.commit("running", held, list(range(8)))
    assert cache.allocate("big", chain(range(50, 62)), 3) is None  # would need a pinned block
    assert cache.num_pinned == 2
    assert cache.allocate("fits", chain(range(50, 58)), 2) == 0
    assert cache.match(held) == 2


def test_shared_blocks_count_once_and_kv_usage_tracks_pins() -> None:
    cache = PrefixCache(10, B)
    digests = chain(range(8))
    assert cache.allocate("a", digests, 3) == 0
    cache.commit("a", digests, list(range(8)))
    assert cache.kv_usage == pytest.approx(0.3)
    assert cache.allocate("b", digests, 3) == 2  # shares a's two computed blocks, one fresh
    assert cache.kv_usage == pytest.approx(0.4)
    cache.free("a")
    assert cache.kv_usage == pytest.approx(0.3)
    cache.free("b")
    assert cache.kv_usage == 0
    assert cache.num_cached == 2


def test_refused_allocation_changes_nothing() -> None:
    cache = PrefixCache(3, B)
    run(cache, "a", list(range(8)))
    assert cache.allocate("b", chain(range(8)), 4) is None
    assert cache.num_pinned == 0
    assert cache.allocate("b", chain(range(8)), 3) == 2


def test_listener_hears_stored_runs_with_parents_and_skips_duplicates() -> None:
    rec = Recorder()
    cache = PrefixCache(16, B, rec)
    tokens = list(range(12))
    digests = chain(tokens)
    cache.allocate("a", [], 3)
    cache.allocate("b", [], 3)  # computes the same prefix concurrently
    cache.commit("a", digests[:1], tokens)
    cache.commit("a", digests, tokens)
    cache.commit("b", digests, tokens)
    assert rec.stored == [([digests[0]], tokens[:4], None), (digests[1:], tokens[4:], digests[0])]
    cache.free("b")
    cache.free("a")
    assert cache.num_cached == 3


def test_reset_refused_while_pinned_then_clears() -> None:
    rec = Recorder()
    cache = PrefixCache(8, B, rec)
    run(cache, "a", list(range(8)))
    cache.allocate("b", [], 1)
    assert not cache.reset()
    cache.free("b")
    assert cache.reset()
    assert rec.cleared == 1
    assert cache.num_cached == 0
    assert cache.allocate("c", [], 8) == 0
