from __future__ import annotations

import pytest
from blake3 import blake3
from hypothesis import given
from hypothesis import strategies as st

from contracts.digest import DIGEST_BYTES, ChainCache, block_digests, chain_seed, pack_tokens

SEED = chain_seed("m")


def test_chain_definition() -> None:
    tokens = list(range(40))
    d = block_digests(SEED, tokens, 16)
    assert len(d) == 2  # the partial third block is never hashed
    d0 = blake3(SEED + pack_tokens(tokens[:16])).digest(DIGEST_BYTES)
    d1 = blake3(d0 + pack_tokens(tokens[16:32])).digest(DIGEST_BYTES)
    assert d == [d0, d1]


def test_tokens_are_fixed_width_little_endian() -> None:
    assert pack_tokens([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


def test_identical_chunk_at_another_position_never_matches() -> None:
    chunk = list(range(100, 116))
    a = block_digests(SEED, chunk + chunk, 16)
    b = block_digests(SEED, [7] * 16 + chunk, 16)
    assert a[0] != a[1]
    assert a[1] != b[1]
    assert len({*a, *b}) == 4


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (chain_seed("m"), chain_seed("n")),
        (chain_seed("m"), chain_seed("m", lora="a")),
        (chain_seed("m"), chain_seed("m", salt="tenant-1")),
        (chain_seed("m", lora="a"), chain_seed("m", salt="a")),
        (chain_seed("m", salt="t1"), chain_seed("m", salt="t2")),
    ],
)
def test_model_lora_and_salt_separate_chains(left: bytes, right: bytes) -> None:
    tokens = list(range(32))
    assert set(block_digests(left, tokens, 16)).isdisjoint(block_digests(right, tokens, 16))  # type: ignore[arg-type]


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(1, 32), st.data())
def test_resume_equals_full_chain(tokens: list[int], block: int, data: st.DataObject) -> None:
    full = block_digests(SEED, tokens, block)
    k = data.draw(st.integers(0, len(full)))
    resumed = block_digests(SEED, tokens, block, start=k * block, parent=full[k - 1] if k else None)
    assert full[:k] + resumed == full


def test_prefix_property() -> None:
    tokens = list(range(64))
    assert block_digests(SEED, tokens[:48], 16) == block_digests(SEED, tokens, 16)[:3]


def test_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError):
        block_digests(SEED, [1, 2], 0)


@given(st.lists(st.lists(st.integers(0, 50), max_size=80), min_size=1, max_size=6), st.integers(1, 8))
def test_chain_cache_equals_block_digests(prompts: list[list[int]], block: int) -> None:
    cache = ChainCache(max_entries=8)  # tiny: generations rotate during the test
    for prompt in prompts + prompts:
        assert cache.digests(SEED, prompt, block) == block_digests(SEED, prompt, block)


def test_chain_cache_hits_on_follow_up() -> None:
    cache = ChainCache()
    history = list(range(320))
    cache.digests(SEED, history, 16)
    assert (cache.hits, cache.misses) == (0, 20)
    cache.digests(SEED, [*history, *range(1000, 1032)], 16)
    assert (cache.hits, cache.misses) == (20, 22)
