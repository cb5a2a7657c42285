"""An engine SIGKILLed mid-stream, and an engine resetting its connections mid-stream, for a model opted
in to in-flight migration (``migration = true``) and, for comparison, one that is not. Three slower
simulators (48-token streams of over a second: a kill of an engine that runs a request cuts a stream).

The bounds: with migration, ZERO failed requests (every stream continues on another replica), and the
gateway still learns of the failed engine (detected, ejected) although Envoy only sees the migration
proxy answer 200; without it, failures only among requests in flight on the killed engine."""

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
    yield from start(faults.streaming_options(tmp_path_factory.mktemp("faults-migration")))


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from start(faults.streaming_options(tmp_path_factory.mktemp("faults-plain"), migration=False))


async def test_a_killed_engine_loses_no_request_with_migration(migrating: Stack, note: Any) -> None:
    run: FaultRun = note(await faults.kill_streaming_engine(migrating, W))
    assert not run.failures(), run.failures()
    assert run.record.hung == 0 and run.record.sent > 10
    migrated = run.facts["migrated"]
    assert migrated["resumed"] + migrated["reissued"] >= 1 and migrated["lost"] == 0, migrated
    assert run.facts["detected"] - run.injected < DETECT_S


async def test_an_engine_resetting_mid_stream_loses_no_request_and_is_ejected(
    migrating: Stack, note: Any
) -> None:
    run: FaultRun = note(await faults.reset_migrating_engine(migrating, W))
    assert not run.failures(), run.failures()
    assert run.record.hung == 0
    # The proxy's failed tries reach every ext_proc: the engine is ejected there as Envoy's would be.
    assert all(n >= 1 for n in run.facts["ejections"]), run.facts["ejections"]


async def test_without_migration_only_the_streams_in_flight_are_lost(plain: Stack, note: Any) -> None:
    run: FaultRun = note(await faults.kill_streaming_engine(plain, W))
    failed = run.failures()
    assert all(o.started < run.injected for o in failed), failed
    assert all(o.endpoint in (run.facts["address"], None) for o in failed), failed
    assert run.record.hung == 0 and run.record.sent > 10
