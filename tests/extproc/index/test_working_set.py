"""extproc.index.working_set: distinct blocks routed to each endpoint within the window."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.digest import Digest
from contracts.errors import ConfigError
from contracts.events import EndpointId
from extproc.index.working_set import WorkingSet
from tests.extproc.index.test_approximate import B_EP, A, C, D, blocks, chain


def test_working_set_counts_distinct_blocks_routed_within_the_window() -> None:
    ws = WorkingSet(window_s=10.0)
    first, second = chain(blocks(0, 100, 200)), chain(blocks(0, 100, 300, 400))
    ws.record(A, first, 0.0)
    ws.record(A, second, 4.0)  # shares two blocks with ``first``: 3 + 2 distinct
    ws.record(B_EP, first, 5.0)
    assert ws.sizes(9.0) == {A: 5, B_EP: 3}
    # ``first``'s third block (routed to A at 0.0 only) left A's window at 10.0; the two it shares with
    # ``second`` were routed again at 4.0 and stay. Answers lag by up to STALE_S: 10.5 is 1.5 s past the
    # last pop (9.0).
    assert ws.sizes(10.5) == {A: 4, B_EP: 3}
    assert ws.sizes(14.0) == {B_EP: 3}  # nothing routed to A within 10 s: A is forgotten
    ws.record(A, first, 14.5)  # a record pops for every endpoint: B's blocks (5.0) are still in
    assert ws.sizes(15.0) == {A: 3, B_EP: 3}  # B's left at 15.0: within STALE_S of the last pop
    assert ws.sizes(14.5 + WorkingSet.STALE_S + 0.01) == {A: 3}


def test_working_set_counts_only_the_blocks_the_index_would_match() -> None:
    ws = WorkingSet(window_s=1.0, max_blocks=2)
    ws.record(A, chain(blocks(0, 100, 200)), 0.0)
    ws.record(B_EP, chain(blocks(0)), 0.0)
    assert ws.sizes(0.5) == {A: 2, B_EP: 1}


@pytest.mark.parametrize("window", [0.0, -1.0, math.inf, math.nan, True])
def test_working_set_rejects_bad_window(window: float) -> None:
    with pytest.raises(ConfigError, match="working_set_s"):
        WorkingSet(window_s=window)


class _Walk:
    """The working set as it was before the record queue: every pop walks every endpoint, and the sizes
    are counted anew (the reference the queued version must answer like)."""

    STALE_S = WorkingSet.STALE_S

    def __init__(self, window_s: float, max_blocks: int) -> None:
        self.window, self.max_blocks = window_s, max_blocks
        self.routed: dict[EndpointId, OrderedDict[Digest, float]] = {}
        self.popped_at = -math.inf

    def record(self, endpoint: EndpointId, digests: list[Digest], now: float) -> None:
        routed = self.routed.setdefault(endpoint, OrderedDict())
        for digest in digests[: self.max_blocks]:
            routed.pop(digest, None)
            routed[digest] = now
        self.pop(now)

    def sizes(self, now: float) -> dict[EndpointId, int]:
        if now - self.popped_at > self.STALE_S:
            self.pop(now)
        return {endpoint: len(routed) for endpoint, routed in self.routed.items()}

    def pop(self, now: float) -> None:
        oldest = now - self.window
        for endpoint, routed in list(self.routed.items()):
            while routed and next(iter(routed.values())) <= oldest:
                routed.popitem(last=False)
            if not routed:
                del self.routed[endpoint]
        self.popped_at = max(self.popped_at, now)


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["record", "sizes"]),
            st.sampled_from([A, B_EP, C, D]),
            st.integers(0, 5),  # which chain
            st.integers(0, 6),  # its length in blocks (0: nothing to record)
            st.floats(0.0, 4.0),  # seconds since the step before
        ),
        max_size=60,
    )
)
def test_working_set_answers_as_walking_every_endpoint(
    steps: list[tuple[str, EndpointId, int, int, float]],
) -> None:
    """The record queue visits only the endpoints whose records left the window; the sizes it answers, and
    the entries it keeps, are those of a pop that walks every endpoint, for any records and reads."""
    chains = [chain(blocks(*range(1000 * k, 1000 * k + 100 * 6, 100))) for k in range(6)]
    for k in range(1, 6):  # chains 1..5 share their first k blocks with chain 0
        chains[k][:k] = chains[0][:k]
    ws, walk = WorkingSet(window_s=5.0, max_blocks=4), _Walk(5.0, 4)
    now = 0.0
    for kind, endpoint, which, length, gap in steps:
        now += gap
        if kind == "record":
            ws.record(endpoint, chains[which][:length], now)
            walk.record(endpoint, chains[which][:length], now)
        else:
            assert ws.sizes(now) == walk.sizes(now)
            assert list(ws.sizes(now)) == list(walk.sizes(now))  # the same order
    assert ws.sizes(now + 100.0) == walk.sizes(now + 100.0) == {}
