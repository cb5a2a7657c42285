"""The CDS the ext_proc serves for etcd's burst endpoints (extproc/xds/cds.py)."""

from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
from envoy.service.discovery.v3 import discovery_pb2

from extproc.burst.core import BurstEndpoint
from extproc.xds.cds import TYPE_URL, ClusterStream, clusters

E = BurstEndpoint(
    "hosted", "api.example.com", {"m": "n"}, "/etc/k.key", 8443, "/etc/ca.pem", credential="openai"
)


def unpack(resource: object) -> cluster_pb2.Cluster:
    msg = cluster_pb2.Cluster()
    resource.Unpack(msg)  # type: ignore[attr-defined]
    return msg


def test_a_cluster_per_endpoint_with_the_credentials_secret_and_verified_tls() -> None:
    state = clusters((E,), 2.0)
    (c,) = (unpack(r) for r in state.resources)
    assert c.name == "kvgate_burst_hosted" and c.type == cluster_pb2.Cluster.STRICT_DNS
    tls = tls_pb2.UpstreamTlsContext()
    c.transport_socket.typed_config.Unpack(tls)
    assert tls.sni == "api.example.com"
    assert tls.common_tls_context.validation_context.trusted_ca.filename == "/etc/ca.pem"
    raw = c.SerializeToString()
    assert b"kvgate_burst_credential_openai" in raw and b"/etc/k.key" not in raw  # a secret's name only
    assert clusters((E,), 2.0).version == state.version != clusters((), 2.0).version


def test_the_stream_sends_every_cluster_on_a_wildcard_and_again_only_on_a_change() -> None:
    stream = ClusterStream()
    assert stream.response_for(clusters((), 2.0)) is None  # nothing asked yet
    assert stream.request(discovery_pb2.DiscoveryRequest(type_url=TYPE_URL)) is None
    first = stream.response_for(clusters((E,), 2.0))
    assert first is not None and len(first.resources) == 1 and first.type_url == TYPE_URL
    ack = discovery_pb2.DiscoveryRequest(
        type_url=TYPE_URL, response_nonce=first.nonce, version_info=first.version_info
    )
    stream.request(ack)
    assert stream.response_for(clusters((E,), 2.0)) is None  # the same version
    gone = stream.response_for(clusters((), 2.0))
    assert gone is not None and list(gone.resources) == []  # SotW: absent means removed


def test_the_bearer_prefix_reaches_the_wire_though_the_python_protos_lack_the_field() -> None:
    from envoy.extensions.filters.http.credential_injector.v3 import credential_injector_pb2
    from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2

    (c,) = (unpack(r) for r in clusters((E,), 2.0).resources)
    options = http_protocol_options_pb2.HttpProtocolOptions()
    c.typed_extension_protocol_options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].Unpack(
        options
    )
    injector = credential_injector_pb2.CredentialInjector()
    options.http_filters[0].typed_config.Unpack(injector)
    assert injector.overwrite
    assert injector.credential.typed_config.value.endswith(b"\x1a\x07Bearer ")
