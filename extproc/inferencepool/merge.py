"""Sans-IO: the merge rule of the pool's endpoints with the registered ones (the gateway config's and the
agents' etcd records), and :class:`PoolSync`, which keeps a :class:`~extproc.fleet.Fleet` equal to it.

The rule: every registered endpoint stays as registered; a pool endpoint joins unless a registered one
has its address (the same engine: the agent's record, richer -- its feed, KV events, block size, role --
wins) or its id. And, unless ``agents_outside_pool``, an agent's etcd record is admitted to the fleet only
at the address of a ready pod of the pool (:meth:`PoolSync.admits`): on Kubernetes the pool says which
engines serve, the agent says what they hold. With ``agent_node_is_pod``, a record at a pod's address is
admitted only if its node (the agent's etcd identity confines it to ``endpoints/<node>/``) is that pod's
name: an agent cannot claim another pod's engine (deploy/README.md, "Agent identities").
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Iterable, Mapping

from contracts.config import ip_port
from contracts.events import EndpointId
from engines.endpoint import Endpoint
from extproc.fleet import Fleet

log = logging.getLogger(__name__)

MAX_REFUSED_CLAIMS = 1024
"""Refused claims remembered (each logged once); past it the memory starts again (an agent writing ever
new ids at another pod's address costs logs, never memory)."""


def socket_key(address: str) -> str:
    """The socket ``address`` reaches, as one text (``ip:port``; an IPv6 address compressed, lower case,
    an IPv4-mapped one as its IPv4 address); ``address`` itself when its host is no IP literal. EDS gives
    Envoy the socket, not the text: two spellings of one address are one engine."""
    parsed = ip_port(address)
    if parsed is None:
        return address
    ip, port = parsed
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def merge(pool: Mapping[EndpointId, Endpoint], registered: Iterable[Endpoint]) -> dict[EndpointId, Endpoint]:
    """The fleet of ``registered`` endpoints and ``pool`` endpoints under the rule above."""
    out = {e.id: e for e in registered}
    addresses = {e.address for e in out.values()}
    for endpoint_id, endpoint in pool.items():
        if endpoint_id in out or endpoint.address in addresses:
            continue
        out[endpoint_id] = endpoint
        addresses.add(endpoint.address)
    return out


class PoolSync:
    """Puts the pool's endpoints (:meth:`set_pool`) into ``fleet`` beside what other sources registered,
    under :func:`merge`; :meth:`reconcile` again after those sources changed the fleet (an agent that
    registers a pod's address takes it over; when it leaves, the pool's endpoint comes back).

    It owns the fleet entries it put there and still hold what it put; an entry another source replaced
    is no longer its own (:meth:`owns` says which, so the etcd control plane may displace them).
    """

    def __init__(
        self, fleet: Fleet, *, agents_outside_pool: bool = False, agent_node_is_pod: bool = False
    ) -> None:
        self.fleet = fleet
        self.agents_outside_pool = agents_outside_pool
        self.agent_node_is_pod = agent_node_is_pod
        #: (endpoint id, address) of records refused for naming another pod (each logged once; at most
        #: :data:`MAX_REFUSED_CLAIMS`).
        self.refused_claims: set[tuple[EndpointId, str]] = set()
        #: Whether an endpoint is drained (etcd ``drain/<id>``: ``ControlCore.draining``), applied when a
        #: pool endpoint joins; a drain set later reaches it through the control core itself.
        self.draining: Callable[[EndpointId], bool] = lambda _endpoint_id: False
        #: The pool has been read at least once (before, :meth:`admits` admits every agent's record).
        self.known = False
        self._pool: dict[EndpointId, Endpoint] = {}
        self._pods: dict[str, str] = {}  # socket_key(address) -> the name of the pod serving it
        self._addresses: frozenset[str] = frozenset()  # the pool endpoints' addresses
        self._ours: dict[EndpointId, Endpoint] = {}

    def admits(self, endpoint: Endpoint) -> bool:
        """Whether an agent's etcd record may be in the fleet: it is at the address of one of the pool's
        endpoints (a ready pod's target port), or the pool is not known yet, or ``agents_outside_pool``;
        and, with ``agent_node_is_pod``, not at the address of a pod its node does not name. Addresses
        compare as sockets (:func:`socket_key`): another spelling of a pod's address is that pod's."""
        pod = self._pods.get(socket_key(endpoint.address))
        if self.agent_node_is_pod and pod is not None and endpoint.node != pod:
            claim = (endpoint.id, endpoint.address)
            if claim not in self.refused_claims:
                if len(self.refused_claims) >= MAX_REFUSED_CLAIMS:
                    self.refused_claims.clear()
                self.refused_claims.add(claim)
                log.warning(
                    "endpoint %s of node %s refused: %s is pod %s's address",
                    endpoint.id,
                    endpoint.node,
                    endpoint.address,
                    pod,
                )
            return False
        return self.agents_outside_pool or not self.known or endpoint.address in self._addresses

    def owns(self, endpoint_id: EndpointId) -> bool:
        """The fleet's entry ``endpoint_id`` is a pool endpoint this sync put there (and nobody replaced)."""
        state = self.fleet.get(endpoint_id)
        return state is not None and self._ours.get(endpoint_id) == state.endpoint

    @property
    def pool(self) -> Mapping[EndpointId, Endpoint]:
        """The pool's endpoints, as last set."""
        return self._pool

    @property
    def joined(self) -> frozenset[EndpointId]:
        """The pool endpoints in the fleet now (the others are covered by a registered endpoint)."""
        return frozenset(i for i in self._ours if self.owns(i))

    def set_pool(self, endpoints: Mapping[EndpointId, Endpoint]) -> bool:
        """The pool's endpoints are now ``endpoints``; returns whether the fleet changed."""
        self._pool = dict(endpoints)
        # a pool endpoint's id is its pod's name, with ":<port>" when the pool has several target ports
        self._pods = {socket_key(e.address): str(i).partition(":")[0] for i, e in self._pool.items()}
        self._addresses = frozenset(e.address for e in self._pool.values())
        self.known = True
        return self.reconcile()

    def reconcile(self) -> bool:
        """Make the fleet's pool entries those :func:`merge` keeps; returns whether the fleet changed."""
        for endpoint_id in [i for i in self._ours if not self.owns(i)]:
            del self._ours[endpoint_id]  # replaced or removed by another source
        registered = [s.endpoint for s in self.fleet if s.id not in self._ours]
        merged = merge(self._pool, registered)
        wanted = {i: e for i, e in merged.items() if self._pool.get(i) is e}
        changed = False
        # removals (and moves to another address) first: an address freed here may be taken below
        for endpoint_id, endpoint in list(self._ours.items()):
            new = wanted.get(endpoint_id)
            if new is None or new.address != endpoint.address:
                del self._ours[endpoint_id]
                self.fleet.remove(endpoint_id)
                changed = True
                if new is None:
                    log.info("pool endpoint %s (%s) left the fleet", endpoint_id, endpoint.address)
        for endpoint_id, endpoint in wanted.items():
            if self._ours.get(endpoint_id) != endpoint:
                if endpoint_id not in self._ours:
                    log.info("pool endpoint %s (%s) joined the fleet", endpoint_id, endpoint.address)
                joined = endpoint_id not in self._ours
                self.fleet.upsert(endpoint)
                self._ours[endpoint_id] = endpoint
                if joined and self.draining(endpoint_id):
                    self.fleet.set_state(endpoint_id, draining=True)
                changed = True
        return changed
