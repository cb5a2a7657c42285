"""The dev OIDC issuer over real HTTP (127.0.0.1:0), and the token forging helpers."""

from __future__ import annotations

import datetime as dt
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest

from certs.store import dev_bundle
from kvgate.dev.oidc import DISCOVERY_PATH, DevClient, DevIssuer, load_clients, main, serve, tls_context
from kvgate.dev.tokens import SigningKey, bad_signature, mint, tampered, unsigned

CLIENT = DevClient("acme-ci", "s3cret", "kvgate", {"tenant": "acme", "groups": ["eng"]})


@pytest.fixture(scope="module", params=["RS256", "ES256"])
def issuer(request: pytest.FixtureRequest) -> Iterator[DevIssuer]:
    server, dev = serve([CLIENT], SigningKey.generate(request.param), "127.0.0.1", 0, None, 300)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield dev
    server.shutdown()
    server.server_close()


def verify(issuer: DevIssuer, token: str, **options: Any) -> dict[str, Any]:
    jwks = httpx.get(f"{issuer.issuer}/jwks").json()
    key = jwt.PyJWKSet.from_dict(jwks).keys[0]
    claims: dict[str, Any] = jwt.decode(
        token, key.key, algorithms=[issuer.key.alg], audience="kvgate", issuer=issuer.issuer, **options
    )
    return claims


def test_discovery_and_jwks(issuer: DevIssuer) -> None:
    doc = httpx.get(issuer.issuer + DISCOVERY_PATH).json()
    assert doc["issuer"] == issuer.issuer and doc["jwks_uri"] == f"{issuer.issuer}/jwks"
    assert doc["token_endpoint"] == f"{issuer.issuer}/token"
    assert doc["grant_types_supported"] == ["client_credentials"]
    assert issuer.key.alg in doc["id_token_signing_alg_values_supported"]
    (key,) = httpx.get(doc["jwks_uri"]).json()["keys"]
    assert key["kid"] == issuer.key.kid and key["use"] == "sig" and key["alg"] == issuer.key.alg
    assert "d" not in key and "p" not in key  # public parts only


@pytest.mark.parametrize("method", ["client_secret_basic", "client_secret_post"])
def test_client_credentials_token(issuer: DevIssuer, method: str) -> None:
    form = {"grant_type": "client_credentials", "scope": "inference"}
    if method == "client_secret_basic":
        resp = httpx.post(f"{issuer.issuer}/token", data=form, auth=(CLIENT.client_id, CLIENT.client_secret))
    else:
        form |= {"client_id": CLIENT.client_id, "client_secret": CLIENT.client_secret}
        resp = httpx.post(f"{issuer.issuer}/token", data=form)
    assert resp.status_code == 200 and resp.headers["cache-control"] == "no-store"
    body = resp.json()
    assert body["token_type"] == "Bearer" and body["expires_in"] == 300
    claims = verify(issuer, body["access_token"])
    assert claims["sub"] == "acme-ci" and claims["tenant"] == "acme" and claims["groups"] == ["eng"]
    assert claims["exp"] - claims["iat"] == 300 and claims["scope"] == "inference" and claims["jti"]
    assert jwt.get_unverified_header(body["access_token"])["kid"] == issuer.key.kid


@pytest.mark.parametrize(
    ("form", "auth", "status", "error"),
    [
        ({"grant_type": "client_credentials"}, ("acme-ci", "wrong"), 401, "invalid_client"),
        ({"grant_type": "client_credentials"}, ("nobody", "s3cret"), 401, "invalid_client"),
        ({"grant_type": "client_credentials"}, None, 401, "invalid_client"),
        ({"grant_type": "password"}, ("acme-ci", "s3cret"), 400, "unsupported_grant_type"),
    ],
)
def test_token_errors(
    issuer: DevIssuer, form: dict[str, str], auth: tuple[str, str] | None, status: int, error: str
) -> None:
    resp = httpx.post(f"{issuer.issuer}/token", data=form, auth=auth)
    assert resp.status_code == status and resp.json()["error"] == error
    assert "access_token" not in resp.text


def test_forged_tokens_fail_verification(issuer: DevIssuer) -> None:
    claims = {
        "iss": issuer.issuer,
        "aud": "kvgate",
        "sub": "x",
        "tenant": "acme",
        "iat": 1,
        "exp": 4_000_000_000,
    }
    good = mint(claims, issuer.key)
    assert verify(issuer, good)["tenant"] == "acme"
    assert json.loads(jwt.utils.base64url_decode(unsigned(claims).split(".")[0]))["alg"] == "none"
    for bad in (unsigned(claims), tampered(good, tenant="beta"), bad_signature(good)):
        with pytest.raises(jwt.InvalidTokenError):
            verify(issuer, bad)
    for bad in (mint({**claims, "exp": 2}, issuer.key), mint({**claims, "iss": "https://evil"}, issuer.key)):
        with pytest.raises(jwt.InvalidTokenError):
            verify(issuer, bad)
    with pytest.raises(jwt.InvalidTokenError):
        verify(issuer, mint({**claims, "aud": "other"}, issuer.key))
    with pytest.raises(jwt.InvalidTokenError):
        verify(
            issuer, mint(claims, SigningKey.generate(issuer.key.alg))
        )  # another key, same kid? no: unknown key


def test_clients_file(tmp_path: Path) -> None:
    path = tmp_path / "clients.toml"
    path.write_text('[[clients]]\nclient_id = "a"\nclient_secret = "b"\nclaims = { tenant = "t" }\n')
    assert load_clients(path, "kvgate") == [DevClient("a", "b", "kvgate", {"tenant": "t"})]
    for bad in (
        '{"clients": [{"client_id": "a"}]}',
        '{"clients": [{"client_id": "a", "client_secret": "b", "claims": {"iss": "x"}}]}',
        '{"clients": [{"client_id": "a", "client_secret": "b", "role": "x"}]}',
        '{"users": []}',
    ):
        bad_path = tmp_path / "bad.json"
        bad_path.write_text(bad)
        with pytest.raises(ValueError):
            load_clients(bad_path, "kvgate")


def test_a_port_it_cannot_listen_on_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clients = tmp_path / "clients.toml"
    clients.write_text('[[clients]]\nclient_id = "a"\nclient_secret = "b"\n')
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--port", str(port), "--clients", str(clients)]) == 1
        assert capsys.readouterr().err == (
            f"kvgate oidc-dev: cannot listen on 127.0.0.1:{port}: Address already in use\n"
        )
    assert main(["--port", "70000", "--clients", str(clients)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvgate oidc-dev: cannot listen on 127.0.0.1:70000: ") and "Traceback" not in err


@pytest.mark.parametrize("alg", ["RS256", "ES256"])
def test_key_file_is_created_private_then_reused(tmp_path: Path, alg: str) -> None:
    path = tmp_path / "key.pem"
    first = SigningKey.load_or_create(path, alg)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    again = SigningKey.load_or_create(path, "RS256")  # the file decides the algorithm
    assert (again.alg, again.kid) == (alg, first.kid)
    assert first.public_jwk()["kid"] == first.kid and len(first.kid) == 43  # base64url SHA-256
    assert SigningKey.generate(alg).kid != first.kid
    with pytest.raises(ValueError):
        SigningKey.generate("HS256")


def test_https_issuer_with_the_oidc_certificate(tmp_path: Path) -> None:
    """``--tls-cert``: HTTPS only, an ``https://`` issuer URL, served to clients trusting the stack's CA;
    a client that fails its handshake does not stop the issuer."""
    leaf = dev_bundle(tmp_path, ["oidc"], dt.datetime.now(dt.UTC))["oidc"]
    tls = tls_context(leaf.cert, leaf.key)
    server, dev = serve([CLIENT], SigningKey.generate(), "127.0.0.1", 0, None, 300, tls)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert dev.issuer == f"https://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(httpx.ConnectError):  # the system trust store does not know the dev CA
            httpx.get(dev.issuer + DISCOVERY_PATH)
        with pytest.raises(httpx.TransportError):  # no plain HTTP on the same port
            httpx.get(dev.issuer.replace("https://", "http://") + DISCOVERY_PATH)
        trusted = ssl.create_default_context(cafile=str(leaf.ca))
        with httpx.Client(verify=trusted, timeout=10) as http:
            doc = http.get(dev.issuer + DISCOVERY_PATH).json()
            assert doc["jwks_uri"] == f"{dev.issuer}/jwks" and doc["issuer"] == dev.issuer
            assert http.get(doc["jwks_uri"]).json()["keys"][0]["kid"] == dev.key.kid
            resp = http.post(
                doc["token_endpoint"],
                data={"grant_type": "client_credentials"},
                auth=(CLIENT.client_id, CLIENT.client_secret),
            )
        assert resp.status_code == 200
        claims = jwt.decode(resp.json()["access_token"], options={"verify_signature": False})
        assert claims["iss"] == dev.issuer
    finally:
        server.shutdown()
        server.server_close()
