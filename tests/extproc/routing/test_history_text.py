"""A follow-up's memoised state found by its text, and the held check skipped by the index's generation
(extproc/routing/history.py, issue 27.1).

As in ``test_history_memo.py``, the memoised path must end exactly where the unmemoised lazy path ends
and decide alike, here while the index loses blocks between turns by every path that can make a digest
unheld (LRU eviction, TTL expiry, ``Removed``, ``Cleared``, an endpoint dropped) and while turns branch
(another reply to the same history: the sorted texts' neighbour is then a sibling, not a prefix).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.events import Cleared, Removed, Stored
from extproc.index.approximate import ApproximateIndex
from extproc.index.hybrid import HybridIndex
from extproc.index.interface import PrefixIndex
from extproc.index.precise import PreciseIndex
from extproc.routing.history import HistoryMemo
from extproc.routing.router import Decision, Router
from tests.extproc.routing.test_history_memo import decide_alike, message, tokens_alike
from tests.extproc.routing.test_lazy_tokens import ENDPOINTS, MODEL, make_router, request_of


def make_index(kind: str, capacity: int) -> PrefixIndex:
    if kind == "approximate":
        return ApproximateIndex(capacity_blocks_per_endpoint=capacity, ttl_s=5.0)
    index = HybridIndex(PreciseIndex(speculative_ttl_s=3.0), ApproximateIndex(ttl_s=5.0))
    for endpoint in ENDPOINTS[:2]:  # the third stays approximate
        index.set_precise(endpoint, True)
    return index


def twin(model_dir: str, kind: str, capacity: int) -> tuple[Router, Router]:
    memo = make_router(model_dir, make_index(kind, capacity), max_blocks=48)
    plain = make_router(model_dir, make_index(kind, capacity), max_blocks=48)
    plain.models = memo.models  # one tokenizer: both see the same segment cache
    plain.history = HistoryMemo(max_entries=0)
    return memo, plain


def disturb(rng: random.Random, routers: tuple[Router, Router], last: Decision | None, now: float) -> None:
    """The same loss on both indexes: an endpoint dropped, or (events) the engine confirming, evicting or
    clearing what it was sent."""
    roll = rng.random()
    if roll < 0.15:
        gone = rng.choice(ENDPOINTS)
        for r in routers:
            r.index.drop_endpoint(gone)
        return
    if last is None or not isinstance(routers[0].index, HybridIndex) or last.served is None:
        return
    endpoint, digests = last.served.id, list(last.digests)
    events = [Stored(endpoint, digests)] if rng.random() < 0.6 else []
    if roll < 0.5 and digests:
        events.append(Removed(endpoint, rng.sample(digests, rng.randint(1, len(digests)))))
    elif roll < 0.6:
        events.append(Cleared(endpoint, rng.choice([None, "gpu"])))
    for r in routers:
        r.index.apply(events, now)  # type: ignore[attr-defined]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    turns=st.integers(2, 7),
    kind=st.sampled_from(["approximate", "hybrid"]),
    capacity=st.sampled_from([40, 120, 31_250]),
)
def test_found_by_text_decides_as_unmemoised(
    model_dir: str, seed: int, turns: int, kind: str, capacity: int
) -> None:
    rng = random.Random(seed)
    memo, plain = twin(model_dir, kind, capacity)
    tokenizer = memo.models.find(MODEL).tokenizer  # type: ignore[union-attr]
    base = [message(rng, "user")]
    history = base
    now = 0.0
    last: Decision | None = None
    for turn in range(turns):
        if turn:
            disturb(rng, (memo, plain), last, now)
            if rng.random() < 0.3:  # a sibling branch: another reply to the previous history
                history = [*base, message(rng, "assistant"), message(rng, "user")]
            else:
                base = history
                history = [*history, message(rng, "assistant"), message(rng, "user")]
        now += rng.uniform(0.0, 4.0)  # past the TTLs now and then: expiries swept by the records
        request = request_of(history)
        a, b, full_digests = tokens_alike(memo, plain, tokenizer, request, rng)
        if a.rest is not None and b.rest is not None:
            assert a.rest.cursor.pieces == tokenizer.split(
                memo.models.find(MODEL).template.render(  # type: ignore[union-attr]
                    request.messages, add_generation_prompt=True
                )
            )
        da, db = decide_alike(memo, plain, request, a, b, f"r{turn}", now)
        memo.commit(da, now)
        plain.commit(db, now)
        assert list(da.digests) == list(db.digests) == full_digests
        assert memo.index.generation == plain.index.generation
        last = da


def test_found_by_text_and_not_checked_again(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A follow-up is found by its text (the text is never cut whole) and, nothing having been made
    unheld since the commit recorded its history, its digests are not looked up again; a sibling branch
    is found through its parent; once something was evicted the digests are checked again, and a
    dropped endpoint that held them sends the turn back to its start."""
    r = make_router(model_dir, ApproximateIndex(), max_blocks=256)
    rng = random.Random(7)
    first = [message(rng, "user"), message(rng, "assistant"), message(rng, "user")]
    d = r.decide(request_of(first), request_id="a", now=0.0)
    r.commit(d, 0.0)
    tokenizer = r.models.find(MODEL).tokenizer  # type: ignore[union-attr]
    splits: list[int] = []
    original = tokenizer._split
    monkeypatch.setattr(tokenizer, "_split", lambda text: splits.append(1) or original(text))
    looked: list[int] = []
    unheld = ApproximateIndex.unheld
    monkeypatch.setattr(
        ApproximateIndex,
        "unheld",
        lambda self, ds, start: looked.append(len(ds) - start) or unheld(self, ds, start),
    )

    def turn(messages: list[dict[str, str]], rid: str) -> Decision:
        decision = r.decide(request_of(messages), request_id=rid, now=0.0)
        r.commit(decision, 0.0)
        return decision

    turn([*first, message(rng, "assistant"), message(rng, "user")], "b")
    assert (r.history.text_hits, r.history.unchecked, splits) == (1, 1, [])
    assert max(looked) < 10  # only the new blocks: the history's were not looked up
    turn([*first, message(rng, "assistant"), message(rng, "user")], "c")  # a sibling of "b"
    assert (r.history.text_hits, r.history.unchecked, splits) == (2, 2, [])
    other = next(e for e in ENDPOINTS if e != d.endpoints[0].id)
    r.index.record(other, [bytes([9]) * 16], 0.0)
    r.index.drop_endpoint(other)  # made a digest unheld: the generation moved
    looked.clear()
    turn([*first, message(rng, "assistant"), message(rng, "user")], "d")
    assert (r.history.text_hits, r.history.unchecked) == (3, 2) and max(looked) > 10
    r.index.drop_endpoint(d.endpoints[0].id)  # the history is held nowhere now
    hits = r.history.hits
    turn([*first, message(rng, "assistant"), message(rng, "user")], "e")
    assert r.history.hits == hits and splits == []  # found, not held: the text's own cut, no resume
