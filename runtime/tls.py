"""TLS material that follows file rotation, for every daemon: gRPC server credentials, ``ssl`` server
contexts, and client contexts, credentials and channels (the ext_proc's scraper, slot restorer
(:mod:`extproc.control.restore`) and feeds; federation; the migration proxy; the kvcached clients; etcd).

:class:`ReloadingServerCerts` is the certificate fetcher of ``grpc.dynamic_ssl_server_credentials``:
gRPC calls it before every new TLS handshake; it compares the files' (inode, size, mtime) with what it
served last and re-reads only when one changed. A new certificate is adopted only once its key matches
and both parse, so a rotation caught half way (new key, old certificate) keeps the current pair in force
until the other file lands. Established connections keep the certificate they were opened with.

:class:`ReloadingClientCerts` is the same for a client (the migration proxy; the scraper, the
ext_proc's engine requests and the slot restorer through :func:`client_tls`): each ``context()`` /
``credentials()`` call stats its three files and rebuilds the ``ssl.SSLContext`` and the gRPC channel
credentials only when one changed and the new pair is consistent; a caller that passes the current context
per request (aiohttp keys pooled connections by it) opens new connections with the new certificate while
pooled ones finish with the old.

:class:`ReloadingServerContext` is the rule of :class:`ReloadingServerCerts` for an ``ssl.SSLContext``
listener (the agent's admin API, :mod:`agent.admin`): its ``sni_callback``, run at every ClientHello,
stats the files and hands the handshake the current context.

:class:`RotatingChannel` makes a long-lived ``grpc.aio`` client channel follow a
:class:`ReloadingClientCerts` (the ext_proc's feed channels, federation's subscriptions, the kvcached
TCP API client, the etcd clients, :func:`secure_channel`). gRPC's Python client has no certificate
fetcher: ``grpc.dynamic_ssl_server_credentials`` exists for servers only, a channel's credentials are
fixed when it is created, and it reconnects with them (the C core's certificate providers are not
exposed; ``grpc.experimental``'s custom signer replaces the signature, not the certificate). So the
channel is rebuilt: every new call (a unary call, a stream) stats the files through
:meth:`ReloadingClientCerts.credentials` and, when new material was adopted, is placed on a fresh
``grpc.aio`` channel made with it. Calls already running stay on the channel they started on (a healthy
feed or watch stream is not cut); a replaced channel is closed once its last call has ended. Timers are
not needed: a connection's certificate matters only at its handshake, and every handshake after a
rotation belongs to a call made after it (a stream broken by the peer ends, and its retry is a new
call). Callers keep one object with the ``grpc.aio.Channel`` methods they use (``unary_unary`` ...
``close``); stubs made from it once (etcd3aio's) follow too, since each multi-callable looks the channel
up per call. :meth:`ReloadingClientCerts.pem` hands the validated PEM bytes to clients that are neither
``ssl`` nor gRPC (kvcached's QUIC peers, :mod:`kvcached.peers`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

import grpc
import grpc.aio

from certs.authority import key_matches, load_cert_pem, load_key_pem
from certs.errors import CertError
from contracts.errors import ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")

_Signature = tuple[tuple[int, int, int], ...]


def _changed(stat: Callable[[], _Signature], *known: _Signature | None) -> _Signature | None:
    """The files' signature (``stat``) when it is none of ``known`` (the one in force, the one last
    rejected); ``None`` when it is one of them or a file cannot be stat'ed (a rotation under way)."""
    try:
        current = stat()
    except OSError:
        return None
    return None if current in known else current


def _signature(*paths: Path) -> _Signature:
    """What the reloaders compare to see whether a file changed: inode, size and mtime of each path
    (``OSError`` when one is missing)."""
    out = []
    for path in paths:
        st = os.stat(path)
        out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _read_checked(cert: Path, key: Path, ca: Path | None = None) -> tuple[bytes, bytes, bytes | None]:
    """The PEM bytes of ``cert``, ``key`` (and ``ca``), read once; :class:`CertError` when one does not
    parse or the key does not match the certificate, ``OSError`` when one cannot be read."""
    cert_pem, key_pem = cert.read_bytes(), key.read_bytes()
    ca_pem = ca.read_bytes() if ca is not None else None
    if not key_matches(load_cert_pem(cert_pem, str(cert)), load_key_pem(key_pem, str(key))):
        raise CertError(f"{key} does not match {cert}")
    if ca is not None and ca_pem is not None:
        load_cert_pem(ca_pem, str(ca))
    return cert_pem, key_pem, ca_pem


class _Reloader(Generic[T]):
    """The rule every reloader here follows (module doc): on use, the files' signature is compared with
    the one in force and the one last rejected (:func:`_changed`); on a change, :meth:`_load` reads and
    checks them, and what it made is adopted only when consistent (the key matches the certificate, no
    file changed while read). Otherwise the material in force stays, and the failure is logged once per
    bad state (file names only) and retried when the files change again. A subclass sets
    ``_signature`` from its first load."""

    _signature: _Signature

    def __init__(self, paths: tuple[Path, ...], cert: Path, where: str) -> None:
        self._paths = paths
        self._cert = cert
        self._where = where
        self._rejected: _Signature | None = None
        #: How many times new material was adopted (also a generation number: it changes with it).
        self.reloads = 0

    def _stat(self) -> _Signature:
        return _signature(*self._paths)

    def _load(self) -> tuple[_Signature, T | None, str]:
        """``(signature, material, "")`` of a consistent read, or ``(signature, None, reason)``
        (``signature`` ``()`` when the files could not be read or changed while being read: retried)."""
        raise NotImplementedError

    def _reload(self) -> T | None:
        """New material when the files changed and are usable (now in force), else ``None``."""
        if _changed(self._stat, self._signature, self._rejected) is None:
            return None
        signature, loaded, error = self._load()
        if loaded is None:
            self._rejected = signature
            log.warning("%s TLS: keeping the current certificate: %s", self._where, error)
            return None
        self._signature = signature
        self.reloads += 1
        log.info("%s TLS: certificate reloaded from %s", self._where, self._cert)
        return loaded


@dataclass(frozen=True, slots=True)
class ServerTlsFiles:
    """PEM files of a TLS server that requires client certificates: its certificate chain, its private
    key and the CA bundle client certificates must chain to."""

    cert: Path
    key: Path
    client_ca: Path


class ReloadingServerCerts(_Reloader[Any]):
    """Certificate configuration fetcher for ``grpc.dynamic_ssl_server_credentials`` (see module doc).

    Construction reads the files once and raises :class:`ConfigError` if they are unusable; later
    failures are logged (file names only) and leave the current certificate in force.
    """

    def __init__(self, files: ServerTlsFiles) -> None:
        super().__init__((files.cert, files.key, files.client_ca), files.cert, "extproc")
        self._files = files
        self._lock = threading.Lock()
        signature, config, error = self._load()
        if config is None:
            raise ConfigError(f"extproc TLS: {error}")
        self._signature = signature
        self.initial: Any = config

    def __call__(self) -> Any:
        """A new ``ServerCertificateConfiguration`` if the files changed and are valid, else ``None``."""
        with self._lock:  # gRPC may call from several handshake threads at once
            return self._reload()

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials that require a client certificate and follow the files."""
        return grpc.dynamic_ssl_server_credentials(self.initial, self, require_client_authentication=True)

    def _load(self) -> tuple[_Signature, Any, str]:
        """The files are stat'ed before and after reading; a change in between means a rotation was under
        way, and the read is discarded (the next handshake tries again)."""
        f = self._files
        try:
            before = self._stat()
            cert, key, ca = _read_checked(f.cert, f.key, f.client_ca)
            if self._stat() != before:
                return (), None, "files changed while being read"
        except OSError as exc:
            return (), None, f"cannot read {exc.filename}: {exc.strerror}"
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


class Pem(NamedTuple):
    """A consistent set of PEM bytes: the CA bundle, the certificate chain and its private key."""

    ca: bytes
    cert: bytes
    key: bytes


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


class ReloadingClientCerts(_Reloader[tuple[ssl.SSLContext, grpc.ChannelCredentials, Pem]]):
    """A client's TLS material that follows file rotation (module doc): ``files`` needs all three of
    ``ca``, ``cert`` and ``key``; ``prepare`` is applied to every context built (e.g. a server-role check,
    :func:`runtime.identity.check_server_role`). Construction raises :class:`ConfigError` (naming
    ``where``) if the files are unusable; later failures are logged (file names only) and leave the
    current material in force. Not thread-safe: call from one event loop."""

    def __init__(
        self,
        files: ClientTlsFiles,
        *,
        where: str,
        prepare: Callable[[ssl.SSLContext], ssl.SSLContext] | None = None,
    ) -> None:
        if files.ca is None or files.cert is None or files.key is None:
            raise ConfigError(f"{where} TLS: a CA, a certificate and a key are needed")
        super().__init__((files.ca, files.cert, files.key), files.cert, where)
        self._prepare = prepare
        signature, loaded, error = self._load()
        if loaded is None:
            raise ConfigError(f"{where} TLS: {error}")
        self._signature = signature
        self._context, self._credentials, self._pem = loaded

    def context(self) -> ssl.SSLContext:
        """The current client context (re-read first if the files changed)."""
        self._refresh()
        return self._context

    def credentials(self) -> grpc.ChannelCredentials:
        """The current gRPC channel credentials, same identity and CA (re-read first if changed)."""
        self._refresh()
        return self._credentials

    def pem(self) -> Pem:
        """The current CA, certificate and key bytes, checked to match (re-read first if changed)."""
        self._refresh()
        return self._pem

    def _refresh(self) -> None:
        loaded = self._reload()
        if loaded is not None:
            self._context, self._credentials, self._pem = loaded

    def _load(self) -> tuple[_Signature, tuple[ssl.SSLContext, grpc.ChannelCredentials, Pem] | None, str]:
        """Like :meth:`ReloadingServerCerts._load`: a read during which a file changed is discarded."""
        ca, cert, key = self._paths
        try:
            before = self._stat()
            cert_pem, key_pem, ca_pem = _read_checked(cert, key, ca)
        except OSError as exc:
            return (), None, f"cannot read {exc.filename}: {exc.strerror}"
        except CertError as exc:
            return before, None, str(exc)
        assert ca_pem is not None
        try:  # ssl reads the files itself: the stat after tells whether it read what was checked
            context = client_context(ClientTlsFiles(ca, cert, key), where=self._where)
            if self._stat() != before:
                return (), None, "files changed while being read"
        except ConfigError as exc:  # its message names ``where`` already: the cause alone
            return before, None, str(exc.__cause__ or exc)
        except OSError as exc:
            return before, None, str(exc)
        if self._prepare is not None:
            context = self._prepare(context)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca_pem, private_key=key_pem, certificate_chain=cert_pem
        )
        return before, (context, credentials, Pem(ca_pem, cert_pem, key_pem)), ""


#: A client's TLS setting as its users take it: a fixed context, or one that follows rotation.
ClientTls = ssl.SSLContext | ReloadingClientCerts


def client_tls(files: ClientTlsFiles, *, where: str) -> ClientTls:
    """The client TLS of ``files``: a :class:`ReloadingClientCerts` when all three files are given (the
    certificate follows rotation), else a fixed :func:`client_context` (CA only, or the system CAs)."""
    if files.ca is not None and files.cert is not None and files.key is not None:
        return ReloadingClientCerts(files, where=where)
    return client_context(files, where=where)


def current_context(tls: ClientTls) -> ssl.SSLContext:
    """The context to open the next connection with (re-read first where it follows rotation)."""
    return tls.context() if isinstance(tls, ReloadingClientCerts) else tls


class ReloadingServerContext(_Reloader[ssl.SSLContext]):
    """An ``ssl.SSLContext`` TLS listener (aiohttp) whose certificate follows file rotation, the rule of
    :class:`ReloadingServerCerts`: ``build(files)`` makes a context from the files (verify mode, client
    CA); the listener keeps :attr:`context`, whose ``sni_callback`` (called by OpenSSL at every
    ClientHello, with or without SNI) stats the three files, rebuilds when one changed and the key
    matches the certificate, and hands the handshake the current context. A half-done rotation keeps the
    current pair; established connections keep theirs. Construction raises what ``build`` raises for
    unusable files. Not thread-safe: one event loop."""

    def __init__(
        self, files: ServerTlsFiles, build: Callable[[ServerTlsFiles], ssl.SSLContext], *, where: str
    ) -> None:
        super().__init__((files.cert, files.key, files.client_ca), files.cert, where)
        self._files = files
        self._build = build
        try:  # stat'ed first: a rotation during the build is caught by the first handshake
            before = self._stat()
        except OSError:
            before = ()  # ``build`` says what is wrong
        #: The listener's context (give it to the server); also the one in force until a rotation.
        self.context = build(files)
        self._signature = before
        self.context.sni_callback = self._on_hello
        self._current = self.context

    def _on_hello(
        self, conn: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, listener: ssl.SSLContext
    ) -> None:
        loaded = self._reload()
        if loaded is not None:
            self._current = loaded
        if self._current is not self.context:
            conn.context = self._current

    def _load(self) -> tuple[_Signature, ssl.SSLContext | None, str]:
        f = self._files
        try:
            before = self._stat()
        except OSError as exc:
            return (), None, f"cannot read {exc.filename}: {exc.strerror}"
        # Any unusable state keeps the pair in force: raising here would fail the handshake.
        try:
            _read_checked(f.cert, f.key)
            context = self._build(f)  # ssl reads the files itself: the stat after tells whether it read those
            if self._stat() != before:
                return (), None, "files changed while being read"  # the next handshake tries again
        except Exception as exc:
            return before, None, str(exc)
        return before, context, ""


#: gRPC channel options, as ``grpc.aio.secure_channel`` takes them.
ChannelOptions = Sequence[tuple[str, Any]]


class RotatingChannel:
    """A ``grpc.aio`` client channel to ``target`` whose client certificate follows ``tls`` (module doc):
    each new call runs on a channel made with the material in force when it started; a channel whose
    material was replaced is closed once its last call has ended. Offers the ``grpc.aio.Channel`` methods
    (``unary_unary`` ... ``close``, ``async with``). One event loop."""

    def __init__(self, target: str, tls: ReloadingClientCerts, options: ChannelOptions = ()) -> None:
        self._target, self._tls, self._options = target, tls, list(options)
        self._channel: Any = grpc.aio.secure_channel(target, tls.credentials(), options=self._options)
        self._generation = tls.reloads
        self._calls: dict[Any, int] = {}  # channel -> calls running on it (the current one or retired)
        self._closing: set[Any] = set()  # tasks closing retired channels
        self._closed = False
        #: How many times the channel was replaced after a rotation.
        self.rebuilds = 0

    def current(self) -> Any:
        """The channel for the next call (rebuilt first if ``tls`` adopted new material)."""
        credentials = self._tls.credentials()
        if self._tls.reloads != self._generation:
            old = self._channel
            self._channel = grpc.aio.secure_channel(self._target, credentials, options=self._options)
            self._generation = self._tls.reloads
            self.rebuilds += 1
            if not self._calls.get(old):
                self._close_later(old)
        return self._channel

    def _track(self, channel: Any, call: Any) -> Any:
        self._calls[channel] = self._calls.get(channel, 0) + 1
        call.add_done_callback(lambda _call: self._ended(channel))
        return call

    def _ended(self, channel: Any) -> None:
        left = self._calls.get(channel, 0) - 1
        if left > 0:
            self._calls[channel] = left
            return
        self._calls.pop(channel, None)
        if channel is not self._channel and not self._closed:
            self._close_later(channel)

    def _close_later(self, channel: Any) -> None:
        try:
            task = asyncio.get_running_loop().create_task(channel.close())
        except RuntimeError:  # no loop (interpreter shutting down): gRPC frees it with the object
            return
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _method(self, kind: str, method: str, *args: Any, **kwargs: Any) -> _RotatingMethod:
        return _RotatingMethod(self, kind, method, args, kwargs)

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> _RotatingMethod:
        return self._method("unary_unary", method, *args, **kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> _RotatingMethod:
        return self._method("unary_stream", method, *args, **kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> _RotatingMethod:
        return self._method("stream_unary", method, *args, **kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> _RotatingMethod:
        return self._method("stream_stream", method, *args, **kwargs)

    def get_state(self, try_to_connect: bool = False) -> Any:
        return self.current().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: Any) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    async def close(self, grace: float | None = None) -> None:
        """Close every channel (running calls are cancelled after ``grace`` seconds)."""
        self._closed = True
        channels = {self._channel, *self._calls}
        self._calls.clear()
        for channel in channels:
            await channel.close(grace)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def __aenter__(self) -> RotatingChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _RotatingMethod:
    """A multi-callable of :class:`RotatingChannel`: each call goes on the channel current then."""

    def __init__(
        self, owner: RotatingChannel, kind: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self._owner, self._kind, self._method, self._args, self._kwargs = owner, kind, method, args, kwargs
        self._bound: tuple[Any, Any] | None = None  # (channel, its multi-callable)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        channel = self._owner.current()
        bound = self._bound
        if bound is None or bound[0] is not channel:
            made = getattr(channel, self._kind)(self._method, *self._args, **self._kwargs)
            bound = self._bound = (channel, made)
        return self._owner._track(channel, bound[1](*args, **kwargs))


def secure_channel(
    target: str, tls: grpc.ChannelCredentials | ReloadingClientCerts, options: ChannelOptions = ()
) -> Any:
    """A ``grpc.aio`` channel to ``target`` over TLS: fixed ``tls`` credentials, or a
    :class:`RotatingChannel` that follows a :class:`ReloadingClientCerts`."""
    if isinstance(tls, ReloadingClientCerts):
        return RotatingChannel(target, tls, options)
    return grpc.aio.secure_channel(target, tls, options=list(options))
