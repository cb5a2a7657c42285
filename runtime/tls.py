"""TLS material of the ext_proc process: gRPC server credentials that follow file rotation, and the
client contexts the metrics scraper uses towards engines that require client certificates and the slot
restorer towards agents' admin APIs (:mod:`extproc.control.restore`).

:class:`ReloadingServerCerts` is the certificate fetcher of ``grpc.dynamic_ssl_server_credentials``:
gRPC calls it before every new TLS handshake; it compares the files' (inode, size, mtime) with what it
served last and re-reads only when one changed. A new certificate is adopted only once its key matches
and both parse, so a rotation caught half way (new key, old certificate) keeps the current pair in force
until the other file lands. Established connections keep the certificate they were opened with.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from certs.authority import key_matches, load_cert_pem, load_key_pem
from certs.errors import CertError
from contracts.errors import ConfigError

log = logging.getLogger(__name__)

_Signature = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True, slots=True)
class ServerTlsFiles:
    """PEM files of a TLS server that requires client certificates: its certificate chain, its private
    key and the CA bundle client certificates must chain to."""

    cert: Path
    key: Path
    client_ca: Path


class ReloadingServerCerts:
    """Certificate configuration fetcher for ``grpc.dynamic_ssl_server_credentials`` (see module doc).

    Construction reads the files once and raises :class:`ConfigError` if they are unusable; later
    failures are logged (file names only) and leave the current certificate in force.
    """

    def __init__(self, files: ServerTlsFiles) -> None:
        self._files = files
        self._lock = threading.Lock()
        signature, config, error = self._load()
        if config is None:
            raise ConfigError(f"extproc TLS: {error}")
        self._signature: _Signature = signature
        self._rejected: _Signature | None = None
        self.initial: Any = config
        #: How many times a new certificate was adopted.
        self.reloads = 0

    def __call__(self) -> Any:
        """A new ``ServerCertificateConfiguration`` if the files changed and are valid, else ``None``."""
        with self._lock:  # gRPC may call from several handshake threads at once
            try:
                current = self._stat()
            except OSError:
                return None
            if current in (self._signature, self._rejected):
                return None
            signature, config, error = self._load()
            if config is None:
                self._rejected = signature  # logged once per bad state, retried when the files change
                log.warning("extproc TLS: keeping the current certificate: %s", error)
                return None
            self._signature = signature
            self.reloads += 1
            log.info("extproc TLS: certificate reloaded from %s", self._files.cert)
            return config

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials that require a client certificate and follow the files."""
        return grpc.dynamic_ssl_server_credentials(self.initial, self, require_client_authentication=True)

    def _stat(self) -> _Signature:
        out = []
        for path in (self._files.cert, self._files.key, self._files.client_ca):
            st = os.stat(path)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def _load(self) -> tuple[_Signature, Any, str]:
        """``(signature, configuration, "")`` of a consistent read, or ``(signature, None, reason)``.

        The files are stat'ed before and after reading; a change in between means a rotation was under
        way, and the read is discarded (the next handshake tries again).
        """
        f = self._files
        try:
            before = self._stat()
            cert, key, ca = f.cert.read_bytes(), f.key.read_bytes(), f.client_ca.read_bytes()
            if self._stat() != before:
                return (), None, "files changed while being read"
        except OSError as exc:
            return (), None, f"cannot read {exc.filename}: {exc.strerror}"
        try:
            if not key_matches(load_cert_pem(cert, str(f.cert)), load_key_pem(key, str(f.key))):
                return before, None, f"{f.key} does not match {f.cert}"
            load_cert_pem(ca, str(f.client_ca))
        except CertError as exc:
            return before, None, str(exc)
        return before, grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca), ""


@dataclass(frozen=True, slots=True)
class ClientTlsFiles:
    """TLS client settings: ``ca`` (CA bundle that verifies servers; ``None``: the system's) and an
    optional client certificate + key presented to servers that ask for one."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None


def client_context(files: ClientTlsFiles, *, where: str = "scrape") -> ssl.SSLContext:
    """An ``ssl.SSLContext`` verifying servers (hostname included) and presenting the client cert;
    :class:`ConfigError` (naming the config section ``where``) if the files are unusable."""
    try:
        ctx = ssl.create_default_context(cafile=None if files.ca is None else str(files.ca))
        if files.cert is not None and files.key is not None:
            ctx.load_cert_chain(str(files.cert), str(files.key))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{where} TLS: cannot load certificates: {exc}") from exc
    return ctx


def channel_credentials(files: ClientTlsFiles) -> grpc.ChannelCredentials:
    """mTLS credentials for feeds: ``files.ca`` verifies agents, ``files.cert``/``key`` identify us."""
    return grpc.ssl_channel_credentials(
        root_certificates=files.ca.read_bytes() if files.ca else None,
        private_key=files.key.read_bytes() if files.key else None,
        certificate_chain=files.cert.read_bytes() if files.cert else None,
    )
