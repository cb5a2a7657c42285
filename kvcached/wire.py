"""The peer-fetch protocol's sans-IO parts: request and response framing, and egress pacing.

One fetch is one QUIC bidirectional stream (ALPN :data:`ALPN`). The client writes one request and ends its
side of the stream::

    request  = b"KVQ1" || count (u32, big-endian) || count x digest (16 bytes each)

The server answers with one frame per requested block it holds, in request order, then ends the stream
(blocks it lacks are simply absent)::

    frame    = length (u32, big-endian, = 16 + len(record)) || digest (16 bytes) || record

``record`` is :func:`kvcached.block.encode_record` output (magic, version, digest, length, checksum,
payload); the client verifies it with :func:`kvcached.block.decode_record` against the frame's digest, so a
frame whose record is torn, flipped or for another digest is dropped. The frame carries the digest itself
so that this module needs nothing of the record layout.

Nothing here reads a clock or touches a socket: :class:`FrameReader` is fed bytes and returns whole frames,
:class:`TokenBucket` is told ``now`` (seconds, any monotonic origin).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from contracts.digest import DIGEST_BYTES
from kvcached.block import check_digest
from kvcached.errors import BadRequest

ALPN = "kvgate-kv/1"
"""The QUIC application protocol both sides offer; a peer offering anything else is refused."""
REQUEST_MAGIC = b"KVQ1"
MAX_REQUEST_DIGESTS = 4096
"""Digests one request may name (64 KiB of digests); a client splits longer lists into several streams."""

RECORD_OVERHEAD_MAX = 1024
"""Upper bound on :func:`~kvcached.block.encode_record`'s header, used only to bound a frame's size."""

_U32 = struct.Struct(">I")
FRAME_HEADER_BYTES = _U32.size + DIGEST_BYTES
"""Bytes a frame adds before its record (length and digest)."""
_REQUEST_HEAD = len(REQUEST_MAGIC) + _U32.size


def max_request_bytes() -> int:
    """The largest well-formed request, in bytes (what a server buffers per stream at most)."""
    return _REQUEST_HEAD + MAX_REQUEST_DIGESTS * DIGEST_BYTES


def encode_request(digests: Sequence[bytes]) -> bytes:
    """The request naming ``digests``; :class:`BadRequest` if one is not 16 bytes or there are too many."""
    if len(digests) > MAX_REQUEST_DIGESTS:
        raise BadRequest(f"a request names at most {MAX_REQUEST_DIGESTS} digests, got {len(digests)}")
    return b"".join([REQUEST_MAGIC, _U32.pack(len(digests)), *(check_digest(d) for d in digests)])


def decode_request(raw: bytes) -> list[bytes]:
    """The digests a request names; :class:`BadRequest` on a wrong magic, count or length."""
    if len(raw) < _REQUEST_HEAD or raw[: len(REQUEST_MAGIC)] != REQUEST_MAGIC:
        raise BadRequest("not a kvgate-kv/1 request (bad magic)")
    (count,) = _U32.unpack_from(raw, len(REQUEST_MAGIC))
    if count > MAX_REQUEST_DIGESTS:
        raise BadRequest(f"a request names at most {MAX_REQUEST_DIGESTS} digests, got {count}")
    if len(raw) != _REQUEST_HEAD + count * DIGEST_BYTES:
        raise BadRequest(f"request length {len(raw)} does not match its count {count}")
    return [raw[i : i + DIGEST_BYTES] for i in range(_REQUEST_HEAD, len(raw), DIGEST_BYTES)]


def frame_header(digest: bytes, record_len: int) -> bytes:
    """The bytes that precede a ``record_len``-byte record in its frame (length and digest)."""
    return _U32.pack(DIGEST_BYTES + record_len) + check_digest(digest)


class Frame(NamedTuple):
    """One response frame: the block's digest and its record, split after the record's first
    ``head_bytes`` (:class:`FrameReader`)."""

    digest: bytes
    head: bytes
    body: bytes


@dataclass(slots=True)
class FrameReader:
    """Reassembles response frames from stream chunks.

    ``max_record_bytes`` bounds one record (the largest block plus :data:`RECORD_OVERHEAD_MAX`), so a
    hostile or broken peer cannot make the reader buffer more than that per stream: at a larger announced
    length the reader stops, sets :attr:`broken` (why) and ignores anything fed after; the frames completed
    before it, even in the same chunk, are still returned, and the caller abandons the stream.

    A frame's chunks are kept as views of the data fed and joined once, when the frame is whole: its
    first ``head_bytes`` into :attr:`Frame.head`, the rest into :attr:`Frame.body`. A client that splits
    at the record's header gets the payload as the body, with one copy from the stream's chunks and none
    after (fresh megabyte buffers cost page faults as well as copies, on the fetch's critical path).
    """

    max_record_bytes: int
    head_bytes: int = 0
    _prefix: bytearray = field(default_factory=bytearray)
    _parts: list[memoryview] = field(default_factory=list)
    _need: int | None = None
    _have: int = 0
    broken: str | None = None

    def feed(self, data: bytes) -> list[Frame]:
        """Add ``data``; return the frames it completed, in stream order (none once :attr:`broken`)."""
        out: list[Frame] = []
        view = memoryview(data)
        while view and self.broken is None:
            if self._need is None:
                take = _U32.size - len(self._prefix)
                self._prefix += view[:take]
                view = view[take:]
                if len(self._prefix) < _U32.size:
                    break
                (length,) = _U32.unpack(self._prefix)
                self._prefix.clear()
                if length < DIGEST_BYTES or length - DIGEST_BYTES > self.max_record_bytes:
                    self.broken = f"frame length {length} out of bounds"
                    break
                self._need, self._have = length, 0
            take = min(self._need - self._have, len(view))
            self._parts.append(view[:take])
            self._have += take
            view = view[take:]
            if self._have == self._need:
                out.append(self._frame())
        return out

    def _frame(self) -> Frame:
        parts, self._parts, self._need = self._parts, [], None
        lead = bytearray()
        split = DIGEST_BYTES + self.head_bytes
        while parts and len(lead) < split:
            take = split - len(lead)
            lead += parts[0][:take]
            if take < len(parts[0]):
                parts[0] = parts[0][take:]
            else:
                del parts[0]
        return Frame(bytes(lead[:DIGEST_BYTES]), bytes(lead[DIGEST_BYTES:]), b"".join(parts))

    def pending(self) -> int:
        """Bytes held of a frame not yet complete (non-zero at the end of the stream: a torn frame)."""
        return len(self._prefix) + (_U32.size + self._have if self._need is not None else 0)


@dataclass(slots=True)
class TokenBucket:
    """Egress pacing: ``rate`` bytes/s on average, bursts of up to ``burst`` bytes.

    :meth:`reserve` never refuses: it takes the bytes (the level may go negative, a debt) and says how
    long the caller must wait before sending them, so one large send is paced like many small ones and
    concurrent senders queue in the order they reserved.
    """

    rate: float
    burst: float
    _level: float = 0.0
    _at: float | None = None

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burst <= 0:
            raise ValueError("a token bucket needs a positive rate and burst")
        self._level = self.burst

    def reserve(self, nbytes: int, now: float) -> float:
        """Take ``nbytes`` at ``now`` (seconds); the delay in seconds before they may go out (0: now)."""
        if self._at is not None:
            self._level = min(self.burst, self._level + (now - self._at) * self.rate)
        self._at = now
        self._level -= nbytes
        return 0.0 if self._level >= 0 else -self._level / self.rate
