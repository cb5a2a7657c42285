"""The error hierarchy of the kvcached package.

Everything kvcached raises on purpose is a :class:`KvcachedError`; lower-level errors (RocksDB, QUIC,
TOML) are translated with ``raise ... from`` at the boundary that sees them, so callers catch one family.
The first two are the API's own (:mod:`contracts.kvcached`): its client raises them too.

    KvcachedError             any kvcached failure
    ├── BadRequest            a client's input is invalid (digest not 16 bytes, block over the size
    │                         limit, checksum that does not match the bytes): nothing was stored;
    │                         the gRPC boundary answers INVALID_ARGUMENT
    ├── CorruptBlock          a stored record failed verification (torn, flipped byte, wrong digest):
    │                         it is dropped, counted and reported, never served
    ├── PeerUnavailable       a peer is down, refused us or timed out: the caller treats it as a miss
    └── KvcachedConfigError   the daemon's config is invalid; the message names the key
                              (also a ``ValueError``)
"""

from __future__ import annotations

from contracts.kvcached import BadRequest, KvcachedError

__all__ = ["BadRequest", "CorruptBlock", "KvcachedConfigError", "KvcachedError", "PeerUnavailable"]


class CorruptBlock(KvcachedError):
    """A stored record failed verification; the message says how (magic, length, digest, checksum)."""


class PeerUnavailable(KvcachedError):
    """A peer could not answer in time (down, unreachable, handshake refused, timeout): a miss."""


class KvcachedConfigError(KvcachedError, ValueError):
    """A kvcached config value is missing, ill-typed, out of range or unknown; the message names the key."""
