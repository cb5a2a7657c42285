"""Tokenize only what can match (issue 27.1): the lazy path against full tokenization.

The router tokenizes piece by piece (long pieces in chunks), hashes each block as soon as it is complete
and stops at the first block no endpoint nor node store holds (``PrefixIndex.held``). Its tokens and
digests must be a prefix of the full ones reaching one block past the longest held prefix (or the window's
end), and the index match, the scorers' denominator (``Router.scored_blocks``), the scores and the pick
must be the same as with the whole prompt tokenized.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.digest import Digest
from contracts.events import EndpointId, Stored, node_store_endpoint
from engines.endpoint import Endpoint
from extproc.fleet import EndpointState, Fleet
from extproc.index.approximate import ApproximateIndex
from extproc.index.hybrid import HybridIndex
from extproc.index.interface import PrefixIndex
from extproc.index.precise import PreciseIndex
from extproc.models.registry import ModelAssets, ModelRegistry
from extproc.models.tokenizer import PrefixCursor, SegmentTokenizer
from extproc.routing.request import Kind, ParsedRequest, parse_body
from extproc.routing.router import Decision, Router, RoutingPolicy
from extproc.scheduling.interface import CycleState, SchedulingRequest
from extproc.scheduling.profile import ScheduleResult
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile

MODEL = "m"
ENDPOINTS = [EndpointId(f"e{i}") for i in range(3)]
WORDS = ["the", "cache", "token", "é", "中文", "😀", "don't", "x" * 300, "  ", "\n\n", "\t", "12345", "_"]
CODE = "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n"


def make_router(model_dir: str, index: PrefixIndex, max_blocks: int = 64) -> Router:
    assets = ModelAssets.load(MODEL, Path(model_dir), max_model_len=1 << 20)
    # e0 sits on node n1, whose kvcached the hybrid index may follow (a warm lead for kv-tier).
    fleet = Fleet(
        [
            Endpoint(e, f"127.0.0.{i + 1}:1", frozenset({MODEL}), node="n1" if i == 0 else None)
            for i, e in enumerate(ENDPOINTS)
        ]
    )
    policy = RoutingPolicy(build_profile(DEFAULT_SCHEDULING), block_size=16)
    return Router(fleet, ModelRegistry([assets]), index, policy, max_blocks=max_blocks, rng=random.Random(0))


def scored(router: Router) -> list[tuple[SchedulingRequest, dict[EndpointId, float]]]:
    """Every schedule ``router``'s profile runs from now on: its request and its candidates' totals."""
    seen: list[tuple[SchedulingRequest, dict[EndpointId, float]]] = []
    profile = router.policy.profile
    schedule = profile.schedule

    def spy(
        request: SchedulingRequest, state: CycleState, candidates: Sequence[EndpointState], rng: Any
    ) -> ScheduleResult:
        result = schedule(request, state, candidates, rng)
        seen.append((request, dict(result.scores)))
        return result

    profile.schedule = spy  # type: ignore[method-assign]
    return seen


def picks(decision: Decision) -> list[str]:
    return [s.id for s in decision.endpoints]


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
    whole = make_router(model_dir, index)  # the same index, every prompt tokenized whole
    if precise:
        r.node_stores = whole.node_stores = frozenset({"n1"})
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
    # The decision is the one made on the whole prompt (same denominator, scores and pick) and records
    # the whole window.
    lazy_scores, full_scores = scored(r), scored(whole)
    decision = r.decide(request, request_id="x", now=1.0, tokens=r.tokens(request))
    reference = whole.decide(request, request_id="x", now=1.0, tokens=whole.tokens(request, exact_count=True))
    assert decision.matched_blocks == index.match(full_digests, 1.0).get(decision.endpoints[0].id, 0)
    assert decision.scored_blocks == reference.scored_blocks
    assert [scores for _, scores in lazy_scores] == [scores for _, scores in full_scores]
    assert picks(decision) == picks(reference)
    assert decision.matched_blocks == reference.matched_blocks
    assert decision.kv_lead_blocks == reference.kv_lead_blocks
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


def test_a_follow_up_stops_at_its_first_unheld_block(model_dir: str, monkeypatch: Any) -> None:
    """A follow-up's history is held, its new turn is not: decide tokenizes up to the first block nobody
    holds (a chunk of the new reply), not the rest of the window; its scorers divide by the estimate
    from the prompt's bytes; the commit then hashes and records the whole window, as before."""
    r = make_router(model_dir, ApproximateIndex(), max_blocks=256)
    base = [{"role": "user", "content": " ".join(f"w{i}" for i in range(500))}]
    first = r.decide(request_of(base), request_id="a", now=0.0)
    r.commit(first, 0.0)
    held = len(first.digests)
    follow = request_of([*base, {"role": "assistant", "content": " ".join(f"new{i}" for i in range(400))}])
    full = r.digests(follow, r.tokens(follow, exact_count=True))
    assert len(full) > held + 50  # the new reply is many blocks long
    tokenizer = r.models.find(MODEL).tokenizer  # type: ignore[union-attr]
    tokenizer.clear_cache()
    r.tokens(request_of(base))  # the history's pieces cached again, as a follow-up finds them
    made: list[int] = []  # ids the tokenizer backend produced during the follow-up's decision
    for name in ("_tokenize", "_chunk"):
        original = getattr(tokenizer, name)

        def counting(arg: Any, original: Any = original) -> Any:
            out = original(arg)
            made.append(sum(len(v) for v in out.values()) if isinstance(out, dict) else len(out))
            return out

        monkeypatch.setattr(tokenizer, name, counting)
    decision = r.decide(follow, request_id="b", now=1.0)
    monkeypatch.undo()
    assert decision.rest is not None  # stopped in the unseen reply
    assert held < len(decision.digests) <= held + 8
    assert 0 < sum(made) < 150  # the first chunk of the reply, not its ~1,000 tokens
    assert decision.matched_blocks == held
    estimate = r.tokens(follow, exact_count=True).estimated
    assert estimate is not None
    assert decision.scored_blocks == max(min(256, estimate // 16), held + 1)
    r.commit(decision, 1.0)
    assert decision.rest is None and decision.digests == full[:256]


def test_a_full_hit_scores_one_and_the_ratio_is_learned(model_dir: str) -> None:
    """A prompt some endpoint holds whole is scored on its exact blocks (prefix score 1 there), whatever
    the estimate; prompts tokenized to their end teach the router the model's tokens per byte."""
    r = make_router(model_dir, ApproximateIndex(), max_blocks=256)
    assets = r.models.find(MODEL)
    assert assets is not None and 0.1 < assets.tokens_per_byte < 0.5
    request = request_of([{"role": "user", "content": " ".join(f"w{i}" for i in range(300))}])
    first = r.decide(request, request_id="a", now=0.0)
    assert first.rest is not None and first.scored_blocks >= 1
    r.commit(first, 0.0)
    tokens = r.tokens(request, exact_count=True)
    exact = tokens.count / tokens.nbytes
    learned = r.ratio(assets)
    assert abs(learned - exact) < abs(assets.tokens_per_byte - exact)  # one prompt moved it towards it
    seen = scored(r)
    again = r.decide(request, request_id="b", now=1.0)
    assert again.rest is None and again.scored_blocks == len(first.digests) == again.matched_blocks
    assert seen[0][0].blocks == len(first.digests)


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


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=12), st.integers(0, 12))
def test_unheld_is_the_first_digest_held_says_nobody_holds(where: list[int], start: int) -> None:
    """``unheld(chain, start)`` (one call on the lazy path) agrees with ``held`` asked block by block:
    each block of the chain held by nobody (0), an approximate endpoint (1), a precise one (2) or a node
    store (3), in any mix."""
    chain = [Digest(bytes([i]) * 16) for i in range(len(where))]
    approximate, precise, hybrid = ApproximateIndex(), PreciseIndex(), HybridIndex()
    store = EndpointId(node_store_endpoint("n1"))
    hybrid.set_precise(ENDPOINTS[1], True)
    hybrid.set_precise(store, True)
    for digest, kind in zip(chain, where, strict=True):
        if kind == 1:
            approximate.record(ENDPOINTS[0], [digest], 0.0)
            hybrid.record(ENDPOINTS[0], [digest], 0.0)
        elif kind == 2:
            precise.apply([Stored(ENDPOINTS[1], [digest], "gpu")], 0.0)
            hybrid.apply([Stored(ENDPOINTS[1], [digest], "gpu")], 0.0)
        elif kind == 3:
            precise.apply([Stored(store, [digest], "ssd")], 0.0)
            hybrid.apply([Stored(store, [digest], "ssd")], 0.0)
    for index in (approximate, precise, hybrid):
        first = next((i for i in range(start, len(chain)) if not index.held(chain[i])), len(chain))
        assert index.unheld(chain, start) == first


def estimate_by_pieces(cursor: PrefixCursor) -> int:
    """:meth:`PrefixCursor.estimate` from its definition: the ids so far, the added tokens and the
    characters left (at the ids-per-character ratio so far), the suffix (the cursor keeps running totals)."""
    rest = cursor.pieces[cursor._next :]
    specials = sum(1 for p in rest if isinstance(p, int))
    chars = sum(len(p) for p in rest if isinstance(p, str)) - cursor._offset
    per_char = len(cursor.ids) / cursor._chars if cursor._chars else 0.25
    return len(cursor.ids) + specials + round(chars * per_char) + len(cursor._suffix)


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
        assert cursor.estimate() == estimate_by_pieces(cursor)
        cursor.step()
        assert list(cursor.ids) == whole[: len(cursor.ids)]
    assert list(cursor.ids) == whole and cursor.estimate() == len(whole)
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
