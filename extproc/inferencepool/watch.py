"""The IO of :mod:`extproc.inferencepool`: list + watch the InferencePool and its pods through the
Kubernetes API (``kubernetes_asyncio``: kubeconfig or in-cluster credentials, token refresh, TLS), feeding
:class:`~extproc.inferencepool.core.PoolCore`.

Each collection (the pool object, by ``fieldSelector=metadata.name=<pool>``; its pods, by the pool's
``labelSelector``) is listed, then watched from the list's ``resourceVersion`` with bookmarks; each event
moves the version on. A ``410 Gone`` (an ``ERROR`` event's Status or the response's status) means the
version is too old: list again at once. Anything else that breaks a watch (a refused connection, a 5xx,
a stream cut, a line that is not the protocol) is retried after an exponential back-off with jitter, from
the last version (the credentials' own errors too: a failed token refresh retries, never ends the watch).
A stream the server ends normally (its ``timeoutSeconds``) is watched again at once, unless it ended
within :data:`QUICK_END_S` with no event (then after a back-off, so nothing spins).
A change of the pool's selector restarts the pod watch with a fresh list (the pods already known stay
until it replaces them, filtered by the new selector); a change of its ports or defaults only re-derives
the endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config

from contracts.errors import ConfigError
from extproc.inferencepool.config import PoolSettings
from extproc.inferencepool.core import (
    GONE,
    GROUP,
    PLURAL,
    VERSION,
    Collection,
    Obj,
    Outcome,
    PoolCore,
    PoolView,
    ProtocolError,
    decode_line,
    status_code,
)

log = logging.getLogger(__name__)

NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
QUICK_END_S = 1.0
"""A watch the server ends this soon with no event in it is retried after a back-off, not at once."""
WATCH_TIMEOUT_S = 300
"""The ``timeoutSeconds`` of each watch: the server ends it then and the client watches again."""


class HttpError(Exception):
    """The API server answered a list or watch with an error status."""

    def __init__(self, status: int, what: str) -> None:
        super().__init__(f"{what}: HTTP {status}")
        self.status = status


Request = Callable[..., Awaitable[Any]]


class PoolWatcher:
    """Keeps :attr:`core` in step with the API server and calls ``on_change(view)`` (on the event loop,
    must not block) with the pool's endpoints after each change, and once after the first full read.

    ``configuration``: an API client configuration to use as is (else one is loaded from
    ``settings.kubeconfig``, or the in-cluster service account). ``min_backoff_s`` .. ``max_backoff_s``
    (the settings'): the wait before a reconnection, doubling, with jitter.
    """

    def __init__(
        self,
        settings: PoolSettings,
        on_change: Callable[[PoolView], None],
        *,
        configuration: client.Configuration | None = None,
        min_backoff_s: float = 0.2,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
    ) -> None:
        self.settings = settings
        self.core = PoolCore(settings)
        self.namespace = settings.namespace or "default"
        self._on_change = on_change
        self._configuration = configuration
        self._min_backoff_s = min(min_backoff_s, settings.max_backoff_s)
        self._watch_timeout_s = watch_timeout_s
        self._api: client.ApiClient | None = None
        self._pool_task: asyncio.Task[None] | None = None
        self._pods_task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        self._refused: dict[str, str] = {}
        self._selector: str | None = None  # the label selector the pods are followed by
        self.counters = dict.fromkeys(("lists", "relists", "events", "reconnects", "changes"), 0)
        #: Why the last list or watch failed (empty: never).
        self.last_error = ""

    async def start(self) -> None:
        """Load the credentials and start following the pool in the background (an API server that is
        down is retried; the fleet keeps what it has meanwhile). Failures to load credentials raise
        :class:`ConfigError` here."""
        if self._pool_task is not None:
            raise RuntimeError("PoolWatcher already started")
        configuration = self._configuration
        if configuration is None:
            configuration = client.Configuration()
            try:
                if self.settings.kubeconfig is not None:
                    await config.load_kube_config(
                        config_file=self.settings.kubeconfig,
                        context=self.settings.context,
                        client_configuration=configuration,
                    )
                else:
                    own = _load_incluster(configuration)
                    if self.settings.namespace is None and own:
                        self.namespace = own
            except (config.ConfigException, OSError) as exc:
                where = self.settings.kubeconfig or "the in-cluster service account"
                raise ConfigError(f"inference_pool: no Kubernetes credentials from {where}: {exc}") from exc
        self._api = client.ApiClient(configuration)
        self._pool_task = asyncio.create_task(self._follow_pool(), name="inference-pool")

    async def wait_synced(self, timeout_s: float) -> bool:
        """Wait until the pool and its pods have been listed once; ``False`` after ``timeout_s``."""
        try:
            await asyncio.wait_for(self._synced.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    async def aclose(self) -> None:
        for name in ("_pool_task", "_pods_task"):  # the pool's first: it may start a pods task
            task: asyncio.Task[None] | None = getattr(self, name)
            setattr(self, name, None)
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        api, self._api = self._api, None
        if api is not None:
            await api.close()

    # --- the two collections ---------------------------------------------------------------------------

    def _pool_request(self, **params: Any) -> Awaitable[Any]:
        assert self._api is not None
        api = client.CustomObjectsApi(self._api)
        field_selector = f"metadata.name={self.settings.name}"
        return api.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, field_selector=field_selector, **params
        )

    def _pods_request(self, selector: str) -> Request:
        def request(**params: Any) -> Awaitable[Any]:
            assert self._api is not None
            api = client.CoreV1Api(self._api)
            return api.list_namespaced_pod(self.namespace, label_selector=selector, **params)

        return request

    async def _follow_pool(self) -> None:
        await self._follow(self.core.pool, self._pool_request, self._pool_changed)

    def _pool_changed(self, listed: bool) -> None:
        selector = self._selector
        spec_changed = self.core.pool_changed()
        if self.core.refused_pool:
            kept = "keeping the last good one" if self.core.spec is not None else "none usable yet"
            log.warning("InferencePool refused, %s: %s", kept, self.core.refused_pool)
        if spec_changed:
            spec = self.core.spec
            self._selector = None if spec is None else spec.label_selector
            if spec is None:
                self._restart_pods()  # stops following pods
                self._emit()
            elif self._selector != selector:
                self._restart_pods()  # new pods: the fleet changes when their list is in
            else:
                self._emit()  # ports or defaults: the same pods
        elif listed and self.core.spec is None:
            self._emit()  # no pool (yet): an empty fleet part, and synced
        if self.core.spec is None:
            if (listed or spec_changed) and not self.core.refused_pool:
                log.warning("InferencePool %s/%s not found", self.namespace, self.settings.name)
            self._synced.set()

    def _restart_pods(self) -> None:
        if self._pods_task is not None:
            self._pods_task.cancel()
            self._pods_task = None
        self.core.pods.resource_version = None  # the old pods stay until the new list replaces them
        if self.core.spec is None:
            self.core.pods.objects.clear()
        spec = self.core.spec
        if spec is not None:
            selector, ports = spec.label_selector, spec.target_ports
            log.info("pool %s: following pods %s, ports %s", spec.name, selector, ports)
            request = self._pods_request(spec.label_selector)
            self._pods_task = asyncio.create_task(
                self._follow(self.core.pods, request, self._pods_changed), name="inference-pool-pods"
            )

    def _pods_changed(self, listed: bool) -> None:
        self._emit()
        if listed:
            self._synced.set()

    def _emit(self) -> None:
        view = self.core.view()
        for pod, reason in view.refused.items():
            if self._refused.get(pod) != reason:
                log.warning("pool pod %s left out: %s", pod, reason)
        self._refused = dict(view.refused)
        self.counters["changes"] += 1
        self._on_change(view)

    # --- list + watch ----------------------------------------------------------------------------------

    async def _follow(self, coll: Collection, request: Request, changed: Callable[[bool], None]) -> None:
        """List + watch ``coll`` for ever (until cancelled), calling ``changed(listed)`` after a list
        (``listed=True``, always) and after each event that changed an object (``False``)."""
        backoff = self._min_backoff_s
        while True:
            try:
                if coll.resource_version is None:
                    body = await self._list(coll, request)
                    coll.listed(body)
                    self.counters["lists"] += 1
                    changed(True)
                    backoff = self._min_backoff_s
                events, started = self.counters["events"], time.monotonic()
                outcome = await self._watch(coll, request, changed)
                if outcome is Outcome.RELIST:
                    self.counters["relists"] += 1
                    log.info("%s watch: %s, listing again", coll.kind, coll.last_error or "410 Gone")
                    continue
                if outcome is Outcome.ERROR:
                    raise ProtocolError(f"watch ERROR event {coll.last_error}")
                if self.counters["events"] == events and time.monotonic() - started < QUICK_END_S:
                    # ended at once with nothing in it (a proxy closing streams?): no spinning
                    await asyncio.sleep(backoff * (0.5 + random.random() / 2))
                    backoff = min(backoff * 2, self.settings.max_backoff_s)
                else:
                    backoff = self._min_backoff_s  # the server ended the watch: watch again at once
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # whatever it was (a token refresh too), the watch goes on
                self.counters["reconnects"] += 1
                self.last_error = f"{coll.kind}: {exc}"
                log.warning("kubernetes %s: %s; retrying in %.1f s", coll.kind, exc, backoff)
                await asyncio.sleep(backoff * (0.5 + random.random() / 2))
                backoff = min(backoff * 2, self.settings.max_backoff_s)

    async def _list(self, coll: Collection, request: Request) -> object:
        resp: aiohttp.ClientResponse = await request(
            _preload_content=False, _request_timeout=self.settings.timeout_s
        )
        async with resp:
            body = await resp.read()
            if resp.status == GONE:
                coll.resource_version = None
            if resp.status != 200:
                raise HttpError(resp.status, f"list {coll.kind}")
        return json.loads(body)

    async def _watch(self, coll: Collection, request: Request, changed: Callable[[bool], None]) -> Outcome:
        """One watch from ``coll.resource_version``, until the stream ends; RELIST after a 410 Gone."""
        timeout = aiohttp.ClientTimeout(
            connect=self.settings.timeout_s,
            sock_connect=self.settings.timeout_s,
            sock_read=self._watch_timeout_s + self.settings.timeout_s,
        )
        resp: aiohttp.ClientResponse = await request(
            watch=True,
            resource_version=coll.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=self._watch_timeout_s,
            _preload_content=False,
            _request_timeout=timeout,
        )
        async with resp:
            if resp.status != 200:
                body = await resp.read()
                code = _status_of(body)
                if resp.status == GONE or code == GONE:
                    coll.resource_version = None
                    coll.last_error = "410 Gone"
                    return Outcome.RELIST
                raise HttpError(resp.status, f"watch {coll.kind}")
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                while (end := buffer.find(b"\n")) >= 0:
                    line, buffer = buffer[:end], buffer[end + 1 :]
                    if not line.strip():
                        continue
                    outcome = coll.event(decode_line(line))
                    self.counters["events"] += 1
                    if outcome is Outcome.CHANGED:
                        changed(False)
                    elif outcome in (Outcome.RELIST, Outcome.ERROR):
                        return outcome
            if buffer.strip():
                raise ProtocolError("watch stream cut inside an event")
        return Outcome.UNCHANGED


def _load_incluster(configuration: client.Configuration) -> str:
    """Load the pod's service account credentials into ``configuration``; returns the pod's namespace
    (empty: unknown)."""
    config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    try:
        return NAMESPACE_FILE.read_text().strip()
    except OSError:
        return ""


def _status_of(body: bytes) -> int | None:
    try:
        doc: Obj = json.loads(body)
    except ValueError:
        return None
    return status_code(doc) if isinstance(doc, dict) else None
