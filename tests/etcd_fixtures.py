"""pytest fixtures around a real etcd (:mod:`kvgate.dev.etcd`).

One etcd serves the whole session; every test gets its own key prefix, so tests never see each other's
keys. Tests that stop and restart etcd take :func:`etcd_outage_server`, a server of their own. A test
module loads these fixtures as a plugin::

    pytest_plugins = ("tests.etcd_fixtures",)
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
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


# -- an etcd with client-certificate auth and kvgate's RBAC (kvgate.etcdsec) ---------------------------

#: The identities the secure etcd knows: a gateway, an operator, two agents, a node's kvcached, and the
#: shared agent identity (for agents whose names are not known in advance).
SECURE_IDENTITIES = ("extproc", "operator-alice", "agent-node-a", "agent-node-b", "kvcached-node-a", "agent")


@dataclass(frozen=True, slots=True)
class SecureEtcd:
    """A TLS etcd with ``--client-cert-auth``, bootstrapped for :data:`SECURE_IDENTITIES` under ``prefix``
    (auth enabled); :meth:`settings` connects as one identity (``root`` included)."""

    server: EtcdServer
    certs: Path
    prefix: str
    identities: tuple[str, ...] = SECURE_IDENTITIES

    def settings(self, identity: str, prefix: str | None = None) -> EtcdSettings:
        return EtcdSettings(
            endpoints=(self.server.address,),
            prefix=self.prefix if prefix is None else prefix,
            tls_ca=str(self.certs / "ca.pem"),
            tls_cert=str(self.certs / f"{identity}.pem"),
            tls_key=str(self.certs / f"{identity}.key"),
            timeout_s=5.0,
        )


@pytest.fixture(scope="session")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    """The session's secure etcd (auth enabled by :func:`kvgate.etcdsec.cli.bootstrap` as ``root``)."""
    from certs.store import dev_bundle
    from kvgate.dev.etcd import ServerTls
    from kvgate.etcdsec.cli import bootstrap

    workdir = tmp_path_factory.mktemp("secure-etcd")
    certs = workdir / "certs"
    files = dev_bundle(certs, ["etcd", "root", *SECURE_IDENTITIES], dt.datetime.now(dt.UTC))
    etcd, root = files["etcd"], files["root"]
    tls = ServerTls(etcd.ca, etcd.cert, etcd.key, root.cert, root.key)
    with EtcdServer(workdir / "etcd", tls=tls) as server:
        secure = SecureEtcd(server, certs, "/kvgate/")
        report = asyncio.run(bootstrap(secure.settings("root"), list(SECURE_IDENTITIES)))
        assert "auth enabled" in report.changes
        yield secure
