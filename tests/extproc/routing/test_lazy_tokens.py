"""Tokenize only what can match (issue 27.1): the lazy path against full tokenization.

The router tokenizes piece by piece (long pieces in chunks), hashes each block as soon as it is complete
and stops at the first block no endpoint nor node store holds (``PrefixIndex.held``). Its tokens and
digests must be a prefix of the full ones reaching one block past the longest held prefix (or the window's
end), and the index match (hence the pick) must be the same.
"""

from __future__ import annotations

import random
from pathlib import Path

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.digest import Digest
from contracts.events import EndpointId, Stored, node_store_endpoint
from engines.endpoint import Endpoint
from extproc.fleet import Fleet
from extproc.index.approximate import ApproximateIndex
from extproc.index.hybrid import HybridIndex
from extproc.index.interface import PrefixIndex
from extproc.index.precise import PreciseIndex
from extproc.models.registry import ModelAssets, ModelRegistry
from extproc.models.tokenizer import SegmentTokenizer
from extproc.routing.request import Kind, ParsedRequest, parse_body
from extproc.routing.router import Router, RoutingPolicy
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile

MODEL = "m"
ENDPOINTS = [EndpointId(f"e{i}") for i in range(3)]
WORDS = ["the", "cache", "token", "é", "中文", "😀", "don't", "x" * 300, "  ", "\n\n", "\t", "12345", "_"]
CODE = "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n"


def make_router(model_dir: str, index: PrefixIndex, max_blocks: int = 64) -> Router:
    assets = ModelAssets.load(MODEL, Path(model_dir), max_model_len=1 << 20)
    fleet = Fleet([Endpoint(e, f"127.0.0.{i + 1}:1", frozenset({MODEL})) for i, e in enumerate(ENDPOINTS)])
    policy = RoutingPolicy(build_profile(DEFAULT_SCHEDULING), block_size=16)
    return Router(fleet, ModelRegistry([assets]), index, policy, max_blocks=max_blocks, rng=random.Random(0))


def text_of(rng: random.Random, words: int) -> str:
    parts: list[str] = []
    for _ in range(words):
        roll = rng.random()
        parts.append(CODE if roll < 0.02 else " " * rng.randint(2, 9) if roll < 0.05 else rng.choice(WORDS))
        parts.append(rng.choice([" ", " ", " ", "", "\n", ", "]))
    return "".join(parts)


def chat(rng: random.Random, turns: int) -> list[dict[str, str]]:
    roles = ["user", "assistant"]
    return [{"role": roles[t % 2], "content": text_of(rng, rng.randint(1, 400))} for t in range(turns)]


def request_of(messages: list[dict[str, str]]) -> ParsedRequest:
    return parse_body(Kind.CHAT, orjson.dumps({"model": MODEL, "messages": messages}))


def fill(index: PrefixIndex, rng: random.Random, chains: list[list[Digest]]) -> None:
    """Hold random prefixes of ``chains`` on random endpoints (and, for a precise index, node stores)."""
    for chain in chains:
        for endpoint in ENDPOINTS:
            if rng.random() < 0.5:
                index.record(endpoint, chain[: rng.randint(0, len(chain))], 0.0)
    if isinstance(index, HybridIndex) and rng.random() < 0.5:
        store = node_store_endpoint("n1")
        index.set_precise(EndpointId(store), True)
        index.apply([Stored(store, list(chains[0][: rng.randint(0, len(chains[0]))]), "ram")], 0.0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), precise=st.booleans(), turns=st.integers(1, 6))
def test_lazy_path_is_a_prefix_and_matches_the_same(
    model_dir: str, seed: int, precise: bool, turns: int
) -> None:
    rng = random.Random(seed)
    index = HybridIndex(events=precise)
    if precise:
        for endpoint in ENDPOINTS:
            index.set_precise(endpoint, rng.random() < 0.7)
    r = make_router(model_dir, index)
    history = chat(rng, turns)
    earlier = [history[: rng.randint(1, turns)] for _ in range(2)]
    # The index holds prefixes of earlier turns of this chat (and of the chat itself, sometimes).
    full_chains = [r.digests(request_of(m), r.tokens(request_of(m), exact_count=True)) for m in earlier]
    fill(index, rng, full_chains)
    if rng.random() < 0.5:
        r.models.find(MODEL).tokenizer.clear_cache()  # type: ignore[union-attr]
    request = request_of(history + chat(rng, rng.randint(1, 2)))
    full = r.tokens(request, exact_count=True)
    full_digests = r.digests(request, full)
    lazy = r.tokens(request)
    lazy_digests = r.digests(request, lazy)
    assert list(lazy.ids) == list(full.ids[: len(lazy.ids)])
    assert lazy_digests == full_digests[: len(lazy_digests)]
    longest = 0
    while longest < len(full_digests) and index.held(full_digests[longest]):
        longest += 1
    assert len(lazy_digests) >= min(longest + 1, len(full_digests))
    assert lazy.rest is not None or lazy_digests == full_digests
    assert index.match(lazy_digests, 1.0) == index.match(full_digests, 1.0)
    stores = [EndpointId(node_store_endpoint("n1"))]
    assert index.node_leads(stores, lazy_digests) == index.node_leads(stores, full_digests)
    # The decision matches as on the full chain and records the whole window.
    decision = r.decide(request, request_id="x", now=1.0, tokens=lazy)
    assert decision.matched_blocks == index.match(full_digests, 1.0).get(decision.endpoints[0].id, 0)
    r.commit(decision, 1.0)
    assert decision.digests == full_digests and decision.rest is None


def test_a_first_turn_stops_at_its_first_block(model_dir: str) -> None:
    """Nobody holds block 0 of a long first turn: a chunk of it is tokenized, not the window; the commit
    then records the whole window, exactly as before."""
    r = make_router(model_dir, ApproximateIndex(), max_blocks=256)
    words = ["the", "model", "cache", "is", "warm", "again"]
    request = request_of([{"role": "user", "content": " ".join(words[i % 6] for i in range(3000))}])
    lazy = r.tokens(request)
    full = r.tokens(request, exact_count=True)
    assert lazy.rest is not None and 16 <= len(lazy.ids) < 200
    assert abs(lazy.count - full.count) <= 0.5 * full.count  # estimated from what was tokenized
    decision = r.decide(request, request_id="x", now=0.0, tokens=lazy)
    assert len(decision.digests) < 16 and decision.matched_blocks == 0
    r.commit(decision, 0.0)
    assert decision.digests == r.digests(request, full)
    assert r.index.occupancy() == {decision.endpoints[0].id: len(decision.digests)}
    # The follow-up finds the whole window held: the lazy path reaches it.
    again = r.tokens(request)
    assert again.rest is None and r.digests(request, again) == decision.digests


def test_decide_hashes_the_window_when_a_lead_exists(model_dir: str) -> None:
    """The prefix scorer divides by the window's blocks, so a lead makes decide hash them all."""
    r = make_router(model_dir, ApproximateIndex(), max_blocks=256)
    base = [{"role": "user", "content": " ".join(f"w{i}" for i in range(500))}]
    first = r.decide(request_of(base), request_id="a", now=0.0)
    r.commit(first, 0.0)
    follow = request_of([*base, {"role": "assistant", "content": "new " * 400}])
    lazy = r.tokens(follow)
    assert lazy.rest is not None  # stopped in the unseen reply
    decision = r.decide(follow, request_id="b", now=1.0, tokens=lazy)
    assert decision.digests == r.digests(follow, r.tokens(follow, exact_count=True))[:256]
    assert decision.rest is None and decision.matched_blocks == len(first.digests)


def test_held_on_each_index_kind() -> None:
    a, b, c = Digest(b"a" * 16), Digest(b"b" * 16), Digest(b"c" * 16)
    approximate = ApproximateIndex(ttl_s=1.0)
    approximate.record(ENDPOINTS[0], [a, b], 0.0)
    assert approximate.held(a) and approximate.held(b) and not approximate.held(c)
    approximate.drop_endpoint(ENDPOINTS[0])
    assert not approximate.held(a)

    precise = PreciseIndex()
    precise.apply([Stored(ENDPOINTS[0], [a], "gpu")], 0.0)
    precise.record(ENDPOINTS[1], [b], 0.0)  # speculative
    store = node_store_endpoint("n1")
    precise.apply([Stored(store, [c], "ssd")], 0.0)
    assert precise.held(a) and precise.held(b) and precise.held(c)
    assert not precise.held(Digest(b"d" * 16))

    hybrid = HybridIndex()
    hybrid.record(ENDPOINTS[0], [a], 0.0)  # approximate
    hybrid.set_precise(EndpointId(store), True)
    hybrid.apply([Stored(store, [b], "ram")], 0.0)
    assert hybrid.held(a) and hybrid.held(b) and not hybrid.held(c)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "a",
                "b",
                " ",
                "  ",
                "\n",
                "\t",
                "'s",
                "1",
                "23",
                "é",
                "中",
                "😀",
                "_",
                ".",
                "!",
                "\u00a0",
                "\u2003",
                "\x1c",
            ]
        ),
        max_size=1500,
    )
)
def test_chunked_pieces_are_prefixes_of_the_whole(smollm2_dir: Path, parts: list[str]) -> None:
    tokenizer = _tokenizer(smollm2_dir)
    text = "".join(parts)
    tokenizer.clear_cache()
    whole = tokenizer.encode_whole(text, add_special_tokens=False)
    cursor = tokenizer.cursor(text, add_special_tokens=False)
    while not cursor.done:
        cursor.step()
        assert cursor.ids == whole[: len(cursor.ids)]
    assert cursor.ids == whole and cursor.estimate() == len(whole)
    assert tokenizer.encode(text, add_special_tokens=False) == whole  # a piece finished in chunks is cached


_TOKENIZERS: dict[Path, SegmentTokenizer] = {}


def _tokenizer(path: Path) -> SegmentTokenizer:
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = SegmentTokenizer.from_file(path)
    return _TOKENIZERS[path]


def test_long_pieces_are_chunked(smollm2_dir: Path) -> None:
    tokenizer = _tokenizer(smollm2_dir)
    tokenizer.clear_cache()
    text = " ".join(f"word{i}" for i in range(5000))
    cursor = tokenizer.cursor(text, add_special_tokens=False)
    cursor.step()
    assert 0 < len(cursor.ids) < 200 and not cursor.done
