"""Faults of an engine serving a model opted in to in-flight migration (``migration = true``): SIGKILL
mid-stream, and TCP resets mid-stream. The bound: ZERO failed requests (every stream continues on
another replica), and the gateway still learns of the failed engine (detected, ejected) although Envoy
only sees the migration proxy answer 200."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvgate.dev.up import Stack
from load import faults
from load.faults import DETECT_S, FaultRun, Windows
from tests.faults.conftest import start

W = Windows()


@pytest.fixture(scope="module")
def migrating(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from start(faults.migrating_options(tmp_path_factory.mktemp("faults-migration")))


async def test_a_killed_engine_loses_no_request_with_migration(migrating: Stack, note: Any) -> None:
    run: FaultRun = note(await faults.kill_migrating_engine(migrating, W))
    assert not run.failures(), run.failures()
    assert run.record.hung == 0 and run.record.sent > 10
    assert run.facts["resumed"] >= 1  # a stream was in flight on it and went on elsewhere
    assert run.facts["detected"] - run.injected < DETECT_S


async def test_an_engine_resetting_mid_stream_loses_no_request_and_is_ejected(
    migrating: Stack, note: Any
) -> None:
    run: FaultRun = note(await faults.reset_migrating_engine(migrating, W))
    assert not run.failures(), run.failures()
    assert run.record.hung == 0
    # The proxy's failed tries reach every ext_proc: the engine is ejected there as Envoy's would be.
    assert all(n >= 1 for n in run.facts["ejections"]), run.facts["ejections"]
