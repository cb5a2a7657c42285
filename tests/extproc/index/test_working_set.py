"""extproc.index.working_set: distinct blocks routed to each endpoint within the window."""

from __future__ import annotations

import math

import pytest

from contracts.errors import ConfigError
from extproc.index.working_set import WorkingSet
from tests.extproc.index.test_approximate import B_EP, A, blocks, chain


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
