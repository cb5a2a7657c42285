"""Token budgets across the workers of one host without etcd (extproc/control/siblings.py, kind 3): the
codec, then two real buses in a temp dir, each over a real UsageLedger and TokenBudgets: one worker's
spending is charged to its sibling's bucket of the same tenant, so the host spends one budget; a worker
restarted under the same name (a new start) is a new replica whose counter starting from 0 is no
refund; a sibling older than the receiver is a baseline when first heard."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from extproc.admission.budget import TokenBudgets
from extproc.admission.shared import UsageLedger
from extproc.admission.tenants import Tenant, TokenLimit
from extproc.control.siblings import MessageError, SiblingBus, Usage, decode, encode_usage
from tests.extproc.control.test_siblings import router
from tests.polling import until

# 600 tokens a minute, a bucket of 1,000: nothing refills noticeably within a test.
TENANT = Tenant("acme", ("*",), tokens=TokenLimit(per_minute=600, burst=1000))


def test_usage_codec() -> None:
    counters = {f"tenant-{i}": i * 1000 for i in range(60)}
    (whole,) = encode_usage("w", 123, counters)
    assert decode(whole) == Usage("w", 123, counters)
    parts = [decode(d) for d in encode_usage("w", 123, counters, limit=200)]
    assert len(parts) > 1
    merged: dict[str, int] = {}
    for part in parts:
        assert isinstance(part, Usage) and part.started_ns == 123
        merged.update(part.counters)
    assert merged == counters
    assert [decode(d) for d in encode_usage("w", 1, {})] == [Usage("w", 1, {})]  # "nothing charged yet"
    (clamped,) = encode_usage("w", 1, {"t": 2**70, "r": -(2**70)})
    assert decode(clamped).counters == {"t": 2**63 - 1, "r": -(2**63)}  # type: ignore[union-attr]
    with pytest.raises(MessageError):
        decode(encode_usage("w", 1, {"t": 5})[0][:-1])


class Worker:
    """One ext_proc's budgets, ledger and bus."""

    def __init__(self, directory: Path, name: str) -> None:
        self.budgets = TokenBudgets()
        self.ledger = UsageLedger(self.budgets, {TENANT.id: TENANT}.get)
        self.bus = SiblingBus(directory, name, router(), usage=self.ledger, heartbeat_s=0.05, expire_s=0.5)

    def level(self) -> float:
        level = self.budgets.level(TENANT, time.monotonic())
        assert level is not None
        return level

    def spend(self, tokens: int) -> None:
        assert self.budgets.reserve(TENANT, tokens, time.monotonic()) is None
        self.bus.queue_changed()  # as routing a request does: the counters go within coalesce_s


async def test_one_workers_spending_is_charged_to_its_siblings_bucket(tmp_path: Path) -> None:
    directory = tmp_path / "sib"
    a, b = Worker(directory, "w-0"), Worker(directory, "w-1")
    a.bus.start()
    b.bus.start()
    try:
        # Heard each other first: an older sibling's first counter is a baseline (its spending before
        # the receiver heard it, at most a heartbeat after the receiver started, is not charged there).
        await until(lambda: b.bus.loads.senders == ["w-0"] and a.bus.loads.senders == ["w-1"], 5.0)
        await until(lambda: b.bus.usage_heard("w-0") and a.bus.usage_heard("w-1"), 5.0)
        a.spend(300)
        await until(lambda: b.level() <= 700.5, 5.0)  # b's bucket sees a's 300 tokens
        b.spend(200)
        await until(lambda: a.level() <= 500.5, 5.0)  # and a's sees b's 200: one budget of 1,000
        assert a.budgets.reserve(TENANT, 600, time.monotonic()) is not None  # over what is left
        await until(lambda: b.level() <= 500.5, 5.0)
        heartbeats = b.level()
        await until(lambda: b.bus.loads.senders == ["w-0"], 5.0)
        assert b.level() == pytest.approx(heartbeats, abs=1.0)  # repeated counters charge nothing more
    finally:
        await a.bus.aclose()
        await b.bus.aclose()


async def test_a_restarted_sibling_is_no_refund_and_an_older_one_is_a_baseline(tmp_path: Path) -> None:
    directory = tmp_path / "sib"
    old = Worker(directory, "w-0")
    old.spend(400)  # spent before its sibling existed: the sibling must not charge it
    old.bus.start()
    new = Worker(directory, "w-1")
    new.bus.started_ns = max(new.bus.started_ns, old.bus.started_ns + 1)  # started after it
    new.bus.start()
    try:
        await until(lambda: new.bus.loads.senders == ["w-0"], 5.0)
        await until(lambda: old.bus.loads.senders == ["w-1"], 5.0)
        assert new.level() == pytest.approx(1000, abs=1.0)  # the older sibling's 400: a baseline
        old.spend(100)
        await until(lambda: new.level() <= 900.5, 5.0)  # its change since: charged
        await old.bus.aclose()
        restarted = Worker(directory, "w-0")  # same name, new process: its counter starts at 0
        restarted.bus.start()
        try:
            restarted.spend(50)
            await until(lambda: new.level() <= 850.5, 5.0)  # charged in full, the old 500 not refunded
        finally:
            await restarted.bus.aclose()
    finally:
        await old.bus.aclose()
        await new.bus.aclose()
