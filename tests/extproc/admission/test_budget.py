"""Token budgets (pure, ``now`` given): the bucket, reservations, settlement, and usage reading."""

from __future__ import annotations

import orjson
import pytest

from extproc.admission.budget import Refusal, TokenBucket, TokenBudgets
from extproc.admission.tenants import Tenant, TokenLimit
from extproc.admission.usage import Usage, UsageReader

# 600 tokens/min = 10 tokens/s, bucket of 100.
TENANT = Tenant("t", ("*",), tokens=TokenLimit(per_minute=600, burst=100))


@pytest.mark.parametrize(
    ("steps", "expected_level"),
    [
        # (op, amount, now) ... ; "take" returns the wait, "adjust" settles.
        ([("take", 40, 0.0)], 60.0),
        ([("take", 100, 0.0)], 0.0),
        ([("take", 101, 0.0)], 100.0),  # refused: nothing taken
        ([("take", 100, 0.0), ("take", 1, 0.05)], 0.5),  # 0.5 refilled, 1 refused
        ([("take", 100, 0.0), ("take", 30, 3.0)], 0.0),  # 30 refilled in 3 s
        ([("take", 50, 0.0), ("adjust", 20, 0.0)], 70.0),  # refund
        ([("take", 50, 0.0), ("adjust", -80, 0.0)], -30.0),  # charge beyond the bucket: debt
        ([("take", 50, 0.0), ("adjust", -80, 0.0), ("take", 1, 2.0)], -10.0),  # debt waits out
        ([("take", 10, 0.0), ("adjust", 500, 1.0)], 100.0),  # never above capacity
        ([("take", 10, 5.0), ("take", 10, 4.0)], 80.0),  # a clock going backwards refills nothing
    ],
)
def test_bucket(steps: list[tuple[str, float, float]], expected_level: float) -> None:
    bucket = TokenBucket(rate=10.0, capacity=100.0, now=0.0)
    for op, amount, now in steps:
        if op == "take":
            bucket.take(amount, now)
        else:
            bucket.adjust(amount, now)
    assert bucket.level == pytest.approx(expected_level)


def test_bucket_wait_is_time_to_enough_tokens() -> None:
    bucket = TokenBucket(rate=10.0, capacity=100.0, now=0.0)
    assert bucket.take(100, 0.0) == 0.0
    assert bucket.take(25, 1.0) == pytest.approx(1.5)  # 10 there, 15 missing at 10/s
    with pytest.raises(ValueError):
        TokenBucket(rate=0.0, capacity=1.0, now=0.0)


@pytest.mark.parametrize(
    ("reservations", "expected"),
    [
        ([(60, 0.0)], [None]),
        ([(60, 0.0), (40, 0.0)], [None, None]),
        ([(60, 0.0), (41, 0.0)], [None, Refusal(41, 100, 1)]),  # 0.1 s rounds up to 1 s
        ([(100, 0.0), (100, 0.0)], [None, Refusal(100, 100, 10)]),
        ([(100, 0.0), (100, 10.0)], [None, None]),
        ([(101, 0.0)], [Refusal(101, 100, None)]),  # never fits: no Retry-After
    ],
)
def test_reservations(reservations: list[tuple[int, float]], expected: list[Refusal | None]) -> None:
    budgets = TokenBudgets()
    assert [budgets.reserve(TENANT, n, now) for n, now in reservations] == expected


def test_settlement_refunds_and_charges() -> None:
    budgets = TokenBudgets()
    assert budgets.reserve(TENANT, 90, 0.0) is None  # prompt 10 + max_tokens 80
    budgets.settle(TENANT, reserved=90, actual=15, now=0.0)  # used 5 output tokens
    assert budgets.level(TENANT, 0.0) == pytest.approx(85.0)
    budgets.settle(TENANT, reserved=10, actual=60, now=0.0)  # under-reserved: charged the rest
    assert budgets.level(TENANT, 0.0) == pytest.approx(35.0)


def test_unlimited_tenant_and_changed_limit() -> None:
    budgets = TokenBudgets()
    free = Tenant("free", ("*",))
    assert budgets.reserve(free, 10**9, 0.0) is None and budgets.level(free, 0.0) is None
    budgets.settle(free, 1, 2, 0.0)
    assert budgets.reserve(TENANT, 100, 0.0) is None
    raised = Tenant("t", ("*",), tokens=TokenLimit(per_minute=6000, burst=1000))
    # a new limit keeps what was spent (100): 900 of the 1000 left, never a fresh full bucket
    assert budgets.reserve(raised, 1000, 0.0) == Refusal(1000, 1000, 1)
    assert budgets.reserve(raised, 900, 0.0) is None


def test_a_request_admitted_before_a_limit_change_settles_into_the_new_bucket() -> None:
    """Settling (or another replica's charge) with the tenant as it was at admission neither brings back
    the old limit's bucket nor refills the new one."""
    budgets = TokenBudgets()
    assert budgets.reserve(TENANT, 60, 0.0) is None  # admitted under the old limit: 60 spent
    lowered = Tenant("t", ("*",), tokens=TokenLimit(per_minute=60, burst=50))
    assert budgets.reserve(lowered, 1, 0.0) is not None  # 50 - 60 spent: 10 in debt
    assert budgets.level(lowered, 0.0) == pytest.approx(-10.0)
    budgets.settle(TENANT, reserved=60, actual=60, now=0.0)  # the old request ends, old tenant object
    budgets.charge(TENANT, 0, 0.0)
    assert budgets.level(lowered, 0.0) == pytest.approx(-10.0)  # not refilled
    assert budgets.reserve(lowered, 1, 0.0) is not None
    budgets.settle(TENANT, reserved=60, actual=0, now=0.0)  # a refund lands in the live bucket
    assert budgets.level(lowered, 0.0) == pytest.approx(50.0)  # capped at its capacity


@pytest.mark.parametrize(
    ("spent", "burst", "per_minute", "level", "later"),
    [
        # (spent under the old limit of 100 at 10/s, new burst, new per_minute) -> level now, 1 s later
        (0, 50, 600, 50.0, 50.0),  # nothing spent: full at the new burst
        (100, 1000, 600, 900.0, 910.0),  # raised: the spent 100 stays spent
        (30, 50, 600, 20.0, 30.0),  # lowered
        (100, 50, 60, -50.0, -49.0),  # lowered below what was spent: a debt, refilled at the new rate
    ],
)
def test_a_changed_limit_keeps_what_was_spent(
    spent: int, burst: int, per_minute: int, level: float, later: float
) -> None:
    budgets = TokenBudgets()
    if spent:
        assert budgets.reserve(TENANT, spent, 0.0) is None
    else:
        assert budgets.level(TENANT, 0.0) == pytest.approx(100.0)
    changed = Tenant("t", ("*",), tokens=TokenLimit(per_minute=per_minute, burst=burst))
    assert budgets.level(changed, 0.0) == pytest.approx(level)
    assert budgets.level(changed, 1.0) == pytest.approx(later)


def test_limit_flips_hand_out_no_fresh_budget() -> None:
    """Reserving alternately under an old and a new limit (requests identified before a tenant change)
    never starts a full bucket: at most what the larger burst holds goes out at once."""
    old = Tenant("t", ("*",), tokens=TokenLimit(per_minute=600, burst=1000))
    new = Tenant("t", ("*",), tokens=TokenLimit(per_minute=1200, burst=2000))
    budgets = TokenBudgets()
    assert budgets.reserve(new, 2000, 0.0) is None
    assert budgets.reserve(old, 1000, 0.0) is not None
    assert budgets.reserve(new, 2000, 0.0) is not None
    assert budgets.charged == {"t": 2000}


def test_negative_amounts_never_refill_a_bucket() -> None:
    """A negative amount is taken as 0: neither a take nor a reservation raises the level or lowers the
    counter other replicas are sent."""
    bucket = TokenBucket(rate=10.0, capacity=100.0, now=0.0)
    assert bucket.take(100, 0.0) == 0.0
    assert bucket.take(-(10**9), 0.0) == 0.0
    assert bucket.level == pytest.approx(0.0)
    budgets = TokenBudgets()
    assert budgets.reserve(TENANT, 100, 0.0) is None
    assert budgets.reserve(TENANT, -(10**9), 0.0) is None
    budgets.settle(TENANT, reserved=-(10**9), actual=0, now=0.0)  # unanswered: no usage
    assert budgets.level(TENANT, 0.0) == pytest.approx(0.0)
    assert budgets.charged == {"t": 100}


def sse(*events: dict[str, object]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


CHUNK = {"choices": [{"delta": {"content": "x"}}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3}}
EARLY = {**CHUNK, "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
JSON = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}})


@pytest.mark.parametrize(
    ("sse_mode", "body", "split", "expected"),
    [
        (False, JSON, 4, Usage(7, 5, True)),
        (False, orjson.dumps({"usage": {"completion_tokens": 5}}), 100, Usage(None, 5, True)),
        (False, orjson.dumps({"usage": None}), 100, None),
        (False, b"not json", 3, None),
        (True, sse(CHUNK, CHUNK, USAGE), 7, Usage(12, 3, True)),
        (True, sse(CHUNK, CHUNK, USAGE).replace(b"\n", b"\r\n"), 5, Usage(12, 3, True)),
        (True, sse(CHUNK, CHUNK, CHUNK), 1000, Usage(None, 3, False)),  # no usage: one token per event
        (True, sse(CHUNK, {"usage": None, "choices": []}), 9, Usage(None, 2, False)),
        (True, sse(EARLY, USAGE), 2, Usage(12, 3, True)),
        (True, b"", 1, None),
    ],
    ids=["json", "json-no-prompt", "json-null", "json-bad", "sse", "sse-crlf", "sse-estimate",
         "sse-null-usage", "sse-last-wins", "sse-empty"],
)  # fmt: skip
def test_usage_reader(sse_mode: bool, body: bytes, split: int, expected: Usage | None) -> None:
    reader = UsageReader(sse=sse_mode)
    chunks = [body[i : i + split] for i in range(0, len(body), split)] or [b""]
    for i, chunk in enumerate(chunks):
        reader.feed(chunk, end_of_stream=i == len(chunks) - 1)
    assert reader.ended and reader.result() == expected


def test_usage_reader_bounds_memory() -> None:
    reader = UsageReader(sse=False, max_json_bytes=10)
    reader.feed(b'{"usage": {"completion_tokens": 5}}', end_of_stream=True)
    assert reader.result() is None  # too big to keep: unknown, the reservation stands
    streamed = UsageReader(sse=True, max_json_bytes=10)
    streamed.feed(b"data: " + b"x" * 100)
    streamed.feed(b"\n\n" + sse(USAGE), end_of_stream=True)
    assert streamed.result() == Usage(12, 3, True)
