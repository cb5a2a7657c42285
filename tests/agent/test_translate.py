"""The translator from vLLM KV events to index events: in-memory tables, no sockets."""

from __future__ import annotations

import pytest

from agent.errors import AgentConfigError
from agent.kvevents import AllBlocksCleared, BlockRemoved, BlockStored
from agent.translate import Translator, vllm_salt
from contracts.digest import block_digests, chain_seed
from contracts.events import Cleared, Removed, Stored

EP = "10.0.0.1:8000"
MODEL = "smol"
TOKENS = list(range(1000, 1128))  # 128 tokens


def stored(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    block_size: int = 16,
    *,
    medium: str | None = "GPU",
    lora_name: str | None = None,
    group_idx: int | None = 0,
) -> BlockStored:
    return BlockStored(hashes, parent, tokens, block_size, None, medium, lora_name, None, group_idx)


def digests(tokens: list[int], block_size: int = 16, lora: str | None = None) -> list[bytes]:
    return list(block_digests(chain_seed(MODEL, lora=lora), tokens, block_size))


def test_digests_equal_the_digest_chain_and_parent_is_the_previous_digest() -> None:
    t = Translator(EP, MODEL, 16)
    out = t.apply([stored([1, 2], None, TOKENS[:32])])
    out += t.apply([stored([3, 4], 2, TOKENS[32:64])])
    want = digests(TOKENS[:64])
    assert out == [Stored(EP, want[:2], "gpu", None), Stored(EP, want[2:4], "gpu", want[1])]
    assert t.num_blocks == 4


def test_lora_name_seeds_the_chain() -> None:
    t = Translator(EP, MODEL, 16)
    (event,) = t.apply([stored([1], None, TOKENS[:16], lora_name="adapter")])
    assert isinstance(event, Stored)
    assert event.digests == digests(TOKENS[:16], lora="adapter") != digests(TOKENS[:16])


@pytest.mark.parametrize(
    ("engine_bs", "index_bs", "splits"),
    [
        (16, 16, [2, 3, 1, 2]),
        (32, 16, [1, 2, 1]),  # engine block = 2 index blocks
        (64, 16, [1, 1]),  # engine block = 4 index blocks
        (8, 16, [3, 1, 5, 2, 5]),  # index block = 2 engine blocks
        (4, 16, [7, 9, 16]),  # index block = 4 engine blocks
        (16, 24, [2, 3, 3]),  # neither divides the other
    ],
)
def test_differing_block_sizes_give_the_index_chain(engine_bs: int, index_bs: int, splits: list[int]) -> None:
    """A chain stored in several events (as an engine step would) yields exactly the digests of the
    index chain over the same tokens, each once, in order, each event's parent the digest before."""
    t = Translator(EP, MODEL, index_bs)
    n_blocks = sum(splits)
    tokens = list(range(5000, 5000 + n_blocks * engine_bs))
    want = digests(tokens, index_bs)
    got: list[bytes] = []
    parent: int | None = None
    block = 0
    for n in splits:
        hashes = list(range(100 + block, 100 + block + n))
        chunk = tokens[block * engine_bs : (block + n) * engine_bs]
        for event in t.apply([stored(hashes, parent, chunk, engine_bs)]):
            assert isinstance(event, Stored)
            assert event.parent == (got[-1] if got else None)
            got += event.digests
        block += n
        parent = hashes[-1]
    assert got == want


def test_index_block_completed_by_a_later_engine_block_is_removed_with_it() -> None:
    t = Translator(EP, MODEL, 16)
    want = digests(TOKENS[:32])
    t.apply([stored([1, 2, 3, 4], None, TOKENS[:32], 8)])
    assert t.apply([BlockRemoved([4], "GPU", 0)]) == [Removed(EP, [want[1]], "gpu")]
    assert t.apply([BlockRemoved([3], "GPU", 0)]) == []  # completes nothing
    assert t.apply([BlockRemoved([2, 1], "GPU", 0)]) == [Removed(EP, [want[0]], "gpu")]
    assert t.num_blocks == 0


def test_unknown_parent_is_a_gap_and_its_descendants_are_skipped() -> None:
    t = Translator(EP, MODEL, 16)
    assert t.apply([stored([7], 99, TOKENS[16:32])]) == []
    assert t.apply([stored([8], 7, TOKENS[32:48])]) == []
    assert t.stats.unknown_parent == 2
    assert t.num_blocks == 0
    assert t.snapshot() == []


def test_removal_of_unknown_hashes_is_ignored_and_counted() -> None:
    t = Translator(EP, MODEL, 16)
    t.apply([stored([1], None, TOKENS[:16])])
    assert t.apply([BlockRemoved([5, 6], "GPU", 0)]) == []
    assert t.apply([BlockRemoved([1], "CPU", 0)]) == []  # held in gpu, not in cpu
    assert t.stats.unknown_removed == 3
    assert t.num_blocks == 1


@pytest.mark.parametrize(
    ("medium", "tier"), [("GPU", "gpu"), ("CPU", "cpu"), ("STORAGE", "disk"), (None, "gpu")]
)
def test_medium_maps_to_tier(medium: str | None, tier: str) -> None:
    t = Translator(EP, MODEL, 16)
    d = digests(TOKENS[:16])
    assert t.apply([stored([1], None, TOKENS[:16], medium=medium)]) == [Stored(EP, d, tier)]
    assert t.apply([BlockRemoved([1], medium, 0)]) == [Removed(EP, d, tier)]


def test_tiers_are_independent_and_a_digest_leaves_with_its_last_holder() -> None:
    t = Translator(EP, MODEL, 16)
    d = digests(TOKENS[:16])
    t.apply([stored([1], None, TOKENS[:16]), stored([1], None, TOKENS[:16], medium="CPU")])
    assert t.apply([BlockRemoved([1], "GPU", 0)]) == [Removed(EP, d, "gpu")]
    assert t.snapshot() == [Stored(EP, d, "cpu", None)]
    # The same tokens under another engine hash (e.g. other extra keys): one digest, two holders.
    t.apply([stored([2], None, TOKENS[:16], medium="CPU")])
    assert t.apply([BlockRemoved([1], "CPU", 0)]) == []
    assert t.apply([BlockRemoved([2], "CPU", 0)]) == [Removed(EP, d, "cpu")]


def test_repeated_store_counts_once() -> None:
    t = Translator(EP, MODEL, 16)
    d = digests(TOKENS[:16])
    t.apply([stored([1], None, TOKENS[:16])])
    assert t.apply([stored([1], None, TOKENS[:16])]) == [Stored(EP, d, "gpu", None)]  # idempotent
    assert t.apply([BlockRemoved([1], "GPU", 0)]) == [Removed(EP, d, "gpu")]


def test_cleared_forgets_everything() -> None:
    t = Translator(EP, MODEL, 16)
    t.apply([stored([1, 2], None, TOKENS[:32])])
    assert t.apply([AllBlocksCleared()]) == [Cleared(EP, None)]
    assert t.num_blocks == 0 and t.snapshot() == []
    assert t.apply([stored([3], 2, TOKENS[32:48])]) == []  # its parent went with the clear
    assert t.reset() == [Cleared(EP, None)]
    assert t.stats.clears == 2


def test_snapshot_merges_chains_and_follows_removals() -> None:
    t = Translator(EP, MODEL, 16)
    a = digests(TOKENS[:64])
    other = list(range(7000, 7032))
    b = digests(other)
    t.apply([stored([1, 2], None, TOKENS[:32]), stored([10], None, other[:16])])
    t.apply([stored([3, 4], 2, TOKENS[32:64]), stored([11], 10, other[16:32])])
    t.apply([stored([3], 2, TOKENS[32:48], medium="CPU")])
    assert t.snapshot() == [
        Stored(EP, a, "gpu", None),
        Stored(EP, b, "gpu", None),
        Stored(EP, [a[2]], "cpu", a[1]),
    ]
    t.apply([BlockRemoved([4, 11], "GPU", 0)])
    assert t.snapshot() == [
        Stored(EP, a[:3], "gpu", None),
        Stored(EP, b[:1], "gpu", None),
        Stored(EP, [a[2]], "cpu", a[1]),
    ]
    assert t.num_blocks == 4


def test_other_groups_and_malformed_events_are_skipped() -> None:
    t = Translator(EP, MODEL, 16)
    assert t.apply([stored([1], None, TOKENS[:16], group_idx=1)]) == []
    assert t.apply([BlockRemoved([1], "GPU", 1)]) == []
    assert t.apply([stored([1], None, TOKENS[:15])]) == []
    assert t.apply([stored([1], None, TOKENS[:16], medium="NVME")]) == []
    # token ids a digest cannot hold (found by tests/fuzz/test_kv_events.py: they ended the event pump)
    assert t.apply([stored([1], None, [-1, *TOKENS[1:16]]), stored([1], None, [*TOKENS[:15], 2**32])]) == []
    assert (t.stats.other_groups, t.stats.malformed, t.stats.unknown_medium) == (2, 3, 1)
    d = digests(TOKENS[:16])
    assert t.apply([stored([1], None, TOKENS[:16], group_idx=None)]) == [Stored(EP, d, "gpu")]


def test_memory_is_bounded_by_what_the_engine_holds() -> None:
    t = Translator(EP, MODEL, 16)
    for i in range(50):
        tokens = list(range(i * 100, i * 100 + 32))
        t.apply([stored([2 * i, 2 * i + 1], None, tokens)])
        t.apply([BlockRemoved([2 * i + 1, 2 * i], "GPU", 0)])
    assert t.num_blocks == 0 and not t._held


def test_bad_block_size_is_a_config_error() -> None:
    with pytest.raises(AgentConfigError, match="block_size"):
        Translator(EP, MODEL, 0)


def test_snapshot_of_a_fork_names_each_branch_parent() -> None:
    t = Translator(EP, MODEL, 16)
    trunk, left, right = TOKENS[:16], TOKENS[16:32], list(range(9000, 9016))
    t.apply([stored([1], None, trunk), stored([2], 1, left), stored([3], 1, right)])
    d_trunk = digests(trunk)[0]
    d_left, d_right = digests(trunk + left)[1], digests(trunk + right)[1]
    assert t.snapshot() == [Stored(EP, [d_trunk, d_left], "gpu", None), Stored(EP, [d_right], "gpu", d_trunk)]


@pytest.mark.parametrize("keys", [[5], [3.5], 5, 3.5, "salt", b"x", {"a": 1}, [[1], None]])
def test_malformed_extra_keys_are_no_salt(keys: object) -> None:
    assert vllm_salt(keys, None) is None  # type: ignore[arg-type]
    assert vllm_salt(keys, "adapter") is None  # type: ignore[arg-type]


@pytest.mark.parametrize("first_keys", [5, 3.5, "s", None])
def test_a_block_with_malformed_extra_keys_is_translated_unsalted(first_keys: object) -> None:
    tokens = list(range(16))
    t = Translator("e", "m", 16)
    out = t.apply([BlockStored([1], None, tokens, 16, None, "GPU", None, [first_keys], 0)])
    assert out == [Stored("e", block_digests(chain_seed("m"), tokens, 16), "gpu", None)]
