"""pytest fixtures around a real etcd (:mod:`kvgate.dev.etcd`).

One etcd serves the whole session; every test gets its own key prefix, so tests never see each other's
keys. Tests that stop and restart etcd take :func:`etcd_outage_server`, a server of their own. A test
module loads these fixtures as a plugin::

    pytest_plugins = ("tests.etcd_fixtures",)
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import etcd3aio
import pytest

from contracts.etcd import EtcdSettings
from kvgate.dev.etcd import EtcdServer
from runtime.etcd import connect


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """The session's etcd (never stopped by tests)."""
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture
def etcd_outage_server(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of this test's own, free to be stopped, wiped and restarted."""
    with EtcdServer(tmp_path / "etcd") as server:
        yield server


@pytest.fixture
def etcd_prefix() -> str:
    """A key prefix no other test uses."""
    return f"/kvgate-test/{uuid.uuid4().hex[:12]}/"


@pytest.fixture
def etcd_settings(etcd_server: EtcdServer, etcd_prefix: str) -> EtcdSettings:
    return EtcdSettings(endpoints=(etcd_server.address,), prefix=etcd_prefix, timeout_s=2.0)


@pytest.fixture
async def etcd_client(etcd_settings: EtcdSettings) -> AsyncIterator[etcd3aio.Etcd3Client]:
    """A client on the session's etcd, for the test's own reads and writes."""
    client = await connect(etcd_settings)
    yield client
    await client.close()
