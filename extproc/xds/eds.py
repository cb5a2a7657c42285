"""gRPC EDS (state of the world) for Envoy's engine cluster: every endpoint of the fleet, with its health.

Envoy's ``override_host`` load balancer tries the decision's ``ip:port`` list in order, but only hosts
its cluster knows: so ``kvgate_engines`` (:data:`~contracts.epp.ENGINES_CLUSTER`) must list every
endpoint the gateway may pick, and the ext_proc serves it. Pure part: :func:`hosts` (what Envoy should
know, the cheap comparison key), :func:`snapshot` / :func:`assignment` (the ``ClusterLoadAssignment`` and
its content-hash version) and :class:`SotwStream` (one subscription's ACK/NACK bookkeeping).
:class:`EndpointDiscovery` is the grpc.aio shell: ``StreamEndpoints`` for any number of Envoys, each
pushed the new assignment when it changes (:meth:`EndpointDiscovery.refresh`), and only after it
answered the previous one (the xDS flow control). Formulas in ``README.md``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeVar

import grpc
from envoy.config.core.v3 import address_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from google.protobuf import any_pb2

from contracts.config import ip_port
from contracts.epp import ENGINES_CLUSTER
from extproc.fleet import EndpointState, Fleet

log = logging.getLogger(__name__)

S = TypeVar("S", bound="SotwStream")

TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
HEALTHY: int = health_check_pb2.HEALTHY
UNHEALTHY: int = health_check_pb2.UNHEALTHY
DRAINING: int = health_check_pb2.DRAINING

SOCKET_MATCH_NS = "envoy.transport_socket_match"
PEER_MATCH_KEY = "kvgate-federation"
"""EDS host metadata that makes Envoy use the federation transport socket (kvgate/envoy/federation.py)."""
PEER_IDENTITY_KEY = "kvgate-federation-identity"
"""Host metadata (with :data:`PEER_MATCH_KEY`): the linked cluster's identity URI, which selects Envoy's
transport socket requiring exactly that SAN (``kvgate/envoy/federation.py``)."""
EMPTY: Mapping[str, str] = MappingProxyType({})

Host = tuple[str, int]
"""``(ip:port, health status)`` of one endpoint as Envoy should see it."""


def health(state: EndpointState, now: float) -> int:
    """``UNHEALTHY`` when scrapes or the agent say so or a failed try ejected it (at ``now``), else
    ``DRAINING`` when draining, else ``HEALTHY``. ``override_host`` ignores it; the cluster's fallback
    policy (fail-open) reads it."""
    if not state.healthy or state.ejected(now):
        return UNHEALTHY
    return DRAINING if state.draining else HEALTHY


def hosts(fleet: Fleet, now: float) -> tuple[Host, ...]:
    """Every endpoint's ``(address, health)``, sorted by address: equal tuples, equal assignments."""
    return tuple(sorted((s.address, health(s, now)) for s in fleet))


def socket_address(address: str) -> tuple[str, int] | None:
    """``(ip, port)`` of ``ip:port`` or ``[ipv6]:port``; ``None`` when the host is not an IP literal
    (EDS carries no names: Envoy would refuse the whole assignment)."""
    parsed = ip_port(address)
    return None if parsed is None else (str(parsed[0]), int(parsed[1]))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One assignment as served: ``version`` (hex content hash), the ``ClusterLoadAssignment`` packed
    once, and the fleet ``skipped`` addresses that are not ``ip:port``."""

    version: str
    resource: any_pb2.Any
    skipped: tuple[str, ...]


def assignment(fleet: Fleet, now: float) -> endpoint_pb2.ClusterLoadAssignment:
    """The ``ClusterLoadAssignment`` of ``kvgate_engines`` at ``now``: one locality, one host per
    endpoint in address order (endpoints whose host is not an IP literal are left out)."""
    return _assignment(hosts(fleet, now))[0]


def snapshot(entries: tuple[Host, ...], peers: Mapping[str, str] = EMPTY) -> Snapshot:
    """The assignment of ``entries`` (from :func:`hosts`, and ``peers``: linked clusters' ingresses, each
    with its cluster's identity URI, the exact SAN Envoy's socket for it requires when rendered) and
    its version: the first 16 hex digits of the SHA-256 of its deterministic serialization."""
    entries = tuple(sorted({*entries, *((p, HEALTHY) for p in peers)}))
    cla, skipped = _assignment(entries, peers)
    resource = any_pb2.Any()
    resource.Pack(cla)
    version = hashlib.sha256(cla.SerializeToString(deterministic=True)).hexdigest()[:16]
    return Snapshot(version, resource, skipped)


def _assignment(
    entries: tuple[Host, ...], peers: Mapping[str, str] = EMPTY
) -> tuple[endpoint_pb2.ClusterLoadAssignment, tuple[str, ...]]:
    lb_endpoints = []
    skipped = []
    for address, status in entries:
        socket = socket_address(address)
        if socket is None:
            skipped.append(address)
            continue
        ip, port = socket
        host = endpoint_components_pb2.LbEndpoint(
            endpoint=endpoint_components_pb2.Endpoint(
                address=address_pb2.Address(
                    socket_address=address_pb2.SocketAddress(address=ip, port_value=port)
                )
            ),
            health_status=status,
        )
        if address in peers:  # a linked cluster's ingress: Envoy's federation transport socket
            fields = host.metadata.filter_metadata[SOCKET_MATCH_NS].fields
            fields[PEER_MATCH_KEY].bool_value = True
            fields[PEER_IDENTITY_KEY].string_value = peers[address]
        lb_endpoints.append(host)
    cla = endpoint_pb2.ClusterLoadAssignment(
        cluster_name=ENGINES_CLUSTER,
        endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=lb_endpoints)],
    )
    return cla, tuple(skipped)


def next_change(fleet: Fleet, now: float) -> float | None:
    """The earliest ejection end after ``now`` (when :func:`hosts` changes by itself), or ``None``."""
    ends = [s.ejected_until for s in fleet if s.ejected_until > now]
    return min(ends) if ends else None


class SotwStream:
    """One Envoy's state-of-the-world EDS subscription, without IO.

    :meth:`request` takes each ``DiscoveryRequest``; :meth:`response` says what to send now. A response
    goes out only while a request awaits one (the first, or the ACK/NACK of the last response) and only
    when the version or the requested names differ from the last one sent, so a NACKed version is never
    sent again (the next change is). A request whose nonce is not the last one sent is stale and ignored.
    Names other than ``kvgate_engines`` get no resource; no names (a wildcard) get it.
    """

    #: The resource type this stream serves (CDS's subclass: :mod:`extproc.xds.cds`).
    type_url = TYPE_URL

    def __init__(self) -> None:
        self.names: tuple[str, ...] | None = None
        self.nonce = ""
        self.sent_version: str | None = None
        self.acked_version: str | None = None
        self._sent_names: tuple[str, ...] | None = None
        self._waiting = False
        self._responses = 0

    def request(self, req: discovery_pb2.DiscoveryRequest) -> str | None:
        """Take one request; the error detail when it NACKs the last response, else ``None``."""
        if req.type_url not in ("", self.type_url) or req.response_nonce != self.nonce:
            return None
        self.names = tuple(req.resource_names)
        self._waiting = True
        if req.HasField("error_detail"):
            return req.error_detail.message or f"code {req.error_detail.code}"
        if self.nonce:
            self.acked_version = req.version_info
        return None

    def due(self, version: str) -> bool:
        """Whether a response of ``version`` goes out now; if so, it is taken as sent (a new nonce)."""
        if not self._waiting or self.names is None:
            return False
        if version == self.sent_version and self.names == self._sent_names:
            return False
        self._responses += 1
        self.nonce = str(self._responses)
        self.sent_version, self._sent_names, self._waiting = version, self.names, False
        return True

    def response(self, snap: Snapshot) -> discovery_pb2.DiscoveryResponse | None:
        """The response to send for ``snap`` now, or ``None``."""
        if not self.due(snap.version):
            return None
        wanted = not self.names or ENGINES_CLUSTER in self.names
        return discovery_pb2.DiscoveryResponse(
            version_info=snap.version,
            resources=[snap.resource] if wanted else [],
            type_url=TYPE_URL,
            nonce=self.nonce,
        )


class EndpointDiscovery(eds_pb2_grpc.EndpointDiscoveryServiceServicer):  # type: ignore[misc]
    """``StreamEndpoints`` for every Envoy, kept current with the fleet.

    :meth:`start` watches the fleet (membership, health, drain, ejections: :meth:`Fleet.watch`); each
    change schedules one :meth:`refresh` on the event loop, which recomputes :func:`hosts` and, when they
    differ, the snapshot, and wakes every stream. An ejection's end is timed (``loop.call_later``).
    :meth:`aclose` ends every stream (Envoy reconnects to another replica) and refuses new ones with
    ``UNAVAILABLE``.
    """

    def __init__(self, fleet: Fleet, clock: Callable[[], float]) -> None:
        self._fleet = fleet
        self._clock = clock
        now = clock()
        #: The hosts served (``None``: recompute the snapshot at the next refresh, whatever the hosts).
        self._hosts: tuple[Host, ...] | None = hosts(fleet, now)
        #: Linked clusters' ingresses (``ip:port``), served as hosts too (:mod:`extproc.federation`).
        self._peers: Mapping[str, str] = EMPTY
        #: The assignment being served.
        self.snapshot = snapshot(self._hosts or ())
        self._wakes: set[asyncio.Event] = set()
        self._closed = False
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._unwatch: Callable[[], None] | None = None
        self._warn_skipped(self.snapshot.skipped)

    def start(self) -> None:
        """Follow the fleet's changes (call on the event loop that serves the streams)."""
        self._unwatch = self._fleet.watch(self._changed)
        self.refresh()

    async def aclose(self) -> None:
        """End every stream and refuse new ones."""
        self._closed = True
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        if self._timer is not None:
            self._timer.cancel()
        for wake in self._wakes:
            wake.set()

    def set_peers(self, peers: Mapping[str, str]) -> None:
        """Serve these linked clusters' ingresses (address -> the cluster's identity URI) as hosts as well
        (federation forwards pick them)."""
        if dict(peers) != dict(self._peers):
            self._peers = dict(peers)
            self._hosts = None  # force a new snapshot (an empty fleet's hosts are () too)
            self._changed()

    def refresh(self) -> None:
        """Recompute the hosts at the clock's now; on a change, a new snapshot and every stream woken."""
        self._scheduled = False
        if self._closed:
            return
        now = self._clock()
        entries = hosts(self._fleet, now)
        self._time_next(next_change(self._fleet, now), now)
        if entries == self._hosts:
            return
        self._hosts = entries
        previous = self.snapshot
        self.snapshot = snapshot(entries, self._peers)
        if self.snapshot.skipped != previous.skipped:
            self._warn_skipped(self.snapshot.skipped)
        log.debug("EDS %s: version %s, %d hosts", ENGINES_CLUSTER, self.snapshot.version, len(entries))
        for wake in self._wakes:
            wake.set()

    def _changed(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.refresh)

    def _time_next(self, at: float | None, now: float) -> None:
        if at is None or at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_later(max(0.0, at - now), self._expired)

    def _expired(self) -> None:
        self._timer = self._timer_at = None
        self.refresh()

    @staticmethod
    def _warn_skipped(skipped: tuple[str, ...]) -> None:
        if skipped:
            log.warning("EDS leaves out endpoints whose host is not an IP address: %s", ", ".join(skipped))

    async def StreamEndpoints(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        async for resp in serve(
            "EDS", request_iterator, context, SotwStream(), lambda s: s.response(self.snapshot), self._wakes,
            lambda: self._closed,
        ):  # fmt: skip
            yield resp


async def serve(
    kind: str,
    requests: AsyncIterator[discovery_pb2.DiscoveryRequest],
    context: grpc.aio.ServicerContext,
    stream: S,
    respond: Callable[[S], discovery_pb2.DiscoveryResponse | None],
    wakes: set[asyncio.Event],
    closed: Callable[[], bool],
) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
    """One state-of-the-world xDS stream (EDS here, CDS in :mod:`extproc.xds.cds`): ``respond(stream)`` is
    sent whenever it has something (the last request answered, a new version), woken by the requests
    read and by the service setting the event it adds to ``wakes``; it ends with the client's stream or
    when ``closed()`` (``UNAVAILABLE`` from the start)."""
    if closed():
        await context.abort(grpc.StatusCode.UNAVAILABLE, "ext_proc draining")
    wake = asyncio.Event()
    wakes.add(wake)
    reader = asyncio.create_task(_read(kind, requests, stream, wake, context.peer()))
    try:
        while not closed():
            wake.clear()
            resp = respond(stream)
            if resp is not None:
                yield resp
            if reader.done():
                reader.result()  # the stream's end, or its error
                return
            await wake.wait()
    finally:
        wakes.discard(wake)
        reader.cancel()


async def _read(
    kind: str,
    requests: AsyncIterator[discovery_pb2.DiscoveryRequest],
    stream: SotwStream,
    wake: asyncio.Event,
    peer: str,
) -> None:
    try:
        async for req in requests:
            if stream.names is None:
                log.info("%s stream from %s (node %s)", kind, peer, req.node.id or "?")
            nack = stream.request(req)
            if nack is not None:
                log.error("Envoy %s rejected %s version %s: %s", peer, kind, stream.sent_version, nack)
            wake.set()
    finally:
        wake.set()
