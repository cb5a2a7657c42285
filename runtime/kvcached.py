"""The client of a node's kvcached daemon (its local API, :mod:`contracts.kvcached`), for agents and tools."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import msgspec

from contracts.errors import MSGPACK_ERRORS
from contracts.kvcached import (
    CONTAINS,
    DELETE,
    GET,
    MAX_BLOCK_BYTES_DEFAULT,
    MESSAGE_SLACK,
    PUT,
    STATS,
    BadRequest,
    ContainsReply,
    ContainsRequest,
    DeleteReply,
    DeleteRequest,
    GetReply,
    GetRequest,
    KvcachedError,
    PutReply,
    PutRequest,
    StatsReply,
    StatsRequest,
)
from contracts.versions import DIGEST_VERSION, digest_matches
from runtime.tls import ClientTlsFiles, ReloadingClientCerts, channel_credentials, secure_channel
from runtime.tracing.tracer import current_headers

Req = TypeVar("Req", bound=msgspec.Struct)
log = logging.getLogger(__name__)
_encoder = msgspec.msgpack.Encoder()


class KvcachedClient:
    """An asyncio client of the local API. ``target``: ``unix:/path/to.sock`` or ``host:port`` (TCP,
    which needs ``ca``, ``cert`` and ``key``: the daemon requires a client certificate; the certificate
    follows rotation of the files, :class:`~runtime.tls.ReloadingClientCerts`).
    ``server_name`` overrides the name checked against the daemon's certificate. ``timeout_s``: the
    deadline of each call (``None``: none). Errors: :class:`BadRequest` for ``INVALID_ARGUMENT`` (the
    message is the daemon's reason), :class:`KvcachedError` for any other failure."""

    def __init__(
        self,
        target: str,
        *,
        ca: Path | None = None,
        cert: Path | None = None,
        key: Path | None = None,
        server_name: str | None = None,
        timeout_s: float | None = 10.0,
        max_message_bytes: int = MAX_BLOCK_BYTES_DEFAULT + MESSAGE_SLACK,
    ) -> None:
        options: list[tuple[str, str | int]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # A restarted daemon is reached again within a second of being up: the node's own daemon is
            # cheap to redial, and gRPC's default back-off (1 s, x1.6, up to 120 s) kept clients away
            # ~1.6 s after a restart under load (tests/faults/test_kvcached.py).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        self._channel: Any
        if ca is not None and cert is not None and key is not None:
            # The certificate follows rotation: each call after one is made on a channel that presents
            # the new pair (runtime.tls.RotatingChannel); calls under way finish on theirs.
            tls = ReloadingClientCerts(ClientTlsFiles(ca, cert, key), where="kvcached client")
            self._channel = secure_channel(target, tls, options)
        elif ca is not None:  # no certificate of its own: the daemon refuses it (tests use that)
            self._channel = grpc.aio.secure_channel(
                target, channel_credentials(ClientTlsFiles(ca)), options=options
            )
        else:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        self._timeout_s = timeout_s

    async def _call(self, method: str, request: msgspec.Struct, reply: type[Req]) -> Req:
        call = self._channel.unary_unary(method)
        try:
            # A traced caller's span (the agent's slot restore) goes on as the parent of kvcached's.
            trace = current_headers()
            metadata = tuple(trace.items()) if trace else None
            raw = await call(_encoder.encode(request), timeout=self._timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.INVALID_ARGUMENT:
                raise BadRequest(exc.details() or "invalid argument") from exc
            raise KvcachedError(f"{method}: {exc.code().name}: {exc.details()}") from exc
        try:
            return msgspec.msgpack.decode(raw, type=reply)
        except MSGPACK_ERRORS as exc:  # a daemon of another build: its reply is not one this client reads
            raise KvcachedError(f"{method}: undecodable reply: {exc}") from exc

    async def put(self, digest: bytes, data: bytes, checksum: bytes | None = None) -> str | None:
        """Store a block; returns the tier now holding it."""
        return (await self._call(PUT, PutRequest(digest, data, checksum), PutReply)).tier

    async def get(self, digest: bytes, *, peers: bool = True) -> bytes | None:
        """The block's bytes, or ``None`` on a miss (``peers``: let the daemon ask its peers)."""
        return (await self.lookup(digest, peers=peers)).data

    async def lookup(self, digest: bytes, *, peers: bool = True) -> GetReply:
        """Like :meth:`get`, also saying where the block came from."""
        return await self._call(GET, GetRequest(digest, peers), GetReply)

    async def contains(self, digests: Sequence[bytes]) -> list[bool]:
        return (await self._call(CONTAINS, ContainsRequest(list(digests)), ContainsReply)).held

    async def longest_prefix(self, digests: Sequence[bytes]) -> tuple[int, list[str]]:
        """How many leading digests of the chain are held, and the tier of each of them."""
        reply = await self._call(CONTAINS, ContainsRequest(list(digests)), ContainsReply)
        return reply.prefix, reply.tiers

    async def delete(self, digest: bytes) -> bool:
        return (await self._call(DELETE, DeleteRequest(digest), DeleteReply)).deleted

    async def stats(self) -> dict[str, float]:
        return (await self.stats_reply()).stats

    async def stats_reply(self) -> StatsReply:
        """The daemon's counters and the digest version it keys blocks by."""
        return await self._call(STATS, StatsRequest(), StatsReply)

    async def aclose(self) -> None:
        await self._channel.close()


class DigestCheckedStore:
    """The block operations of ``client``, refused while its daemon keys blocks by another digest
    version than this process (:data:`contracts.versions.DIGEST_VERSION`): blocks put under one scheme's
    digests are never found under the other's, and the daemon's feed would announce them under its own
    version. The daemon's version is asked once (its Stats) before the first operation, and again after a
    failed ask; a mismatch raises :class:`KvcachedError` on every operation, logged once as a version
    skew (``skewed`` says so)."""

    def __init__(self, client: KvcachedClient) -> None:
        self.client = client
        self.daemon_digest: int | None = None
        self.skewed = False

    async def _checked(self) -> None:
        if self.daemon_digest is None:
            self.daemon_digest = (await self.client.stats_reply()).digest
            if not digest_matches(self.daemon_digest):
                self.skewed = True
                log.error("version skew: %s", self._refusal())
        if self.skewed:
            raise KvcachedError(self._refusal())

    def _refusal(self) -> str:
        return (
            f"kvcached keys blocks by digest version {self.daemon_digest}, this process's is "
            f"{DIGEST_VERSION}: its blocks are not used"
        )

    async def put(self, digest: bytes, data: bytes) -> str | None:
        await self._checked()
        return await self.client.put(digest, data)

    async def get(self, digest: bytes) -> bytes | None:
        await self._checked()
        return await self.client.get(digest)

    async def contains(self, digests: Sequence[bytes]) -> list[bool]:
        await self._checked()
        return await self.client.contains(digests)
