"""runtime.etcd: the connection and leased keys against a real etcd."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import etcd3aio
import pytest

from certs.store import LeafFiles
from contracts.errors import ConfigError
from contracts.etcd import (
    EtcdSettings,
)
from kvgate.dev.etcd import TEST_TTL_S, EtcdServer, ServerTls
from runtime.etcd import ETCD_ERRORS, LeasedKeys, connect
from runtime.tls import ClientTlsFiles
from tests.etcd_access import may_put
from tests.extproc.migration.test_identity import copy_of
from tests.polling import until

if TYPE_CHECKING:
    from tests.etcd_fixtures import SecureEtcd

pytest_plugins = ("tests.etcd_fixtures",)


async def test_connect_reports_missing_tls_file(tmp_path: Path) -> None:
    settings = EtcdSettings(tls_ca=str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="tls_ca"):
        await connect(settings)


async def _until(condition: Callable[[], Awaitable[bool]], timeout_s: float) -> float:
    """Poll ``condition`` until true; the seconds it took (fails after ``timeout_s``)."""
    started = time.monotonic()
    while not await condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def _value(client: etcd3aio.Etcd3Client, key: str) -> bytes | None:
    assert client.kv is not None
    response = await client.kv.get(key, timeout=2.0)
    return bytes(response.kvs[0].value) if response.kvs else None


async def test_leased_keys_put_update_delete_revoke(
    etcd_client: etcd3aio.Etcd3Client, etcd_prefix: str
) -> None:
    a, b = etcd_prefix + "endpoints/a", etcd_prefix + "endpoints/b"
    keys = LeasedKeys(etcd_client, TEST_TTL_S)
    assert await keys.start({a: b"1", b: b"2"})
    assert keys.registered and keys.lease_id is not None
    assert await _value(etcd_client, a) == b"1"
    assert etcd_client.kv is not None
    stored = await etcd_client.kv.get(a)
    assert stored.kvs[0].lease == keys.lease_id
    assert await keys.update(a, b"1b")
    assert await _value(etcd_client, a) == b"1b"
    await keys.delete(b)
    assert await _value(etcd_client, b) is None
    await keys.aclose()
    assert await _value(etcd_client, a) is None  # revoked: gone at once


async def test_leased_keys_vanish_within_ttl_when_renewal_stops(
    etcd_client: etcd3aio.Etcd3Client, etcd_prefix: str
) -> None:
    key = etcd_prefix + "endpoints/dead"
    keys = LeasedKeys(etcd_client, TEST_TTL_S)
    assert await keys.start({key: b"x"})
    await keys.aclose(revoke=False)  # the agent died

    async def gone() -> bool:
        return await _value(etcd_client, key) is None

    elapsed = await _until(gone, TEST_TTL_S + 2.0)
    assert elapsed <= TEST_TTL_S + 1.0


async def test_leased_keys_register_again_when_the_lease_is_lost(
    etcd_client: etcd3aio.Etcd3Client, etcd_prefix: str
) -> None:
    key = etcd_prefix + "endpoints/e"
    keys = LeasedKeys(etcd_client, TEST_TTL_S)
    assert await keys.start({key: b"v"})
    first = keys.lease_id
    assert first is not None and etcd_client.lease is not None
    await etcd_client.lease.revoke(first)  # as if it had expired during an outage
    assert await _value(etcd_client, key) is None

    async def back() -> bool:
        return await _value(etcd_client, key) == b"v"

    await _until(back, TEST_TTL_S + 2.0)
    assert keys.lease_id not in (None, first)
    assert keys.counters["lost"] == 1
    await keys.aclose()


async def test_leased_keys_survive_an_etcd_restart(etcd_outage_server: EtcdServer) -> None:
    server = etcd_outage_server
    client = await connect(EtcdSettings(endpoints=(server.address,), timeout_s=1.0))
    key = "/kvgate/endpoints/survivor"
    keys = LeasedKeys(client, TEST_TTL_S, timeout_s=1.0)
    try:
        assert await keys.start({key: b"v"})

        async def unregistered() -> bool:
            return not keys.registered

        async def registered() -> bool:
            return keys.registered and await _value(client, key) == b"v"

        server.stop()  # outage: same data comes back
        await _until(unregistered, 5.0)
        assert await keys.update(key, b"v") is False  # not reachable now: re-put later
        server.start()
        await _until(registered, 5.0)
        assert keys.counters["lost"] == 0

        server.stop()  # the cluster comes back empty: the lease is gone, the keys are put again
        await _until(unregistered, 5.0)
        server.wipe()
        server.start()
        await _until(registered, 5.0)
        assert keys.counters["lost"] == 1

        server.stop()  # an agent that starts while etcd is down registers once it is up
        late_key = "/kvgate/endpoints/late"
        late = LeasedKeys(client, TEST_TTL_S, timeout_s=1.0)
        try:
            assert not await late.start({late_key: b"l"})
            server.start()

            async def late_registered() -> bool:
                return late.registered and await _value(client, late_key) == b"l"

            await _until(late_registered, 5.0)
        finally:
            await late.aclose()
    finally:
        await keys.aclose()
        await client.close()


async def test_connect_with_mutual_tls(tmp_path: Path) -> None:
    import datetime as dt

    from certs.store import dev_bundle

    bundle = dev_bundle(tmp_path / "certs", ["engine-etcd", "agent"], dt.datetime.now(dt.UTC))
    server_files, agent = bundle["engine-etcd"], bundle["agent"]
    tls = ServerTls(server_files.ca, server_files.cert, server_files.key, agent.cert, agent.key)
    with EtcdServer(tmp_path / "etcd", tls=tls) as server:
        settings = EtcdSettings(
            endpoints=(server.address,),
            tls_ca=str(agent.ca),
            tls_cert=str(agent.cert),
            tls_key=str(agent.key),
            timeout_s=2.0,
        )
        client = await connect(settings)
        try:
            keys = LeasedKeys(client, TEST_TTL_S)
            assert await keys.start({"/kvgate/endpoints/tls": b"v"})
            assert await _value(client, "/kvgate/endpoints/tls") == b"v"
            await keys.aclose()
        finally:
            await client.close()
        no_cert = EtcdSettings(endpoints=(server.address,), tls_ca=str(agent.ca), timeout_s=1.0)
        anonymous = await connect(no_cert)
        try:
            with pytest.raises(ETCD_ERRORS):
                await _value(anonymous, "/kvgate/endpoints/tls")
        finally:
            await anonymous.close()


def _swap_in(cert: Path, key: Path, into: ClientTlsFiles) -> None:
    """Rotate ``into`` to another identity's pair: copies renamed into place, key first (as ``kvgate
    certs issue`` writes them)."""
    assert into.cert is not None and into.key is not None
    for source, target in ((key, into.key), (cert, into.cert)):
        shutil.copy(source, target.with_suffix(".new"))
        os.replace(target.with_suffix(".new"), target)


async def test_a_rotated_client_certificate_is_the_next_calls_etcd_user(
    secure_etcd: SecureEtcd, tmp_path: Path
) -> None:
    """etcd reads the user from the client certificate's CN. Rotated from ``agent-node-a`` to
    ``agent-node-b``, the same client's next puts are node-b's (node-a's prefix is refused), while the
    watch opened before the rotation keeps its stream (runtime.tls.RotatingChannel)."""
    p = secure_etcd.prefix
    original = secure_etcd.settings("agent-node-a")
    other = secure_etcd.settings("agent-node-b")
    assert original.tls_cert and original.tls_key and original.tls_ca and other.tls_cert and other.tls_key
    mine = copy_of(
        LeafFiles("agent-node-a", Path(original.tls_cert), Path(original.tls_key), Path(original.tls_ca)),
        tmp_path,
    )
    client = await connect(replace(original, tls_cert=str(mine.cert), tls_key=str(mine.key)))
    seen: list[bytes] = []

    async def follow(revision: int) -> None:
        assert client.watch is not None
        mine_prefix = f"{p}endpoints/node-a/"
        watch = client.watch.watch(
            mine_prefix, etcd3aio.prefix_range_end(mine_prefix), start_revision=revision
        )
        async for response in watch:
            seen.extend(bytes(event.kv.key) for event in response.events)

    task: asyncio.Task[None] | None = None
    try:
        assert client.kv is not None
        put = await client.kv.put(f"{p}endpoints/node-a/before", b"1", timeout=5.0)
        task = asyncio.create_task(follow(put.header.revision))
        await until(lambda: len(seen) == 1, 10.0)  # the watch is attached
        _swap_in(Path(other.tls_cert), Path(other.tls_key), mine)
        with pytest.raises(ETCD_ERRORS, match=r"(?i)permission denied"):
            await client.kv.put(f"{p}endpoints/node-a/after", b"2", timeout=5.0, max_attempts=1)
        await client.kv.put(f"{p}endpoints/node-b/after", b"2", timeout=5.0)
        assert await may_put(original, f"{p}endpoints/node-a/watched", b"3")  # node-a's own client
        await until(lambda: len(seen) == 2, 10.0)  # the stream opened before the rotation goes on
        assert seen == [f"{p}endpoints/node-a/before".encode(), f"{p}endpoints/node-a/watched".encode()]
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await client.close()
