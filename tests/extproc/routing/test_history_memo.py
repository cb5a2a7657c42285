"""A follow-up resumes at the previous turn's boundary (extproc/routing/history.py, issue 27.1).

The memoised path must end exactly where the unmemoised lazy path ends: the same ids and digests (so
still prefixes of the full tokenization and chain), the same estimate, and the same decision, on random
multi-turn chats whose messages hold whitespace runs, newlines and added-token text at the boundaries,
while endpoints drop what they held between turns. Their histories often outgrow the 48-block window, so
a follow-up also resumes at a full window's state (the boundary after the piece in which the window
ended: it then tokenizes nothing) and must end where the walk over the cached pieces ends.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.digest import Digest
from extproc.index.approximate import ApproximateIndex
from extproc.models.tokenizer import SegmentTokenizer
from extproc.routing.history import HistoryMemo
from extproc.routing.request import ParsedRequest
from extproc.routing.router import Decision, Router, Tokens
from tests.extproc.routing.test_lazy_tokens import ENDPOINTS, MODEL, make_router, picks, request_of, text_of

EDGES = ["", " ", "\n", "\n\n", "  ", "<|im_end|>", "<|im_start|>", "\t", "x"]


def message(rng: random.Random, role: str) -> dict[str, str]:
    body = text_of(rng, rng.randint(1, 300))
    return {"role": role, "content": rng.choice(EDGES) + body + rng.choice(EDGES)}


def twin(model_dir: str) -> tuple[Router, Router]:
    """A router with the memo and one without (its memo holds nothing), each on its own index."""
    memo = make_router(model_dir, ApproximateIndex(), max_blocks=48)
    plain = make_router(model_dir, ApproximateIndex(), max_blocks=48)
    plain.models = memo.models  # one tokenizer: both see the same segment cache
    plain.history = HistoryMemo(max_entries=0)
    return memo, plain


def tokens_alike(
    memo: Router, plain: Router, tokenizer: SegmentTokenizer, request: ParsedRequest, rng: random.Random
) -> tuple[Tokens, Tokens, list[Digest]]:
    """``request`` tokenized lazily by both routers (and the full chain's digests): the same ids, chain
    and estimate, prefixes of the full tokenization. Both paths see the same segment cache: every piece
    cached, or (the cache forgotten, one time in three) none, when long pieces are chunked. Where a path
    stops depends on it; that it stops alike must not."""
    forget = rng.random() < 0.3
    if not forget:
        memo.tokens(request, exact_count=True)
    if forget:
        tokenizer.clear_cache()
    a = memo.tokens(request)
    if forget:
        tokenizer.clear_cache()
    b = plain.tokens(request)
    full = memo.tokens(request, exact_count=True)
    full_digests = memo.digests(request, full)
    assert list(a.ids) == list(b.ids) == list(full.ids[: len(a.ids)])
    assert a.chain == b.chain and list(a.chain or ()) == full_digests[: len(a.chain or ())]
    assert (a.count, a.estimated, a.nbytes, a.counted) == (b.count, b.estimated, b.nbytes, b.counted)
    assert (a.rest is None) == (b.rest is None)
    return a, b, full_digests


def decide_alike(
    memo: Router, plain: Router, request: ParsedRequest, a: Tokens, b: Tokens, request_id: str, now: float
) -> tuple[Decision, Decision]:
    """Both routers' decisions on ``request`` tokenized as ``a`` and ``b`` (:func:`tokens_alike`): the
    same picks, blocks and lengths."""
    da = memo.decide(request, request_id=request_id, now=now, tokens=a)
    db = plain.decide(request, request_id=request_id, now=now, tokens=b)
    assert picks(da) == picks(db)
    assert (da.matched_blocks, da.scored_blocks, da.prompt_tokens, da.prompt_blocks) == (
        db.matched_blocks,
        db.scored_blocks,
        db.prompt_tokens,
        db.prompt_blocks,
    )
    return da, db


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), turns=st.integers(2, 6))
def test_memoised_turns_decide_as_unmemoised(model_dir: str, seed: int, turns: int) -> None:
    rng = random.Random(seed)
    memo, plain = twin(model_dir)
    tokenizer = memo.models.find(MODEL).tokenizer  # type: ignore[union-attr]
    history = [message(rng, "user")]
    for turn in range(turns):
        if turn and rng.random() < 0.3:  # an endpoint loses what it held: some memoised digests go
            gone = rng.choice(ENDPOINTS)
            memo.index.drop_endpoint(gone)  # type: ignore[attr-defined]
            plain.index.drop_endpoint(gone)  # type: ignore[attr-defined]
        request = request_of(history)
        now = float(turn)
        a, b, full_digests = tokens_alike(memo, plain, tokenizer, request, rng)
        da, db = decide_alike(memo, plain, request, a, b, f"r{turn}", now)
        memo.commit(da, now)
        plain.commit(db, now)
        assert list(da.digests) == list(db.digests) == full_digests
        history = [*history, message(rng, "assistant"), message(rng, "user")]


def test_a_follow_up_resumes_at_the_previous_turn(model_dir: str) -> None:
    """The second turn starts where the first turn's generation prompt began; an endpoint that drops
    the history sends the next turn back to its start (nothing held: nothing resumed)."""
    r = make_router(model_dir, ApproximateIndex(), max_blocks=256)
    rng = random.Random(7)
    first = [message(rng, "user"), message(rng, "assistant"), message(rng, "user")]
    decision = r.decide(request_of(first), request_id="a", now=0.0)
    r.commit(decision, 0.0)
    assert len(r.history) == 1
    follow = request_of([*first, message(rng, "assistant"), message(rng, "user")])
    lazy = r.tokens(follow)
    assert r.history.hits == 1
    cursor = lazy.rest.cursor if lazy.rest is not None else None
    assert cursor is not None and cursor.marks  # resumed past the history's pieces
    full = r.tokens(follow, exact_count=True)
    assert list(lazy.ids) == list(full.ids[: len(lazy.ids)])
    r.index.drop_endpoint(decision.endpoints[0].id)  # type: ignore[attr-defined]
    r.tokens(follow)
    assert r.history.hits == 1 and r.history.misses >= 2


def test_the_memo_is_bounded(model_dir: str) -> None:
    r = make_router(model_dir, ApproximateIndex(), max_blocks=256)
    r.history = HistoryMemo(max_entries=3)
    rng = random.Random(3)
    for i in range(6):
        d = r.decide(
            request_of([message(rng, "user"), message(rng, "assistant"), message(rng, "user")]),
            request_id=str(i),
            now=0.0,
        )
        r.commit(d, 0.0)
    assert len(r.history) == 3
    units = r.history.units
    r.history.max_units = units // 2
    d = r.decide(
        request_of([message(rng, "user"), message(rng, "assistant"), message(rng, "user")]),
        request_id="x",
        now=0.0,
    )
    r.commit(d, 0.0)
    assert r.history.units <= units // 2


def test_a_full_window_resumes_without_tokenizing(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A history longer than the window: the commit tokenizes the piece in which the window ended to its
    end and keeps the full window's state, so the follow-up tokenizes nothing and ends where the walk
    over the cached pieces ends; without that piece cached, the walk is taken."""
    memo, plain = twin(model_dir)  # a 48-block window
    tokenizer = memo.models.find(MODEL).tokenizer  # type: ignore[union-attr]
    rng = random.Random(11)
    first = [message(rng, "user"), message(rng, "assistant"), message(rng, "user")]
    while len(tokenizer.encode(str(first), False)) < 3 * 48 * 16:
        first.append(message(rng, "user"))
    decision = memo.decide(request_of(first), request_id="a", now=0.0)
    memo.commit(decision, 0.0)
    plain.index.record(decision.endpoints[0].id, decision.digests, 0.0)
    calls: list[int] = []
    for name in ("_chunk", "_tokenize"):
        original = getattr(tokenizer, name)
        monkeypatch.setattr(tokenizer, name, lambda x, f=original: calls.append(1) or f(x))
    follow = request_of([*first, message(rng, "assistant"), message(rng, "user")])
    a = memo.tokens(follow)
    assert (memo.history.full_hits, calls) == (1, [])
    assert a.rest is None and len(a.chain or ()) == 48
    b = plain.tokens(follow)  # the walk: every history piece is cached, the window ends in one of them
    assert calls == [] and plain.history.hits == 0
    assert list(a.ids) == list(b.ids) and a.chain == b.chain
    assert (a.count, a.estimated, a.counted) == (b.count, b.estimated, b.counted)
    tokenizer.clear_cache()
    c = memo.tokens(follow)
    assert memo.history.full_hits == 1 and calls  # the walk, from the last boundary before the window
    assert list(c.ids) == list(b.ids[: len(c.ids)]) and c.chain == b.chain


def test_a_long_piece_keeps_the_boundary_before_the_window(model_dir: str) -> None:
    """Past ``max_piece_chars`` the piece in which the window ended is not tokenized to its end: the
    state kept is the last boundary before the window is full."""
    r = make_router(model_dir, ApproximateIndex(), max_blocks=8)
    r.history = HistoryMemo(max_piece_chars=100)
    rng = random.Random(5)
    chat = [message(rng, "user"), {"role": "user", "content": text_of(rng, 400)}]
    d = r.decide(request_of(chat), request_id="a", now=0.0)
    r.commit(d, 0.0)
    r.tokens(request_of([*chat, message(rng, "assistant"), message(rng, "user")]))
    assert r.history.full_hits == 0
