"""End to end, secure profile: real Envoy, real TLS. HTTPS at the edge (client certificates required
here), mTLS from Envoy to the ext_proc and to the simulated engines, certificate rotation without
restarts, and ``kvgate up --secure`` as a user runs it."""

from __future__ import annotations

import datetime as dt
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import yaml
from cryptography import x509
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from certs.store import LOCAL_SANS, LeafFiles, dev_bundle, issue
from kvgate.dev.up import Stack, StackOptions
from tests.e2e.conftest import FAST_SIM, launched_up

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(
        replicas=2,
        port=0,
        sim_args=FAST_SIM,
        workdir=tmp_path_factory.mktemp("secure"),
        secure=True,
        client_certs=True,
    )
    with Stack(options) as running:
        yield running


def context(ca: Path, client: LeafFiles | None = None, max_tls12: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        ctx.load_cert_chain(client.cert, client.key)
    if max_tls12:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def ca_of(stack: Stack) -> Path:
    return stack.certs["envoy-edge"].ca


def listener(stack: Stack) -> tuple[str, int]:
    host, port = stack.url.removeprefix("https://").rsplit(":", 1)
    return host, int(port)


def served_serial(stack: Stack) -> int:
    """Serial of the certificate the OpenAI listener presents on a fresh TLS connection."""
    ctx = context(ca_of(stack), stack.certs["client-dev"])
    with (
        socket.create_connection(listener(stack), timeout=5) as sock,
        ctx.wrap_socket(sock, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def complete(stack: Stack, ctx: ssl.SSLContext) -> str:
    """A completion through the OpenAI SDK; returns the replica that served it."""
    with httpx.Client(verify=ctx, timeout=30) as http:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, http_client=http)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi over mTLS"}], max_tokens=3
        )
        assert raw.parse().choices[0].message.content
        return raw.headers["x-kvgate-replica"]


def test_openai_sdk_over_mtls(secure: Stack) -> None:
    assert secure.url.startswith("https://")
    assert complete(secure, context(ca_of(secure), secure.certs["client-dev"])) in {"sim-0", "sim-1"}


def test_extproc_scrapes_engines_over_mtls(secure: Stack) -> None:
    """Readiness needs a healthy engine, i.e. an https metrics scrape with the ext_proc's client cert."""
    with grpc.insecure_channel(f"127.0.0.1:{secure.extproc_ports['health']}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="readiness"), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("max_tls12", [False, True], ids=["tls1.3", "tls1.2"])
def test_client_without_certificate_refused(secure: Stack, max_tls12: bool) -> None:
    ctx = context(ca_of(secure), None, max_tls12)
    with pytest.raises(httpx.TransportError) as err, httpx.Client(verify=ctx, timeout=10) as http:
        http.get(f"{secure.url}/v1/models")
    if max_tls12:  # TLS 1.2 fails in the handshake itself; TLS 1.3 on the first read (alert 116)
        assert isinstance(err.value, httpx.ConnectError)


def test_client_cert_from_another_ca_refused(secure: Stack, tmp_path: Path) -> None:
    other = dev_bundle(tmp_path, ["client-dev"], dt.datetime.now(dt.UTC))["client-dev"]
    with (
        pytest.raises(httpx.TransportError),
        httpx.Client(verify=context(ca_of(secure), other), timeout=10) as http,
    ):
        http.get(f"{secure.url}/v1/models")


def test_client_cert_without_client_identity_refused(secure: Stack) -> None:
    """The ext_proc's certificate chains to the CA and may act as a client, but is no ``client-*``."""
    with (
        pytest.raises(httpx.TransportError),
        httpx.Client(verify=context(ca_of(secure), secure.certs["extproc"]), timeout=10) as http,
    ):
        http.get(f"{secure.url}/v1/models")


def test_engines_and_extproc_refuse_callers_without_client_cert(secure: Stack) -> None:
    engine = secure.engines[0]["address"]
    with pytest.raises(httpx.TransportError), httpx.Client(verify=context(ca_of(secure)), timeout=10) as http:
        http.get(f"https://{engine}/metrics")
    # An API client's certificate (its own CA) opens the listener and no internal hop (issue 26.1).
    client = secure.certs["client-dev"]
    assert client.ca != ca_of(secure)
    with (
        pytest.raises(httpx.TransportError),
        httpx.Client(verify=context(ca_of(secure), client), timeout=10) as http,
    ):
        http.get(f"https://{engine}/metrics")
    with httpx.Client(verify=context(ca_of(secure), secure.certs["extproc"]), timeout=10) as http:
        assert http.get(f"https://{engine}/metrics").status_code == 200  # the scraper's identity
    extproc = f"127.0.0.1:{secure.extproc_ports['extproc']}"
    for cert in (None, client):
        creds = grpc.ssl_channel_credentials(
            root_certificates=ca_of(secure).read_bytes(),
            private_key=None if cert is None else cert.key.read_bytes(),
            certificate_chain=None if cert is None else cert.cert.read_bytes(),
        )
        with grpc.secure_channel(extproc, creds) as channel:
            stream = pb_grpc.ExternalProcessorStub(channel).Process(
                iter([pb.ProcessingRequest()]), timeout=10
            )
            with pytest.raises(grpc.RpcError) as err:
                list(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def test_the_extproc_answers_only_envoys_identity(secure: Stack) -> None:
    """Another role's certificate from the same CA (here the ext_proc's own) gets PERMISSION_DENIED before
    a message is read, so it cannot forge jwt_authn metadata or failed tries; Envoy's identity is served;
    gRPC health stays open to any verified peer (issue 26.1-2)."""
    extproc = f"127.0.0.1:{secure.extproc_ports['extproc']}"

    def channel(name: str) -> grpc.Channel:
        leaf = secure.certs[name]
        creds = grpc.ssl_channel_credentials(
            ca_of(secure).read_bytes(), leaf.key.read_bytes(), leaf.cert.read_bytes()
        )
        return grpc.secure_channel(extproc, creds, options=[("grpc.ssl_target_name_override", "extproc")])

    probe = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=":path", raw_value=b"/health")]), end_of_stream=True
        )
    )
    with channel("extproc") as other:
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.ExternalProcessorStub(other).Process(iter([probe]), timeout=10))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
        with pytest.raises(grpc.RpcError) as err:  # nor report failed tries (a stream-unary call)
            als_pb2_grpc.AccessLogServiceStub(other).StreamAccessLogs(
                iter([als_pb2.StreamAccessLogsMessage()]), timeout=10
            )
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
        health = health_pb2_grpc.HealthStub(other).Check(health_pb2.HealthCheckRequest(service="liveness"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with channel("envoy-edge") as envoy:
        (answer,) = list(pb_grpc.ExternalProcessorStub(envoy).Process(iter([probe]), timeout=10))
        assert answer.immediate_response.status.code == 200


def test_envoy_serves_rotated_certificate_without_restart(secure: Stack) -> None:
    assert secure.envoy is not None
    pid, before = secure.envoy.pid, served_serial(secure)
    rotated = issue(ca_of(secure).parent, "envoy-edge", LOCAL_SANS, dt.datetime.now(dt.UTC))
    want = x509.load_pem_x509_certificate(rotated.cert.read_bytes()).serial_number
    assert want != before
    deadline = time.monotonic() + 10
    while served_serial(secure) != want:
        assert time.monotonic() < deadline, "Envoy did not pick up the rotated certificate within 10 s"
        time.sleep(0.05)
    assert secure.envoy.pid == pid and secure.envoy.alive()
    complete(secure, context(ca_of(secure), secure.certs["client-dev"]))  # upstream mTLS still fine


def test_kvgate_up_secure_cli(tmp_path: Path) -> None:
    """`kvgate up --secure --auth`: prints the https URL, the CA path and an https dev OIDC issuer; a
    token from that issuer (trusting the CA) is accepted by Envoy, whose JWKS cluster fetched the keys
    over TLS verified against the same CA (issue 26.5), and an SDK trusting that CA completes."""
    with launched_up(
        ["--secure", "--auth", "--port", "0", "--replicas", "1"], tmp_path, until="  try: "
    ) as up:
        lines, banner = up.lines, up.banner
        assert banner, "".join(lines)
        (ca_line,) = [line for line in lines if line.startswith("  CA certificate for clients: ")]
        base, ca = banner.split()[3], ca_line.split(": ", 1)[1].strip()
        assert base.startswith("https://") and Path(ca) == tmp_path / "certs" / "ca.pem"
        (issuer_line,) = [line for line in lines if line.startswith("  OIDC issuer: ")]
        _, _, issuer, _, client_id, _, secret = issuer_line.split()
        assert issuer.startswith("https://127.0.0.1:")
        assert any(line.startswith(f"  a token: curl -s --cacert {ca} ") for line in lines)
        jwks = yaml.safe_load((tmp_path / "envoy.yaml").read_text())["static_resources"]["clusters"]
        (tls,) = [c["transport_socket"]["typed_config"] for c in jwks if c["name"] == "kvgate_jwks"]
        assert tls["common_tls_context"]["validation_context"]["trusted_ca"] == {"filename": ca}
        with httpx.Client(verify=ssl.create_default_context(cafile=ca), timeout=30) as http:
            grant = {"grant_type": "client_credentials"}
            resp = http.post(f"{issuer}/token", data=grant, auth=(client_id, secret))
            assert resp.status_code == 200, resp.text
            token = resp.json()["access_token"]
            client = openai.OpenAI(base_url=base, api_key=token, max_retries=0, http_client=http)
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
        assert reply.choices[0].message.content
        assert up.stop() == 0
