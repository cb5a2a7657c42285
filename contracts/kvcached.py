"""The kvcached local API: the contract between a node's kvcached daemon and its clients (agents, tools).

Methods (unary, msgpack messages via msgspec, like :mod:`contracts.events`; no generated stubs):

=========  ============================================  ==========================================
method     request                                       reply
=========  ============================================  ==========================================
Put        :class:`PutRequest` digest, data, checksum?   :class:`PutReply` tier now holding it
Get        :class:`GetRequest` digest, peers             :class:`GetReply` data?, source
Contains   :class:`ContainsRequest` digest chain         :class:`ContainsReply` held per digest,
                                                         longest held prefix and its tiers
Delete     :class:`DeleteRequest` digest                 :class:`DeleteReply` deleted
Stats      :class:`StatsRequest`                         :class:`StatsReply` store + peer counters
=========  ============================================  ==========================================

A client sees two errors: :class:`BadRequest` when the daemon answered ``INVALID_ARGUMENT`` (a digest that
is not 16 bytes, a block over ``max_block_bytes``, a checksum that does not match; nothing was stored),
and :class:`KvcachedError` for any other failure. The daemon's own errors extend the same family
(:mod:`kvcached.errors`).
"""

from __future__ import annotations

import msgspec

MAX_BLOCK_BYTES_DEFAULT = 64 * 1024 * 1024
"""Largest block payload accepted by default (64 MiB): a llama.cpp slot of a long prompt fits."""

SERVICE = "kvgate.kvcached.v1.Kvcached"
PUT, GET, CONTAINS, DELETE, STATS = (f"/{SERVICE}/{m}" for m in ("Put", "Get", "Contains", "Delete", "Stats"))
MESSAGE_SLACK = 1024 * 1024
"""Bytes allowed on top of ``max_block_bytes`` in one gRPC message (digest, checksum, framing)."""


class PutRequest(msgspec.Struct, frozen=True):
    digest: bytes
    data: bytes
    checksum: bytes | None = None


class PutReply(msgspec.Struct, frozen=True):
    tier: str | None = None


class GetRequest(msgspec.Struct, frozen=True):
    """``peers``: on a local miss, may the daemon fetch the block from its peers."""

    digest: bytes
    peers: bool = True


class GetReply(msgspec.Struct, frozen=True):
    """``data`` ``None``: a miss. ``source``: ``ram``, ``ssd`` or ``peer``."""

    data: bytes | None = None
    source: str | None = None


class ContainsRequest(msgspec.Struct, frozen=True):
    digests: list[bytes]


class ContainsReply(msgspec.Struct, frozen=True):
    """``held``: per digest; ``prefix``: leading digests held; ``tiers``: the tier of each of those."""

    held: list[bool]
    prefix: int
    tiers: list[str]


class DeleteRequest(msgspec.Struct, frozen=True):
    digest: bytes


class DeleteReply(msgspec.Struct, frozen=True):
    deleted: bool


class StatsRequest(msgspec.Struct, frozen=True):
    pass


class StatsReply(msgspec.Struct, frozen=True):
    stats: dict[str, float]
    #: The digest version the daemon keys blocks by (:data:`contracts.versions.DIGEST_VERSION`); a daemon
    #: from before the field answers without it: version 1. (msgpack maps: an older client ignores it.)
    digest: int = 1


class KvcachedError(Exception):
    """Base class of every error kvcached raises on purpose (and its client's failures)."""


class BadRequest(KvcachedError):
    """A client's request is invalid; the message says which part. Nothing was stored."""
