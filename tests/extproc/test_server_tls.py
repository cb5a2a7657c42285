"""The ext_proc gRPC port over mTLS: callers need a client certificate from the configured CA, and a
certificate rotated on disk is served to new connections without a restart. Real TLS on 127.0.0.1."""

from __future__ import annotations

import asyncio
import datetime as dt
import socket
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from certs.store import LOCAL_SANS, LeafFiles, dev_bundle, issue, write_atomic
from contracts.errors import ConfigError
from extproc.config import parse_config
from extproc.server import Gateway

NOW = dt.datetime.now(dt.UTC)


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, LeafFiles]:
    return dev_bundle(tmp_path / "pki", ["extproc", "envoy-edge", "engine"], NOW)


@pytest.fixture
async def gateway(pki: dict[str, LeafFiles]) -> AsyncIterator[Gateway]:
    ex = pki["extproc"]
    config = parse_config(
        {
            "extproc": {
                "listen": "127.0.0.1:0",
                "health_listen": "127.0.0.1:0",
                "metrics_listen": "",
                "tls_cert": str(ex.cert),
                "tls_key": str(ex.key),
                "tls_client_ca": str(ex.ca),
            }
        }
    )
    gw = Gateway(config)
    await gw.start()
    yield gw
    await gw.aclose(grace_s=0)


def credentials(ca: Path, client: LeafFiles | None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=client.key.read_bytes() if client else None,
        certificate_chain=client.cert.read_bytes() if client else None,
    )


async def call(gw: Gateway, creds: grpc.ChannelCredentials) -> list[pb.ProcessingResponse]:
    """One Process stream (a bodyless GET), as Envoy would open it."""
    headers = HeaderMap(
        headers=[HeaderValue(key=k, raw_value=v) for k, v in ((":path", b"/v1/models"), (":method", b"GET"))]
    )
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers, end_of_stream=True))
    async with grpc.aio.secure_channel(f"127.0.0.1:{gw.ports['extproc']}", creds) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        return [r async for r in stub.Process(iter([msg]), timeout=10)]


def served_serial(port: int, client: LeafFiles) -> int:
    """Serial of the certificate the server presents on a fresh TLS connection (ALPN h2, as gRPC)."""
    ctx = ssl.create_default_context(cafile=str(client.ca))
    ctx.load_cert_chain(client.cert, client.key)
    ctx.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as sock,
        ctx.wrap_socket(sock, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


async def test_caller_with_a_dev_ca_client_cert_is_served(
    gateway: Gateway, pki: dict[str, LeafFiles]
) -> None:
    edge = pki["envoy-edge"]
    assert await call(gateway, credentials(edge.ca, edge))


async def test_caller_without_a_client_cert_is_refused(gateway: Gateway, pki: dict[str, LeafFiles]) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(gateway, credentials(pki["extproc"].ca, None))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_plaintext_caller_is_refused(gateway: Gateway) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['extproc']}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _ = [r async for r in stub.Process(iter([pb.ProcessingRequest()]), timeout=10)]
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_cert_from_another_ca_is_refused(
    gateway: Gateway, pki: dict[str, LeafFiles], tmp_path: Path
) -> None:
    other = dev_bundle(tmp_path / "other", ["envoy-edge"], NOW)["envoy-edge"]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(gateway, credentials(pki["extproc"].ca, other))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_rotated_certificate_served_without_restart(
    gateway: Gateway, pki: dict[str, LeafFiles]
) -> None:
    edge, port = pki["envoy-edge"], gateway.ports["extproc"]
    before = await asyncio.to_thread(served_serial, port, edge)
    rotated = issue(pki["extproc"].cert.parent, "extproc", LOCAL_SANS, NOW)
    want = x509.load_pem_x509_certificate(rotated.cert.read_bytes()).serial_number
    assert want != before
    deadline = time.monotonic() + 10
    while (got := await asyncio.to_thread(served_serial, port, edge)) != want:
        assert time.monotonic() < deadline, "rotated certificate not served within 10 s"
        await asyncio.sleep(0.05)
    assert got == want and gateway.server_certs is not None and gateway.server_certs.reloads == 1
    assert await call(gateway, credentials(edge.ca, edge))  # and RPCs still work on the new certificate


async def test_mismatched_pair_keeps_the_current_certificate(
    gateway: Gateway, pki: dict[str, LeafFiles], tmp_path: Path
) -> None:
    edge, ex, port = pki["envoy-edge"], pki["extproc"], gateway.ports["extproc"]
    before = await asyncio.to_thread(served_serial, port, edge)
    write_atomic(ex.key, pki["engine"].key.read_bytes(), 0o600)  # half a rotation: key of another cert
    assert await asyncio.to_thread(served_serial, port, edge) == before
    assert await call(gateway, credentials(edge.ca, edge))


@pytest.mark.parametrize(
    ("extproc", "scrape", "message"),
    [
        ({"tls_cert": "a.pem"}, {}, "extproc: set all of tls_cert, tls_key, tls_client_ca"),
        ({"tls_cert": "a", "tls_key": "b", "tls_client_ca": ""}, {}, "extproc: set all"),
        ({}, {"tls_key": "k.key"}, "scrape: set all of tls_cert, tls_key"),
        ({"tls_cert": 1}, {}, "extproc.tls_cert: expected str"),
    ],
)
def test_tls_config_all_or_none(extproc: dict[str, object], scrape: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"extproc": extproc, "scrape": scrape})


async def test_unreadable_tls_files_fail_the_start(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    config = parse_config(
        {
            "extproc": {
                "listen": "127.0.0.1:0",
                "health_listen": "127.0.0.1:0",
                "metrics_listen": "",
                "tls_cert": missing,
                "tls_key": missing,
                "tls_client_ca": missing,
            }
        }
    )
    with pytest.raises(ConfigError, match="cannot read"):
        await Gateway(config).start()
