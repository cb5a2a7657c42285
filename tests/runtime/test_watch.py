"""runtime.watch: the retry rule on tables, then PrefixWatcher against a real etcd (snapshot, changes, a
delete, a failing callback, no etcd at start, an outage and the resync after it)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import etcd3aio
import pytest

from contracts.etcd import Change, EtcdSettings
from kvgate.dev.etcd import EtcdServer
from runtime.etcd import connect
from runtime.watch import PrefixWatcher, Retry
from tests.polling import until

pytest_plugins = ("tests.etcd_fixtures",)


def _kv(client: etcd3aio.Etcd3Client) -> etcd3aio.kv.KVService:
    assert client.kv is not None
    return client.kv


# -- the retry rule -------------------------------------------------------------------------------------


def test_failures_back_off_doubling_up_to_the_cap_and_start_over_after_a_sync() -> None:
    retry = Retry(0.5)
    assert [retry.failed() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    retry.synced()
    assert retry.failed() == 0.1


@pytest.mark.parametrize(
    ("lasted_s", "waits"),
    [
        ([30.0, 30.0, 30.0], [0.0, 0.0, 0.0]),  # compactions now and then: resync at once
        ([0.01, 0.01, 0.01, 0.01, 0.01], [0.0, 0.4, 0.8, 1.6, 2.0]),  # refused again and again: slow down
        ([0.01, 0.01, 0.01, 5.0, 0.01, 0.01], [0.0, 0.4, 0.8, 0.0, 0.0, 0.4]),  # a watch that held: reset
    ],
)
def test_a_watch_cancelled_right_after_it_starts_never_spins(
    lasted_s: list[float], waits: list[float]
) -> None:
    retry = Retry(2.0)
    assert [pytest.approx(retry.watch_ended(s)) for s in lasted_s] == waits


# -- the shell, against a real etcd ---------------------------------------------------------------------


@dataclass
class Mirror:
    """A core that mirrors the keys it is told about; each call returns the keys it changed."""

    state: dict[str, bytes] = field(default_factory=dict)
    revision: int = 0

    def snapshot(
        self, kvs: Iterable[tuple[str, bytes]], revision: int, created: Mapping[str, int] | None = None
    ) -> frozenset[str]:
        new = dict(kvs)
        changed = frozenset(k for k in self.state.keys() | new.keys() if self.state.get(k) != new.get(k))
        self.state, self.revision = new, revision
        return changed

    def apply(self, changes: Iterable[Change], revision: int) -> frozenset[str]:
        keys = set()
        for change in changes:
            keys.add(change.key)
            if change.value is None:
                self.state.pop(change.key, None)
            else:
                self.state[change.key] = change.value
        self.revision = revision
        return frozenset(keys)


async def test_snapshot_then_changes_and_a_delete(
    etcd_client: etcd3aio.Etcd3Client, etcd_prefix: str
) -> None:
    kv, watched = _kv(etcd_client), f"{etcd_prefix}w/"
    await kv.put(f"{watched}a", b"1")
    await kv.put(f"{watched}b", b"2")
    await kv.put(f"{etcd_prefix}wx", b"beside the prefix")
    core, applied = Mirror(), list[frozenset[str]]()
    watcher = PrefixWatcher(etcd_client, watched, core, timeout_s=2.0, on_applied=applied.append, name="t")
    assert not watcher.synced and watcher.counters["connected"] == 0
    watcher.start()
    try:
        assert await watcher.wait_synced(5.0)
        assert core.state == {f"{watched}a": b"1", f"{watched}b": b"2"}
        assert applied == [frozenset({f"{watched}a", f"{watched}b"})]
        assert watcher.connected and watcher.synced and watcher.revision == core.revision > 0
        assert watcher.counters == {"syncs": 1, "outages": 0, "compactions": 0, "connected": 1}

        await kv.put(f"{watched}c", b"3")
        await kv.put(f"{watched}b", b"22")
        await kv.put(f"{etcd_prefix}wx", b"still beside")
        last = (await kv.delete(f"{watched}a")).header.revision
        await until(lambda: watcher.revision == last, 2.0)
        assert core.state == {f"{watched}b": b"22", f"{watched}c": b"3"}
        assert set().union(*applied[1:]) == {f"{watched}a", f"{watched}b", f"{watched}c"}
        assert watcher.counters["syncs"] == 1  # changes came by the watch, not by a resync
    finally:
        await watcher.aclose()
    assert not watcher.connected


async def test_a_failing_callback_does_not_stop_the_watcher(
    etcd_client: etcd3aio.Etcd3Client, etcd_prefix: str
) -> None:
    calls: list[frozenset[str]] = []

    def broken(keys: frozenset[str]) -> None:
        calls.append(keys)
        raise ValueError("callback bug")

    core = Mirror()
    watcher = PrefixWatcher(etcd_client, etcd_prefix, core, timeout_s=2.0, on_applied=broken)
    watcher.start()
    try:
        assert await watcher.wait_synced(5.0)
        await _kv(etcd_client).put(f"{etcd_prefix}k", b"v")
        await until(lambda: core.state == {f"{etcd_prefix}k": b"v"} and len(calls) == 2, 2.0)
        assert watcher.connected and watcher.counters["syncs"] == 1
    finally:
        await watcher.aclose()


async def test_starts_without_etcd() -> None:
    client = await connect(EtcdSettings(endpoints=("127.0.0.1:1",), timeout_s=0.2))
    core = Mirror()
    watcher = PrefixWatcher(client, "/kvgate/", core, timeout_s=0.2, max_backoff_s=0.2)
    watcher.start()
    try:
        assert not await watcher.wait_synced(0.3)
        # Never connected, so nothing was lost: no outage counted.
        assert watcher.counters == {"syncs": 0, "outages": 0, "compactions": 0, "connected": 0}
        with pytest.raises(RuntimeError, match="already started"):
            watcher.start()
    finally:
        await watcher.aclose()
        await client.close()


async def test_an_outage_keeps_the_state_and_a_resync_follows(etcd_outage_server: EtcdServer) -> None:
    server, prefix = etcd_outage_server, "/kvgate/"
    client = await connect(EtcdSettings(endpoints=(server.address,), timeout_s=0.5))
    kv = _kv(client)
    await kv.put(f"{prefix}a", b"1")
    await kv.put(f"{prefix}b", b"2")
    await kv.put(f"{prefix}b", b"3")
    core = Mirror()
    watcher = PrefixWatcher(client, prefix, core, timeout_s=0.5, probe_interval_s=0.1, max_backoff_s=0.3)
    watcher.start()
    try:
        assert await watcher.wait_synced(5.0)
        before, old_revision = dict(core.state), watcher.revision

        server.stop()
        await until(lambda: not watcher.connected, 3.0)  # the probe noticed: the watch alone would not
        assert core.state == before and watcher.counters["outages"] == 1

        server.wipe()  # etcd comes back rebuilt: no keys, and its revisions start over
        server.start()
        took = await until(lambda: watcher.connected and core.state == {}, 10.0)
        assert watcher.counters["syncs"] >= 2 and watcher.revision < old_revision
        # The watch follows from the resync's revision, not from the old (now future) one.
        last = (await kv.put(f"{prefix}c", b"4")).header.revision
        await until(lambda: watcher.revision == last, 2.0)
        assert core.state == {f"{prefix}c": b"4"} and watcher.counters["outages"] == 1
        print(f"resynced {took:.2f} s after etcd came back")
    finally:
        await watcher.aclose()
        await client.close()
