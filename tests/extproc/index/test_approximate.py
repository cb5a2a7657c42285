from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from contracts.digest import Digest, block_digests, chain_seed
from contracts.errors import ConfigError
from contracts.events import EndpointId
from extproc.index.approximate import ApproximateIndex
from extproc.index.interface import PrefixIndex

B = 4  # tokens per block in these tests


SEED = chain_seed("m")


A, B_EP, C, D = (EndpointId(x) for x in ("a", "b", "c", "d"))


def chain(tokens: Sequence[int]) -> list[Digest]:
    return block_digests(SEED, tokens, B)


def blocks(*starts: int) -> list[int]:
    """Tokens of consecutive blocks, block i being ``starts[i] .. starts[i] + B - 1``."""
    return [s + k for s in starts for k in range(B)]


def reference_match(index: ApproximateIndex, digests: Sequence[Digest], now: float) -> dict[EndpointId, int]:
    """The definition: walk the chain block by block, counting each endpoint's contiguous lead."""
    result: dict[EndpointId, int] = {}
    alive: set[EndpointId] | None = None
    for i, digest in enumerate(digests[: index.max_match_blocks]):
        holders = set(index.holders(digest, now))
        current = holders if alive is None else alive & holders
        for ep in (alive or set()) - current:
            result[ep] = i
        alive = current
        if not alive:
            return result
    for ep in alive or set():
        result[ep] = min(len(digests), index.max_match_blocks)
    return result


def test_approximate_index_satisfies_protocol() -> None:
    index: PrefixIndex = ApproximateIndex()
    assert index.match([], 0.0) == {}


def test_identical_chunks_at_other_positions_do_not_match() -> None:
    index = ApproximateIndex()
    recorded = chain(blocks(100, 200))  # the chunk starting 200 sits at position 1
    index.record(A, recorded, now=0.0)
    query = chain(blocks(200))  # the same chunk at position 0
    assert query[0] != recorded[1]
    assert index.match(query, now=1.0) == {}
    assert index.match(chain(blocks(100, 200, 300)), now=1.0) == {A: 2}


def test_match_counts_leading_blocks_per_endpoint() -> None:
    index = ApproximateIndex()
    full = chain(blocks(*range(0, 800, 100)))  # 8 blocks
    index.record(C, full, 0.0)
    index.record(A, full[:5], 0.0)
    index.record(B_EP, full[:3], 0.0)
    index.record(D, full[:1], 0.0)
    assert index.match(full, 1.0) == {C: 8, A: 5, B_EP: 3, D: 1}
    assert index.match(full[:4], 1.0) == {C: 4, A: 4, B_EP: 3, D: 1}


def test_match_stops_at_first_block_nobody_holds() -> None:
    index = ApproximateIndex()
    index.record(A, chain(blocks(1, 2, 3, 4, 5)), 0.0)
    # Diverges at block 2; later blocks of the query chain are then unknown even if the tokens agree.
    query = chain(blocks(1, 2, 99, 4, 5))
    assert index.match(query, 1.0) == {A: 2}
    assert index.match(chain(blocks(99, 2, 3)), 1.0) == {}


def test_lru_capacity_evicts_tails_before_heads() -> None:
    index = ApproximateIndex(capacity_blocks_per_endpoint=4)
    first = chain(blocks(10, 11, 12))
    second = chain(blocks(20, 21, 22))
    index.record(A, first, 0.0)
    index.record(A, second, 1.0)
    assert index.occupancy() == {A: 4}
    assert index.match(first, 2.0) == {A: 1}
    assert index.match(second, 2.0) == {A: 3}
    assert len(index) == 4


def test_one_chain_longer_than_capacity_keeps_its_head() -> None:
    index = ApproximateIndex(capacity_blocks_per_endpoint=2)
    digests = chain(blocks(1, 2, 3, 4, 5))
    index.record(A, digests, 0.0)
    assert index.match(digests, 1.0) == {A: 2}


def test_record_refreshes_lru_position() -> None:
    index = ApproximateIndex(capacity_blocks_per_endpoint=4)
    first = chain(blocks(10, 11))
    second = chain(blocks(20, 21))
    index.record(A, first, 0.0)
    index.record(A, second, 1.0)
    index.record(A, first, 2.0)  # first is now the most recent
    index.record(A, chain(blocks(30, 31)), 3.0)  # evicts second, not first
    assert index.match(first, 4.0) == {A: 2}
    assert index.match(second, 4.0) == {}


def test_ttl_expiry_and_refresh() -> None:
    index = ApproximateIndex(ttl_s=10.0)
    digests = chain(blocks(1, 2, 3))
    index.record(A, digests, now=0.0)
    assert index.match(digests, now=9.9) == {A: 3}
    assert index.match(digests, now=10.0) == {}
    index.record(A, digests[:2], now=10.0)  # re-routed: the head lives on, the expired tail does not
    assert index.match(digests, now=15.0) == {A: 2}


def test_sweep_removes_expired_entries() -> None:
    index = ApproximateIndex(ttl_s=10.0)
    index.record(A, chain(blocks(1, 2, 3)), now=0.0)
    index.record(B_EP, chain(blocks(4, 5)), now=5.0)
    assert index.sweep(now=12.0, max_entries=2) == 2
    assert index.sweep(now=12.0, max_entries=100) == 1
    assert index.occupancy() == {A: 0, B_EP: 2}
    assert len(index) == 2


def test_record_lazily_sweeps_idle_endpoints() -> None:
    index = ApproximateIndex(ttl_s=10.0)
    index.record(A, chain(blocks(1, 2, 3)), now=0.0)
    for i in range(3):
        index.record(B_EP, chain(blocks(50 + i)), now=20.0)
    assert index.occupancy()[A] == 0
    assert len(index) == 3


def test_occupancy_counts_blocks_per_endpoint() -> None:
    index = ApproximateIndex()
    shared = chain(blocks(1, 2))
    index.record(A, shared, 0.0)
    index.record(B_EP, shared + chain(blocks(1, 2, 3))[2:], 0.0)
    index.record(A, shared, 1.0)  # recording again adds nothing
    assert index.occupancy() == {A: 2, B_EP: 3}
    assert len(index) == 3


def test_drop_endpoint_forgets_only_that_endpoint() -> None:
    index = ApproximateIndex()
    digests = chain(blocks(1, 2, 3))
    index.record(A, digests, 0.0)
    index.record(B_EP, digests[:2], 0.0)
    index.record(C, chain(blocks(7)), 0.0)
    index.drop_endpoint(A)
    index.drop_endpoint(EndpointId("unknown"))
    assert index.match(digests, 1.0) == {B_EP: 2}
    assert index.occupancy() == {B_EP: 2, C: 1}
    assert len(index) == 3
    index.record(A, digests, 2.0)  # comes back cleanly
    index.record(C, digests, 2.0)
    assert index.match(digests, 3.0) == {A: 3, B_EP: 2, C: 3}


def test_max_match_blocks_caps_match_and_record() -> None:
    index = ApproximateIndex(max_match_blocks=4)
    digests = chain(blocks(*range(10)))
    index.record(A, digests, 0.0)
    assert index.occupancy() == {A: 4}
    assert index.match(digests, 1.0) == {A: 4}
    assert index.match(digests[:2], 1.0) == {A: 2}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity_blocks_per_endpoint": 0},
        {"capacity_blocks_per_endpoint": True},
        {"ttl_s": 0.0},
        {"ttl_s": float("inf")},
        {"ttl_s": float("nan")},
        {"max_match_blocks": -1},
    ],
)
def test_invalid_settings(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        ApproximateIndex(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(8))
def test_match_equals_block_by_block_walk(seed: int) -> None:
    """Random shared-prefix traffic with eviction and expiry: the binary search agrees with the walk."""
    rng = random.Random(seed)
    index = ApproximateIndex(
        capacity_blocks_per_endpoint=rng.choice([8, 40, 400]), ttl_s=30.0, max_match_blocks=24
    )
    endpoints = [EndpointId(f"e{i}") for i in range(6)]
    roots = [[rng.randrange(1000) for _ in range(B * 3)] for _ in range(3)]
    now = 0.0
    for _ in range(300):
        now += rng.random() * 2
        tokens = rng.choice(roots) + [rng.randrange(4) for _ in range(B * rng.randrange(0, 30))]
        digests = chain(tokens)
        if rng.random() < 0.6:
            index.record(rng.choice(endpoints), digests[: rng.randrange(0, len(digests) + 1)], now)
        elif rng.random() < 0.03:
            index.drop_endpoint(rng.choice(endpoints))
        probe = now + rng.random() * 10
        assert index.match(digests, probe) == reference_match(index, digests, probe)
