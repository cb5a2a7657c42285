"""The power monitor's bookkeeping of failures: one log line per run of failures, a bug's included."""

from __future__ import annotations

import logging

import pytest

from agent.power.monitor import PowerMonitor
from agent.power.reading import Sample


class Buggy:
    """A source with a bug: it raises something other than PowerSourceError until ``fixed``."""

    name = "buggy"
    kind = "dcgm"

    def __init__(self) -> None:
        self.fixed = False

    async def read(self) -> Sample:
        if not self.fixed:
            raise KeyError("watts")
        return Sample(watts=100.0)

    async def aclose(self) -> None:
        return None


async def test_a_buggy_source_logs_once_per_run_of_failures(caplog: pytest.LogCaptureFixture) -> None:
    """A source that raises an unexpected exception on every read: its traceback is logged at the first
    failure of the run only (it used to be logged on every read), each read is a reading with the error,
    and the recovery is one line."""
    source = Buggy()
    monitor = PowerMonitor([(source, 1.0, 2.0)])
    caplog.set_level(logging.INFO, logger="agent.power.monitor")
    for _ in range(4):
        reading = await monitor.read_once("buggy")
        assert reading.watts is None and reading.error == "KeyError: 'watts'"
    assert [(r.levelno, r.exc_info is not None) for r in caplog.records] == [(logging.WARNING, True)]
    assert "failed unexpectedly" in caplog.records[0].getMessage()
    source.fixed = True
    assert (await monitor.read_once("buggy")).watts == 100.0
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO]
    assert "reads again after 4 failures" in caplog.records[1].getMessage()
    await monitor.aclose()
