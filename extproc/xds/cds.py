"""gRPC CDS (state of the world) for Envoy: the clusters of burst endpoints declared in etcd.

Envoy's bootstrap names the ext_proc as its CDS server when the gateway host declares burst credentials
(:func:`kvgate.envoy.burst.apply_credentials`). Every Envoy subscribes (a wildcard); each response holds
every etcd endpoint's cluster (:func:`kvgate.envoy.burst.cluster`, built without reading any file: the
key stays Envoy's), so a record's change adds, replaces or removes its cluster without an Envoy restart.
Version: the first 16 hex digits of the SHA-256 of the clusters' deterministic serialization. The
per-stream ACK/NACK bookkeeping is EDS's (:class:`extproc.xds.eds.SotwStream`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.filters.http.credential_injector.v3 import credential_injector_pb2
from envoy.extensions.filters.http.upstream_codec.v3 import upstream_codec_pb2
from envoy.extensions.http.injected_credentials.generic.v3 import generic_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.service.cluster.v3 import cds_pb2_grpc
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2, json_format

from extproc.burst.clusters import cluster, secret_name
from extproc.burst.core import BurstEndpoint
from extproc.xds.eds import SotwStream, serve

log = logging.getLogger(__name__)

TYPE_URL = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
#: The typed configs a burst cluster packs: imported so that json_format finds each ``@type`` in the
#: default descriptor pool.
TYPED_CONFIGS = (credential_injector_pb2, upstream_codec_pb2, generic_pb2, tls_pb2, http_protocol_options_pb2)


@dataclass(frozen=True, slots=True)
class Clusters:
    """One CDS state as served: ``version`` and the clusters, packed once."""

    version: str
    resources: tuple[any_pb2.Any, ...]


#: ``Generic.header_value_prefix`` (field 3): Envoy has it, the Python protos of ``xds-protos`` do not yet,
#: so its bytes are appended to the packed message by hand (a field's wire form: tag, length, bytes).
PREFIX_FIELD = 3
_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def _string_field(number: int, value: str) -> bytes:
    data = value.encode()
    assert len(data) < 128, "one length byte"
    return bytes([number << 3 | 2, len(data)]) + data


def _proto(raw: dict[str, Any]) -> cluster_pb2.Cluster:
    """The cluster dict as a proto; the credential's ``header_value_prefix`` carried as raw bytes."""
    options = raw["typed_extension_protocol_options"][_OPTIONS]
    generic = options["http_filters"][0]["typed_config"]["credential"]["typed_config"]
    prefix = generic.pop("header_value_prefix", "")
    msg = json_format.ParseDict(raw, cluster_pb2.Cluster())
    if prefix:
        packed = http_protocol_options_pb2.HttpProtocolOptions()
        msg.typed_extension_protocol_options[_OPTIONS].Unpack(packed)
        injector = credential_injector_pb2.CredentialInjector()
        packed.http_filters[0].typed_config.Unpack(injector)
        injector.credential.typed_config.value += _string_field(PREFIX_FIELD, prefix)
        packed.http_filters[0].typed_config.Pack(injector)
        msg.typed_extension_protocol_options[_OPTIONS].Pack(packed)
    return msg


def clusters(endpoints: tuple[BurstEndpoint, ...], connect_timeout_s: float) -> Clusters:
    """The CDS state of ``endpoints`` (etcd's, by name)."""
    packed = []
    digest = hashlib.sha256()
    for e in sorted(endpoints, key=lambda e: e.name):
        msg = _proto(cluster(e, connect_timeout_s, secret_name(e)))
        raw = msg.SerializeToString(deterministic=True)
        digest.update(len(raw).to_bytes(8, "big") + raw)
        resource = any_pb2.Any()
        resource.Pack(msg)
        packed.append(resource)
    return Clusters(digest.hexdigest()[:16], tuple(packed))


class ClusterStream(SotwStream):
    """One Envoy's CDS subscription: EDS's bookkeeping, every cluster in each response."""

    type_url = TYPE_URL

    def response_for(self, state: Clusters) -> discovery_pb2.DiscoveryResponse | None:
        """The response to send for ``state`` now, or ``None``."""
        if not self.due(state.version):
            return None
        wanted = set(self.names or ())
        every = not wanted or "*" in wanted  # a wildcard subscription
        resources = [r for r in state.resources if every or _name(r) in wanted]
        return discovery_pb2.DiscoveryResponse(
            version_info=state.version, resources=resources, type_url=TYPE_URL, nonce=self.nonce
        )


def _name(resource: any_pb2.Any) -> str:
    msg = cluster_pb2.Cluster()
    resource.Unpack(msg)
    return str(msg.name)


class ClusterDiscovery(cds_pb2_grpc.ClusterDiscoveryServiceServicer):  # type: ignore[misc]
    """``StreamClusters`` for every Envoy; :meth:`set` swaps the endpoints and wakes every stream."""

    def __init__(self, connect_timeout_s: float = 2.0) -> None:
        self._timeout = connect_timeout_s
        self.state = clusters((), connect_timeout_s)
        self._wakes: set[asyncio.Event] = set()
        self._closed = False

    def set(self, endpoints: tuple[BurstEndpoint, ...]) -> None:
        state = clusters(endpoints, self._timeout)
        if state.version == self.state.version:
            return
        self.state = state
        log.info("CDS: version %s, burst clusters %s", state.version, [e.cluster for e in endpoints])
        for wake in self._wakes:
            wake.set()

    async def aclose(self) -> None:
        self._closed = True
        for wake in self._wakes:
            wake.set()

    async def StreamClusters(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        async for resp in serve(
            "CDS", request_iterator, context, ClusterStream(), lambda s: s.response_for(self.state),
            self._wakes, lambda: self._closed,
        ):  # fmt: skip
            yield resp
