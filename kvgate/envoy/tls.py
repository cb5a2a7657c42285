"""The secure profile of the Envoy bootstrap: TLS on every hop, certificates from watched SDS files.

* OpenAI listener: HTTPS (ALPN h2, http/1.1); with ``client_certs`` a client certificate from the CA
  whose identity URI starts with ``spiffe://kvgate.local/client-`` is required, and Envoy sets
  ``x-forwarded-client-cert`` itself (``SANITIZE_SET``), so upstreams learn the caller's identity;
* ext_proc and engine clusters: mTLS with Envoy's own certificate; the peer must chain to the CA and
  carry exactly the expected identity URI SAN (``combined_validation_context``: SAN matcher inline, CA
  from SDS); SNI is the service name (also a DNS SAN of kvgate certificates);
* certificates: SDS from files (:func:`render_sds`, ``path_config_source`` + ``watched_directory``), so
  a certificate renamed into ``certs_dir`` (``kvgate certs issue``) is served to new connections
  without a restart; a mismatched pair caught mid-rotation is rejected and the previous one kept.

The admin port stays plaintext on 127.0.0.1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from certs.authority import identity_uri
from certs.errors import CertError
from certs.store import CERT_MODE, write_atomic
from contracts.errors import ConfigError

_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
#: SDS secret names: the certificate Envoy presents (listener and upstream client), the CA of the internal
#: services, and the CA of API clients (``CLIENTS_DIR``: no internal hop trusts it, so a client's
#: certificate opens the listener and nothing else).
CERT_SECRET = "envoy-edge"
CA_SECRET = "kvgate-ca"
CLIENT_CA_SECRET = "kvgate-client-ca"
#: The subdirectory of ``certs_dir`` holding the API clients' CA (``kvgate certs init --dir CERTS/clients``).
CLIENTS_DIR = "clients"


@dataclass(frozen=True, slots=True)
class EnvoyTls:
    """The secure profile: certificate files and the identities Envoy demands of its peers.

    ``certs_dir`` holds ``ca.pem`` and ``<cert_name>.pem``/``.key`` (as ``kvgate certs`` writes them) and
    the SDS files ``sds-*.yaml`` (:func:`render_sds`). ``client_certs``: the OpenAI listener requires a
    client certificate from the clients' CA (``certs_dir/clients/ca.pem``, a CA of its own that no internal
    service trusts) whose identity URI starts with ``client_identity_prefix``. Upstream
    certificates must carry exactly ``extproc_identity`` / ``engine_identity`` as a URI SAN; ``extproc_sni``
    and ``engine_sni`` are the server names Envoy sends.
    """

    certs_dir: str = "/etc/kvgate/certs"
    client_certs: bool = False
    cert_name: str = "envoy-edge"
    extproc_identity: str = identity_uri("extproc")
    engine_identity: str = identity_uri("engine")
    client_identity_prefix: str = identity_uri("client-")
    extproc_sni: str = "extproc"
    engine_sni: str = "engine"


def secure_profile(config: dict[str, Any], tls: EnvoyTls) -> dict[str, Any]:
    """The plaintext bootstrap ``config`` (modified in place) with the secure profile's transport sockets
    and the node identity SDS needs (Envoy refuses file-based SDS without node id and cluster)."""
    resources = config["static_resources"]
    (listener,) = resources["listeners"]
    (chain,) = listener["filter_chains"]
    downstream: dict[str, Any] = {
        "@type": _TLS + "DownstreamTlsContext",
        "common_tls_context": {
            "alpn_protocols": ["h2", "http/1.1"],
            "tls_certificate_sds_secret_configs": [_sds_ref(tls, CERT_SECRET)],
        },
    }
    if tls.client_certs:
        downstream["require_client_certificate"] = True
        downstream["common_tls_context"]["combined_validation_context"] = _peer_validation(
            tls, {"prefix": tls.client_identity_prefix}, CLIENT_CA_SECRET
        )
        hcm = chain["filters"][0]["typed_config"]
        # The client's identity reaches the ext_proc and the engine in x-forwarded-client-cert, set by
        # Envoy only (a client-sent one is replaced).
        hcm["forward_client_cert_details"] = "SANITIZE_SET"
        hcm["set_current_client_cert_details"] = {"uri": True}
    chain["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": downstream}
    peers = {"kvgate_extproc": (tls.extproc_sni, tls.extproc_identity, ["h2"])}
    peers["kvgate_engines"] = (tls.engine_sni, tls.engine_identity, [])
    for cluster in resources["clusters"]:
        # The failure-log clusters are single ext_proc replicas; the JWKS cluster is not ours.
        name = "kvgate_extproc" if cluster["name"].startswith("kvgate_extproc_log_") else cluster["name"]
        if name not in peers:
            continue
        sni, identity, alpn = peers[name]
        common: dict[str, Any] = {"alpn_protocols": alpn} if alpn else {}
        common["tls_certificate_sds_secret_configs"] = [_sds_ref(tls, CERT_SECRET)]
        common["combined_validation_context"] = _peer_validation(tls, {"exact": identity})
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {"@type": _TLS + "UpstreamTlsContext", "sni": sni, "common_tls_context": common},
        }
    return config


def _peer_validation(tls: EnvoyTls, uri_matcher: dict[str, str], ca: str = CA_SECRET) -> dict[str, Any]:
    """Chain to the CA secret ``ca`` and carry a URI SAN matching ``uri_matcher`` (a StringMatcher)."""
    return {
        "default_validation_context": {
            "match_typed_subject_alt_names": [{"san_type": "URI", "matcher": uri_matcher}]
        },
        "validation_context_sds_secret_config": _sds_ref(tls, ca),
    }


def _sds_ref(tls: EnvoyTls, secret: str) -> dict[str, Any]:
    """An SDS secret read from ``certs_dir/sds-<secret>.yaml``; the directory is watched for renames."""
    return {
        "name": secret,
        "sds_config": {
            "path_config_source": {
                "path": f"{tls.certs_dir}/{sds_file_name(secret)}",
                "watched_directory": {"path": tls.certs_dir},
            },
            "resource_api_version": "V3",
        },
    }


def sds_file_name(secret: str) -> str:
    return f"sds-{secret}.yaml"


def render_sds(tls: EnvoyTls) -> dict[str, str]:
    """The SDS files of the secure profile: file name (in ``certs_dir``) -> YAML text.

    Each file holds one ``Secret`` naming PEM files by path, with ``watched_directory`` set to
    ``certs_dir``: a file renamed into it makes Envoy re-read the certificate and key together and
    check they match before serving them (a mismatched pair, caught mid-rotation, is rejected).
    """
    d = tls.certs_dir
    watched = {"path": d}
    secrets = {
        CERT_SECRET: {
            "tls_certificate": {
                "certificate_chain": {"filename": f"{d}/{tls.cert_name}.pem"},
                "private_key": {"filename": f"{d}/{tls.cert_name}.key"},
                "watched_directory": watched,
            }
        },
        CA_SECRET: {
            "validation_context": {"trusted_ca": {"filename": f"{d}/ca.pem"}, "watched_directory": watched}
        },
    }
    if tls.client_certs:
        clients = f"{d}/{CLIENTS_DIR}"
        secrets[CLIENT_CA_SECRET] = {
            "validation_context": {
                "trusted_ca": {"filename": f"{clients}/ca.pem"},
                "watched_directory": {"path": clients},
            }
        }
    return {
        sds_file_name(name): yaml.safe_dump(
            {"resources": [{"@type": _TLS + "Secret", "name": name, **body}]}, sort_keys=False, width=100
        )
        for name, body in secrets.items()
    }


def write_sds(tls: EnvoyTls) -> list[Path]:
    """Write :func:`render_sds`'s files into ``tls.certs_dir`` atomically (Envoy may be watching it);
    :class:`ConfigError` naming the file when one cannot be written (e.g. no such directory)."""
    paths = []
    for name, text in render_sds(tls).items():
        path = Path(tls.certs_dir) / name
        try:
            write_atomic(path, text.encode(), CERT_MODE)
        except CertError as exc:
            raise ConfigError(str(exc)) from exc
        paths.append(path)
    return paths
