"""``kvgate oidc-dev``: a small OpenID Connect issuer for development and tests. Not for production.

Built on authlib's OAuth 2.0 server (client authentication, the client-credentials grant, error
responses) with tokens signed by PyJWT. It serves:

* ``GET /.well-known/openid-configuration``: the discovery document (validated with authlib at start);
* ``GET /jwks``: the public signing key (RS256 or ES256), the key Envoy fetches and caches;
* ``POST /token``: ``grant_type=client_credentials`` with ``client_secret_basic`` or
  ``client_secret_post``; the access token is a JWT with ``iss``, ``aud``, ``sub`` (the client id),
  ``iat``, ``exp``, ``jti``, ``scope`` and the client's extra claims (``tenant``, ``groups``, ...).

With ``--tls-cert``/``--tls-key`` it serves HTTPS only (TLS 1.2+; the issuer URL is then
``https://HOST:PORT``): what ``kvgate up --secure --auth`` runs, so Envoy fetches the JWKS over
verified TLS. Each connection's handshake runs in its own thread, bounded by
:data:`HANDSHAKE_TIMEOUT_S`.

Clients file (JSON or TOML; secrets in clear: a development tool)::

    [[clients]]
    client_id = "acme-ci"
    client_secret = "change-me"
    audience = "kvgate"                         # default: --audience
    claims = { tenant = "acme", groups = ["acme"] }

Nothing secret is logged (no tokens, no client secrets); authlib's own debug log, which prints issued
tokens, is kept at WARNING. :mod:`kvgate.dev.tokens` forges bad tokens for tests with the same key.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import ssl
import sys
import threading
import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from authlib.oauth2.rfc6749 import (  # type: ignore[import-untyped]
    AuthorizationServer,
    ClientMixin,
    OAuth2Request,
)
from authlib.oauth2.rfc6749.grants import ClientCredentialsGrant  # type: ignore[import-untyped]
from authlib.oauth2.rfc6749.requests import BasicOAuth2Payload  # type: ignore[import-untyped]
from authlib.oauth2.rfc6750 import BearerTokenGenerator  # type: ignore[import-untyped]
from authlib.oidc.discovery import OpenIDProviderMetadata  # type: ignore[import-untyped]

from kvgate.dev.tokens import SigningKey, mint

log = logging.getLogger(__name__)

DISCOVERY_PATH = "/.well-known/openid-configuration"
MAX_FORM_BYTES = 16 * 1024
#: Seconds a client has to complete the TLS handshake (HTTPS only).
HANDSHAKE_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class DevClient:
    """A registered client: credentials, the ``aud`` of its tokens, and extra claims they carry."""

    client_id: str
    client_secret: str
    audience: str
    claims: Mapping[str, Any] = field(default_factory=dict)


def load_clients(path: Path, default_audience: str) -> list[DevClient]:
    """Read a clients file (``.json`` or ``.toml``); raises ``ValueError`` naming the bad entry."""
    text = path.read_bytes()
    raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text.decode())
    if not isinstance(raw, dict) or set(raw) != {"clients"} or not isinstance(raw["clients"], list):
        raise ValueError(f"{path}: expected a single 'clients' list")
    clients = []
    for i, entry in enumerate(raw["clients"]):
        where = f"{path}: clients[{i}]"
        if not isinstance(entry, dict) or set(entry) - {"client_id", "client_secret", "audience", "claims"}:
            raise ValueError(f"{where}: expected client_id, client_secret, audience, claims")
        cid, secret = entry.get("client_id"), entry.get("client_secret")
        if not isinstance(cid, str) or not cid or not isinstance(secret, str) or not secret:
            raise ValueError(f"{where}: client_id and client_secret must be non-empty strings")
        claims = entry.get("claims", {})
        if not isinstance(claims, dict) or {"iss", "aud", "sub", "exp", "iat"} & set(claims):
            raise ValueError(f"{where}.claims: a table of extra claims (not iss/aud/sub/exp/iat)")
        clients.append(DevClient(cid, secret, entry.get("audience", default_audience), claims))
    return clients


class _Client(ClientMixin):  # type: ignore[misc]
    def __init__(self, client: DevClient) -> None:
        self.dev = client

    def get_client_id(self) -> str:
        return self.dev.client_id

    def check_client_secret(self, client_secret: str) -> bool:
        return secrets.compare_digest(client_secret.encode(), self.dev.client_secret.encode())

    def check_endpoint_auth_method(self, method: str, endpoint: str) -> bool:
        return endpoint == "token" and method in ("client_secret_basic", "client_secret_post")

    def check_grant_type(self, grant_type: str) -> bool:
        return grant_type == "client_credentials"

    def get_allowed_scope(self, scope: str | None) -> str:
        return scope or ""


class _Grant(ClientCredentialsGrant):  # type: ignore[misc]
    TOKEN_ENDPOINT_AUTH_METHODS = ["client_secret_basic", "client_secret_post"]  # noqa: RUF012


class _Request(OAuth2Request):  # type: ignore[misc]
    def __init__(self, uri: str, headers: Mapping[str, str], form: dict[str, str]) -> None:
        super().__init__("POST", uri, headers=dict(headers))
        self.payload = BasicOAuth2Payload(form)
        self._form = form

    @property
    def form(self) -> dict[str, str]:
        return self._form

    @property
    def args(self) -> dict[str, str]:
        return {}


class DevIssuer(AuthorizationServer):  # type: ignore[misc]
    """The issuer's logic, without HTTP: discovery, JWKS, and token responses as (status, body, headers)."""

    def __init__(
        self, issuer: str, clients: list[DevClient], key: SigningKey, token_ttl_s: int = 3600
    ) -> None:
        super().__init__()
        logging.getLogger("authlib").setLevel(logging.WARNING)  # its debug log prints issued tokens
        self.issuer = issuer.rstrip("/")
        self.key = key
        self.token_ttl_s = token_ttl_s
        self._clients = {c.client_id: _Client(c) for c in clients}
        self.register_grant(_Grant)
        self.register_token_generator(
            "default", BearerTokenGenerator(self._access_token, expires_generator=token_ttl_s)
        )
        OpenIDProviderMetadata(self.discovery()).validate()

    def query_client(self, client_id: str) -> _Client | None:
        return self._clients.get(client_id)

    def save_token(self, token: dict[str, Any], request: OAuth2Request) -> None:
        pass  # JWTs are self-contained: nothing to store

    def send_signal(self, name: str, *args: Any, **kwargs: Any) -> None:
        pass

    def create_oauth2_request(self, request: _Request) -> _Request:
        return request

    def handle_response(
        self, status: int, body: Any, headers: list[tuple[str, str]]
    ) -> tuple[int, bytes, list[tuple[str, str]]]:
        return status, json.dumps(body).encode(), list(headers)

    def _access_token(self, client: _Client, grant_type: str, user: object, scope: str) -> str:
        now = int(time.time())
        claims = {
            **client.dev.claims,
            "iss": self.issuer,
            "aud": client.dev.audience,
            "sub": client.dev.client_id,
            "iat": now,
            "exp": now + self.token_ttl_s,
            "jti": secrets.token_hex(8),
        }
        if scope:
            claims["scope"] = scope
        return mint(claims, self.key)

    def token(
        self, headers: Mapping[str, str], form: dict[str, str]
    ) -> tuple[int, bytes, list[tuple[str, str]]]:
        """Answer ``POST /token`` (form already decoded)."""
        status, body, out = self.create_token_response(_Request(f"{self.issuer}/token", headers, form))
        return int(status), body, out

    def discovery(self) -> dict[str, Any]:
        return {
            "issuer": self.issuer,
            "jwks_uri": f"{self.issuer}/jwks",
            "token_endpoint": f"{self.issuer}/token",
            # Required by OIDC discovery; the dev issuer has no browser flow and answers it with 400.
            "authorization_endpoint": f"{self.issuer}/authorize",
            "grant_types_supported": ["client_credentials"],
            "token_endpoint_auth_methods_supported": ["client_secret_basic", "client_secret_post"],
            "response_types_supported": ["token"],
            "subject_types_supported": ["public"],
            # OIDC discovery makes RS256 mandatory here; this issuer signs access tokens only, with alg.
            "id_token_signing_alg_values_supported": sorted({self.key.alg, "RS256"}),
            "claims_supported": ["iss", "aud", "sub", "exp", "iat", "jti", "scope", "tenant", "groups"],
        }

    def jwks(self) -> dict[str, Any]:
        return {"keys": [self.key.public_jwk()]}


def _handler(issuer: DevIssuer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            if isinstance(self.request, ssl.SSLSocket):  # in this connection's thread, not the acceptor's
                self.request.settimeout(HANDSHAKE_TIMEOUT_S)
                self.request.do_handshake()
                self.request.settimeout(None)
            super().setup()

        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            if path == DISCOVERY_PATH:
                self._json(200, issuer.discovery())
            elif path == "/jwks":
                self._json(200, issuer.jwks(), cache="public, max-age=300")
            else:
                self._json(404 if path != "/authorize" else 400, {"error": "invalid_request"})

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            if urlsplit(self.path).path != "/token" or length > MAX_FORM_BYTES:
                self._json(404 if length <= MAX_FORM_BYTES else 413, {"error": "invalid_request"})
                return
            form = dict(parse_qsl(self.rfile.read(length).decode("utf-8", "replace")))
            status, body, headers = issuer.token(dict(self.headers.items()), form)
            self._send(status, body, headers)

        def _json(self, status: int, doc: object, cache: str = "no-store") -> None:
            self._send(status, json.dumps(doc).encode(), [("Content-Type", "application/json")], cache)

        def _send(
            self, status: int, body: bytes, headers: list[tuple[str, str]], cache: str = "no-store"
        ) -> None:
            self.send_response(status)
            for key, value in headers:
                if key.lower() not in ("content-length", "cache-control"):
                    self.send_header(key, value)
            self.send_header("Cache-Control", cache)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            # Method, path and status only: never headers (client_secret_basic) or a query string.
            log.debug("%s %s %s", self.command, urlsplit(self.path).path, code)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("http: %s", format % args)

    return Handler


class _Server(ThreadingHTTPServer):
    """Plain HTTP, or HTTPS only with ``tls`` (accepted sockets are wrapped; the handler shakes hands)."""

    def __init__(self, address: tuple[str, int], tls: ssl.SSLContext | None) -> None:
        self.tls = tls
        super().__init__(address, BaseHTTPRequestHandler)

    def get_request(self) -> tuple[Any, Any]:
        sock, address = super().get_request()
        if self.tls is None:
            return sock, address
        return self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A failed handshake or a dropped connection: one line, no traceback (nothing secret in it).
        log.debug("connection from %s failed: %s", client_address[0], sys.exc_info()[1])


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The server side of the issuer's HTTPS (TLS 1.2+); raises ``OSError`` for unreadable or bad files."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


def serve(
    clients: list[DevClient],
    key: SigningKey,
    host: str,
    port: int,
    issuer: str | None,
    token_ttl_s: int,
    tls: ssl.SSLContext | None = None,
) -> tuple[ThreadingHTTPServer, DevIssuer]:
    """Bind (port 0: any free port), then build the issuer for the bound URL (``https://`` with ``tls``,
    which then is the only protocol served); the caller runs ``serve_forever``."""
    server = _Server((host, port), tls)
    scheme = "http" if tls is None else "https"
    try:
        dev = DevIssuer(issuer or f"{scheme}://{host}:{server.server_address[1]}", clients, key, token_ttl_s)
    except BaseException:
        server.server_close()
        raise
    server.RequestHandlerClass = _handler(dev)
    return server, dev


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate oidc-dev", description="Run a development OIDC issuer.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9400, help="0: any free port")
    parser.add_argument("--clients", type=Path, required=True, help="clients file (.json or .toml)")
    parser.add_argument("--audience", default="kvgate", help="default aud of issued tokens")
    parser.add_argument("--alg", choices=["RS256", "ES256"], default="RS256", help="for a new key")
    parser.add_argument(
        "--key-file", type=Path, help="signing key (PEM), created if missing; default: a new key per run"
    )
    parser.add_argument("--token-ttl", type=int, default=3600, help="token lifetime (s)")
    parser.add_argument("--issuer", help="public issuer URL (default http(s)://HOST:PORT)")
    parser.add_argument("--tls-cert", type=Path, help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--tls-key", type=Path, help="with --tls-cert: its private key (PEM)")
    parser.add_argument("--ready-file", type=Path, help="write {issuer, port, pid} here (JSON) once serving")
    args = parser.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        clients = load_clients(args.clients, args.audience)
    except (OSError, ValueError) as exc:
        print(f"kvgate oidc-dev: {exc}", file=sys.stderr)
        return 2
    try:
        key = (
            SigningKey.load_or_create(args.key_file, args.alg)
            if args.key_file
            else SigningKey.generate(args.alg)
        )
    except (OSError, ValueError) as exc:
        print(f"kvgate oidc-dev: {exc}", file=sys.stderr)
        return 2
    try:
        tls = None if args.tls_cert is None else tls_context(args.tls_cert, args.tls_key)
    except OSError as exc:
        print(f"kvgate oidc-dev: --tls-cert/--tls-key: {exc}", file=sys.stderr)
        return 2
    try:
        server, issuer = serve(clients, key, args.host, args.port, args.issuer, args.token_ttl, tls)
    except (OSError, OverflowError) as exc:  # the port taken, out of range, an address not this machine's
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"kvgate oidc-dev: cannot listen on {args.host}:{args.port}: {reason}", file=sys.stderr)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, name="oidc-dev", daemon=True)
    thread.start()
    log.info("dev OIDC issuer %s serving %d clients (%s)", issuer.issuer, len(clients), issuer.key.alg)
    if args.ready_file is not None:
        tmp = args.ready_file.with_suffix(".tmp")
        ready = {"issuer": issuer.issuer, "port": server.server_address[1], "pid": os.getpid()}
        tmp.write_text(json.dumps(ready))
        tmp.replace(args.ready_file)
    stop.wait()
    server.shutdown()
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
