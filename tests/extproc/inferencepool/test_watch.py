"""extproc.inferencepool.watch against a stand-in API server (tests/extproc/inferencepool/apiserver.py:
real HTTP, the API's list and chunked watch wire format, the recorded objects of tests/data/k8s): the
Kubernetes API server is the one part of this path that cannot run here. The client is the real one
(kubernetes_asyncio, credentials from a kubeconfig)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from contracts.errors import ConfigError
from extproc.fleet import Fleet
from extproc.inferencepool.config import PoolSettings
from extproc.inferencepool.core import PoolView
from extproc.inferencepool.merge import PoolSync
from extproc.inferencepool.watch import PoolWatcher
from tests.extproc.inferencepool.apiserver import FakeApiServer
from tests.extproc.inferencepool.objects import NAMESPACE, pod, pool
from tests.polling import until

TIMEOUT_S = 10.0


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer(NAMESPACE)
    await server.start()
    try:
        yield server
    finally:
        await server.aclose()


def settings(server: FakeApiServer, tmp_path: Path, **over: object) -> PoolSettings:
    kubeconfig = str(server.kubeconfig(tmp_path / "kubeconfig"))
    fields: dict[str, object] = {
        "name": "kvgate-pool", "namespace": NAMESPACE, "kubeconfig": kubeconfig, "models": frozenset({"m"}),
        "max_backoff_s": 0.2, "timeout_s": 5.0,
    }  # fmt: skip
    fields.update(over)
    return PoolSettings(**fields)  # type: ignore[arg-type]


class Following:
    """A watcher feeding a PoolSync into a fleet, as the gateway's Cluster does."""

    def __init__(self, settings: PoolSettings) -> None:
        self.fleet = Fleet()
        self.sync = PoolSync(self.fleet)
        self.views: list[PoolView] = []
        self.watcher = PoolWatcher(settings, self._view, min_backoff_s=0.01)

    def _view(self, view: PoolView) -> None:
        self.views.append(view)
        self.sync.set_pool(view.endpoints)

    def ids(self) -> set[str]:
        return {s.id for s in self.fleet}

    def addresses(self) -> set[str]:
        return {s.address for s in self.fleet}


def watches(api: FakeApiServer, collection: str) -> list[dict[str, str]]:
    return [q for c, w, q in api.requests if c == collection and w]


def lists(api: FakeApiServer, collection: str) -> list[dict[str, str]]:
    return [q for c, w, q in api.requests if c == collection and not w]


async def test_the_fleet_follows_the_pool_through_list_watch_bookmarks_and_a_410(
    api: FakeApiServer, tmp_path: Path
) -> None:
    api.put("inferencepools", pool())
    api.put("pods", pod("a", "10.0.0.1"))
    api.put("pods", pod("b", "10.0.0.2", ready=False))
    api.put("pods", pod("stranger", "10.0.0.99", labels={"app": "other"}))
    f = Following(settings(api, tmp_path))
    await f.watcher.start()
    try:
        assert await f.watcher.wait_synced(TIMEOUT_S)
        assert f.ids() == {"a"} and f.addresses() == {"10.0.0.1:8000"}
        (pods_list,) = lists(api, "pods")
        assert pods_list["labelSelector"] == "app.kubernetes.io/name=kvgate-model-server"
        assert lists(api, "inferencepools")[0]["fieldSelector"] == "metadata.name=kvgate-pool"
        await until(lambda: api.watching("pods") == 1, TIMEOUT_S)
        first_watch = watches(api, "pods")[0]
        assert first_watch["allowWatchBookmarks"] in ("true", "True")
        assert first_watch["resourceVersion"] == str(api.rv)  # from the list's resourceVersion

        api.put("pods", pod("b", "10.0.0.2"))  # b becomes Ready
        await until(lambda: f.ids() == {"a", "b"}, TIMEOUT_S)
        api.put("pods", pod("a", "10.0.0.1", deleting=True))  # a is terminating
        await until(lambda: f.ids() == {"b"}, TIMEOUT_S)
        api.put(
            "pods", pod("b", "10.0.0.2", labels={"app.kubernetes.io/name": "moved"})
        )  # loses the selector
        await until(lambda: f.ids() == set(), TIMEOUT_S)
        api.put("pods", pod("c", "10.0.0.3"))
        await until(lambda: f.ids() == {"c"}, TIMEOUT_S)
        api.bookmark("pods")
        bookmark_rv = str(api.rv)
        await until(lambda: f.watcher.core.pods.resource_version == bookmark_rv, TIMEOUT_S)

        # The server ends the watch: watched again from the bookmark's version, no relist.
        api.end("pods")
        await until(lambda: len(watches(api, "pods")) == 2 and api.watching("pods") == 1, TIMEOUT_S)
        assert watches(api, "pods")[1]["resourceVersion"] == bookmark_rv
        assert len(lists(api, "pods")) == 1

        # Changes the watch never heard of, then 410 Gone: only a relist shows them.
        api.put("pods", pod("d", "10.0.0.4"), event=False)
        api.delete("pods", "c", event=False)
        api.gone("pods")
        await until(lambda: f.ids() == {"d"}, TIMEOUT_S)
        assert len(lists(api, "pods")) == 2 and f.watcher.counters["relists"] == 1
        await until(lambda: api.watching("pods") == 1, TIMEOUT_S)

        api.delete("pods", "d")
        await until(lambda: f.ids() == set(), TIMEOUT_S)
        api.put("pods", pod("e", "10.0.0.5"))
        await until(lambda: f.ids() == {"e"}, TIMEOUT_S)

        # The pool's ports change: each pod has one endpoint per port (the same pods: no relist).
        api.put("inferencepools", pool(ports=(8000, 8001)))
        await until(lambda: f.ids() == {"e:8000", "e:8001"}, TIMEOUT_S)
        assert f.addresses() == {"10.0.0.5:8000", "10.0.0.5:8001"}
        assert len(lists(api, "pods")) == 2
        # The pool's selector changes: the pods are listed again with it, and only its pods serve.
        api.put("pods", pod("g", "10.0.0.7", labels={"app.kubernetes.io/name": "kvgate-green"}))
        green = pool()
        green["spec"]["selector"]["matchLabels"] = {"app.kubernetes.io/name": "kvgate-green"}
        api.put("inferencepools", green)
        await until(lambda: f.ids() == {"g"}, TIMEOUT_S)
        assert lists(api, "pods")[-1]["labelSelector"] == "app.kubernetes.io/name=kvgate-green"
        assert all(len(v.endpoints) > 0 for v in f.views[-2:])  # no empty fleet on the way
        # The pool is deleted: no pool, no endpoints.
        api.delete("inferencepools", "kvgate-pool")
        await until(lambda: f.ids() == set(), TIMEOUT_S)
        assert f.watcher.counters["reconnects"] == 0, f.watcher.last_error
    finally:
        await f.watcher.aclose()


async def test_errors_are_retried_with_backoff_and_a_watch_error_event_resumes(
    api: FakeApiServer, tmp_path: Path
) -> None:
    api.put("inferencepools", pool())
    api.put("pods", pod("a", "10.0.0.1"))
    api.fail_next_list("pods", 500)
    api.fail_next_list("pods", 503)
    f = Following(settings(api, tmp_path))
    await f.watcher.start()
    try:
        assert await f.watcher.wait_synced(TIMEOUT_S)
        assert f.ids() == {"a"} and f.watcher.counters["reconnects"] == 2
        assert "HTTP 503" in f.watcher.last_error
        await until(lambda: api.watching("pods") == 1, TIMEOUT_S)
        # A 500 Status in the stream: the same version is watched again after a back-off, no relist.
        rv = f.watcher.core.pods.resource_version
        coll = api.collections["pods"]
        api._broadcast(coll, {"type": "ERROR", "object": {"kind": "Status", "code": 500, "message": "boom"}})
        api.end("pods")
        await until(lambda: len(watches(api, "pods")) == 2, TIMEOUT_S)
        assert watches(api, "pods")[1]["resourceVersion"] == rv
        assert len(lists(api, "pods")) == 3  # the two refused and the one answered
        api.put("pods", pod("b", "10.0.0.2"))
        await until(lambda: f.ids() == {"a", "b"}, TIMEOUT_S)
        # Watches that end at once, empty: retried after a back-off (0.01 s doubling to 0.2 s), not spun.
        api.collections["pods"].end_at_once = True
        before = len(watches(api, "pods"))
        api.end("pods")
        await asyncio.sleep(1.0)  # a span to count requests in, not a readiness wait
        assert 3 <= len(watches(api, "pods")) - before <= 15
    finally:
        await f.watcher.aclose()


async def test_wrong_credentials_are_not_synced_and_say_why(api: FakeApiServer, tmp_path: Path) -> None:
    api.put("inferencepools", pool())
    bad = api.kubeconfig(tmp_path / "bad-kubeconfig")
    bad.write_text(bad.read_text().replace("kvgate-test-token", "stolen"))
    f = Following(settings(api, tmp_path, kubeconfig=str(bad)))
    await f.watcher.start()
    try:
        assert not await f.watcher.wait_synced(0.5)
        assert "HTTP 401" in f.watcher.last_error and f.ids() == set()
    finally:
        await f.watcher.aclose()
    missing = PoolWatcher(settings(api, tmp_path, kubeconfig=str(tmp_path / "nope")), lambda _v: None)
    with pytest.raises(ConfigError, match="no Kubernetes credentials"):
        await missing.start()


async def test_a_pool_that_does_not_parse_at_start_is_logged_as_refused_not_as_missing(
    api: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The pool is there but unusable (no target ports): the log says why it was refused, never that the
    pool is not found; once fixed, its pods join."""
    bad = pool()
    bad["spec"]["targetPorts"] = []
    api.put("inferencepools", bad)
    api.put("pods", pod("a", "10.0.0.1"))
    f = Following(settings(api, tmp_path))
    with caplog.at_level("WARNING", logger="extproc.inferencepool.watch"):
        await f.watcher.start()
        try:
            assert await f.watcher.wait_synced(TIMEOUT_S)
            assert f.ids() == set()
            messages = [r.getMessage() for r in caplog.records]
            assert any("refused" in m and "targetPorts" in m for m in messages), messages
            assert not any("not found" in m for m in messages), messages
            api.put("inferencepools", pool(rv=2))
            await until(lambda: f.ids() == {"a"}, TIMEOUT_S)
        finally:
            await f.watcher.aclose()
