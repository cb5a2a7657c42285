"""The fault suite's stacks (one per module, supervised, restarted children reused) and its records.

Every scenario's :class:`~load.steady.FaultRecord` is collected; the session's summary prints them as a
table, and ``KVGATE_FAULTS_OUT=path.json`` also writes them there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from kvgate.dev.up import Stack, StackOptions
from load.faults import FAST_RESTART, FaultRun
from load.steady import FaultRecord

RECORDS: list[FaultRecord] = []


def start(options: StackOptions) -> Iterator[Stack]:
    with Stack(options) as stack:
        stack.supervise(FAST_RESTART)
        yield stack


@pytest.fixture
def note() -> Any:
    """``note(run)``: keep a scenario's record for the session's table; returns the run."""

    def keep(run: FaultRun) -> FaultRun:
        RECORDS.append(run.record)
        return run

    return keep


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not RECORDS:
        return
    terminalreporter.section("fault injection (tests/faults)")
    for r in RECORDS:
        failed = ", ".join(f"{k}: {v}" for k, v in r.failed.items()) or "0"
        terminalreporter.write_line(
            f"{r.fault:45} sent {r.sent:4}  ok {r.succeeded:4}  failed {failed:24} hung {r.hung}  "
            f"recovery {r.recovery_s:.2f} s"
        )
    out = os.environ.get("KVGATE_FAULTS_OUT")
    if out:
        with open(out, "w") as f:
            json.dump([r.as_dict() for r in RECORDS], f, indent=2)
