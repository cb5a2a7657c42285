"""A stand-in for the Kubernetes API server (the one part of the InferencePool path that cannot run
here): real HTTP on 127.0.0.1, answering the two requests the picker makes -- a list, then a watch -- of
pods and of InferencePools, in the API's wire format. A list is a ``PodList``/``InferencePoolList`` with
``metadata.resourceVersion``; a watch is a chunked ``200`` whose body is one JSON event per line,
``{"type": "ADDED"|"MODIFIED"|"DELETED"|"BOOKMARK"|"ERROR", "object": ...}``, with a ``Status`` object
(``code: 410``, reason ``Expired``) in an ``ERROR`` event when the resourceVersion is too old.

The objects served are the recorded ones of tests/data/k8s (:mod:`tests.extproc.inferencepool.objects`);
the test changes the objects (:meth:`FakeApiServer.put`, :meth:`delete`: an event to each open watch,
and to a watch started later from an older resourceVersion) and ends watches (:meth:`gone`, :meth:`end`).
It may change the state without an event (what a watch that fell behind misses), which only a relist
then shows.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

TOKEN = "kvgate-test-token"
_TRUE = ("1", "t", "T", "true", "True", "TRUE")  # Go's strconv.ParseBool, as the API server reads flags
POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools"
PODS = "/api/v1/namespaces/{ns}/pods"


@dataclass
class _Collection:
    kind: str
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    streams: list[asyncio.Queue[bytes | None]] = field(default_factory=list)
    fail_lists: list[int] = field(default_factory=list)  # statuses the next lists answer
    history: list[tuple[int, bytes]] = field(default_factory=list)  # (resourceVersion, event line)
    end_at_once: bool = False  # watches end as soon as they start, empty (a misbehaving proxy)


class FakeApiServer:
    """Serves ``pods`` and ``inferencepools`` of ``namespace``; :attr:`requests` logs each request's
    collection, whether it watched, and its query."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.rv = 100
        self.collections = {"pods": _Collection("Pod"), "inferencepools": _Collection("InferencePool")}
        self.requests: list[tuple[str, bool, dict[str, str]]] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(PODS.format(ns=self.namespace), self._pods)
        app.router.add_get(POOLS.format(ns=self.namespace), self._pools)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def aclose(self) -> None:
        for coll in self.collections.values():
            for queue in coll.streams:
                queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig naming this server and a bearer token (what ``[inference_pool] kubeconfig`` reads)."""
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "picker", "user": {"token": TOKEN}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "picker"}}],
            "current-context": "test",
        }
        path.write_text(yaml.safe_dump(doc))
        return path

    # --- what the test does -----------------------------------------------------------------------------

    def put(self, collection: str, obj: dict[str, Any], *, event: bool = True) -> None:
        """Create or replace ``obj``; ``event``: the open watches hear ADDED/MODIFIED."""
        coll = self.collections[collection]
        obj = self._stamp(obj)
        kind = "MODIFIED" if obj["metadata"]["name"] in coll.objects else "ADDED"
        coll.objects[obj["metadata"]["name"]] = obj
        if event:
            self._broadcast(coll, {"type": kind, "object": obj}, logged=True)

    def delete(self, collection: str, name: str, *, event: bool = True) -> None:
        coll = self.collections[collection]
        obj = self._stamp(coll.objects.pop(name))
        if event:
            self._broadcast(coll, {"type": "DELETED", "object": obj}, logged=True)

    def bookmark(self, collection: str) -> None:
        coll = self.collections[collection]
        self.rv += 1
        obj = {"kind": coll.kind, "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)}}
        self._broadcast(coll, {"type": "BOOKMARK", "object": obj})

    def gone(self, collection: str) -> None:
        """The watches' resourceVersion is too old: an ERROR event with a 410 Status, then the stream ends."""
        coll = self.collections[collection]
        status = {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "too old resource version: 100 (4242)", "reason": "Expired", "code": 410,
        }  # fmt: skip
        self._broadcast(coll, {"type": "ERROR", "object": status})
        self.end(collection)

    def end(self, collection: str) -> None:
        """The server ends the open watches (their timeoutSeconds)."""
        coll = self.collections[collection]
        for queue in coll.streams:
            queue.put_nowait(None)

    def fail_next_list(self, collection: str, status: int) -> None:
        self.collections[collection].fail_lists.append(status)

    def watching(self, collection: str) -> int:
        return len(self.collections[collection].streams)

    # --- HTTP --------------------------------------------------------------------------------------------

    def _stamp(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.rv += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
        return obj

    def _broadcast(self, coll: _Collection, event: dict[str, Any], *, logged: bool = False) -> None:
        line = json.dumps(event).encode() + b"\n"
        if logged:  # a watch that starts from an older resourceVersion gets it first
            coll.history.append((self.rv, line))
        for queue in coll.streams:
            queue.put_nowait(line)

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "pods")

    async def _pools(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "inferencepools")

    async def _serve(self, request: web.Request, collection: str) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"kind": "Status", "code": 401, "reason": "Unauthorized"}, status=401)
        coll = self.collections[collection]
        query = dict(request.query)
        watch = query.get("watch", "false") in _TRUE
        self.requests.append((collection, watch, query))
        selected = [o for o in coll.objects.values() if _selected(o, query)]
        if not watch:
            if coll.fail_lists:
                status = coll.fail_lists.pop(0)
                return web.json_response({"kind": "Status", "code": status}, status=status)
            body = {
                "kind": f"{coll.kind}List",
                "apiVersion": "v1" if collection == "pods" else "inference.networking.k8s.io/v1",
                "metadata": {"resourceVersion": str(self.rv)},
                "items": selected,
            }
            return web.json_response(body)
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if coll.end_at_once:
            await response.write_eof()
            return response
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        since = int(query.get("resourceVersion") or 0)
        for rv, line in coll.history:
            if rv > since:
                queue.put_nowait(line)
        coll.streams.append(queue)
        try:
            while (line := await queue.get()) is not None:
                line = _as_selected(line, query)
                if line is None:
                    continue
                half = len(line) // 2  # one event in two chunks: the client must join them
                await response.write(line[:half])
                await response.write(line[half:])
        finally:
            coll.streams.remove(queue)
        await response.write_eof()
        return response


def _selected(obj: dict[str, Any], query: dict[str, str]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in filter(None, query.get("labelSelector", "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    field_selector = query.get("fieldSelector", "")
    if field_selector.startswith("metadata.name="):
        return obj.get("metadata", {}).get("name") == field_selector.removeprefix("metadata.name=")
    return True


def _as_selected(line: bytes, query: dict[str, str]) -> bytes | None:
    """The event as a watch with ``query``'s selectors sees it: an object that no longer matches is
    DELETED for it (as the API server's watch cache sends it), one that never did is not sent."""
    event = json.loads(line)
    if event["type"] in ("BOOKMARK", "ERROR", "DELETED") or _selected(event["object"], query):
        return line
    if event["type"] == "MODIFIED":
        return json.dumps({"type": "DELETED", "object": event["object"]}).encode() + b"\n"
    return None
