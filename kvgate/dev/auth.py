"""``kvgate up --auth``: the development identity setup in front of the local stack.

It starts the dev OIDC issuer (:mod:`kvgate.dev.oidc`) as a child on a free port, writes its clients
file and an API key file into the work directory, and returns the gateway config's ``[auth]`` and
``[[tenants]]`` sections pointing at them (Envoy then fetches the issuer's JWKS remotely). By default
one tenant ``dev`` (every model, 50 req/s, 200k tokens/min), one client ``dev`` whose tokens carry
``tenant = "dev"``, and one API key for it; the end-to-end tests pass their own tenants and clients.

In the secure profile (``kvgate up --secure --auth``) the issuer serves HTTPS only with the ``oidc``
certificate of the stack's CA: its URL is ``https://127.0.0.1:PORT``, and clients of its token endpoint
(and Envoy, for the JWKS) trust ``DevAuth.ca_file``.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from certs.store import LeafFiles
from extproc.admission.keys import ApiKey, hash_key, new_key, new_key_id, write_keys
from kvgate.dev.supervisor import Service

DEV_TENANT: dict[str, Any] = {
    "id": "dev",
    "models": ["*"],
    "match": {"claims": {"tenant": "dev"}},
    "rate": {"requests_per_s": 50, "burst": 100},
    "tokens": {"per_minute": 200_000},
}


@dataclass(frozen=True, slots=True)
class StackAuth:
    """What ``kvgate up --auth`` sets up. ``tenants``: ``[[tenants]]`` tables; ``clients``: the dev
    issuer's clients (empty: one generated client ``dev`` of tenant ``dev``); ``settings``: extra
    ``[auth]`` keys (``settle``, ``default_max_tokens``); ``dev_key``: also create one API key for the
    first tenant."""

    tenants: tuple[dict[str, Any], ...] = (DEV_TENANT,)
    clients: tuple[dict[str, Any], ...] = ()
    audience: str = "kvgate"
    settings: dict[str, Any] = field(default_factory=dict)
    dev_key: bool = True


@dataclass(frozen=True, slots=True)
class DevAuth:
    """The running setup: the issuer's URL and signing key file, the client credentials, the API key
    file and the dev key (shown once by ``kvgate up``), the config sections to add, and the CA that
    signed the issuer's certificate (``None``: plain HTTP)."""

    issuer: str
    key_file: Path
    clients: tuple[dict[str, Any], ...]
    api_keys_file: Path
    dev_key: str | None
    auth_section: dict[str, Any]
    tenants: tuple[dict[str, Any], ...]
    ca_file: Path | None = None

    def banner(self) -> list[str]:
        """What ``kvgate up --auth`` prints (once, to its terminal; never logged)."""
        client = self.clients[0]
        cid, secret = client["client_id"], client["client_secret"]
        cacert = "" if self.ca_file is None else f"--cacert {self.ca_file} "
        lines = [
            f"  OIDC issuer: {self.issuer}  client: {cid}  secret: {secret}",
            f"  a token: curl -s {cacert}-u {cid}:{secret} -d grant_type=client_credentials "
            f"{self.issuer}/token",
        ]
        if self.dev_key is not None:
            lines.append(f"  API key of tenant {self.tenants[0]['id']} (shown once): {self.dev_key}")
        lines.append(f"  more keys: kvgate apikey create --file {self.api_keys_file} --tenant TENANT")
        return lines


def start_dev_auth(
    options: StackAuth,
    workdir: Path,
    spawn: Callable[[str, list[str], Path, float], Service[Any]],
    tls: LeafFiles | None = None,
) -> DevAuth:
    """Start the dev issuer and write the client and key files; returns what the config needs.
    ``spawn(name, argv, ready_file, timeout_s)`` starts a child that is ready once it wrote its PID into
    ``ready_file``; the issuer's port is then pinned, so a restarted issuer serves the same URL (and
    signs with the same key file). ``tls``: the issuer's certificate, key and CA; it then serves HTTPS
    only and its URL (hence ``jwks_uri``) is ``https://``."""
    clients = options.clients or (
        {"client_id": "dev", "client_secret": secrets.token_urlsafe(24), "claims": {"tenant": "dev"}},
    )
    clients_file = workdir / "oidc_clients.json"
    _write_private(clients_file, json.dumps({"clients": list(clients)}, indent=2))
    ready = workdir / "oidc.ready.json"

    def argv(port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "kvgate.dev.oidc",
            "--port",
            str(port),
            "--clients",
            str(clients_file),
            "--audience",
            options.audience,
            "--key-file",
            str(workdir / "oidc_key.pem"),
            "--ready-file",
            str(ready),
            *([] if tls is None else ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]),
        ]

    issuer_child = spawn("oidc", argv(0), ready, 60)
    started = issuer_child.await_ready()
    issuer_child.argv = argv(int(started["port"]))  # a restart serves the same issuer URL
    issuer = str(started["issuer"])
    keys_file = workdir / "api_keys.json"
    dev_key = None
    records: list[ApiKey] = []
    if options.dev_key and options.tenants:
        dev_key = new_key()
        records.append(
            ApiKey(new_key_id(), str(options.tenants[0]["id"]), hash_key(dev_key), int(time.time()), "dev")
        )
    write_keys(keys_file, records)
    section = {
        "jwt": {"issuer": issuer, "audiences": [options.audience], "jwks_uri": f"{issuer}/jwks"},
        "api_keys_file": str(keys_file),
        **options.settings,
    }
    return DevAuth(
        issuer,
        workdir / "oidc_key.pem",
        tuple(clients),
        keys_file,
        dev_key,
        section,
        options.tenants,
        None if tls is None else tls.ca,
    )


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
