"""Fuzzing kvcached's wire formats (issue 24 part 3): the QUIC peer protocol's request and response
framing and the block record (:mod:`kvcached.wire`, :mod:`kvcached.block`), and the local gRPC API's
msgpack messages served by a real :class:`ApiServer` (RAM + RocksDB tiers) on a unix socket.

Property: any bytes give a request, frames or a payload, or kvcached's typed error (``BadRequest``,
``CorruptBlock``, a reader marked broken), never another exception; over gRPC every call is answered OK
or INVALID_ARGUMENT (never UNKNOWN, the status of an exception that escaped a handler) and the daemon
keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import blake3
import grpc
import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from contracts.digest import DIGEST_BYTES
from contracts.kvcached import CONTAINS, DELETE, GET, PUT, STATS
from kvcached.block import HEADER_BYTES, decode_record, encode_record
from kvcached.errors import BadRequest, CorruptBlock
from kvcached.service import ApiServer, KvcachedService
from kvcached.tiers import TieredStore
from kvcached.wire import REQUEST_MAGIC, FrameReader, decode_request, encode_request, frame_header
from tests.fuzz.strategies import FUZZ, edge_ints, json_values

MAX_BLOCK = 4096
digests = st.binary(min_size=DIGEST_BYTES, max_size=DIGEST_BYTES) | st.binary(max_size=20)


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    """A peer request: well formed, its count or length off, or any bytes after the magic."""
    kind = draw(st.integers(0, 2))
    if kind == 0:
        return draw(st.binary(max_size=80))
    if kind == 1:
        return REQUEST_MAGIC + draw(st.binary(max_size=80))
    count = draw(st.integers(0, 5) | st.sampled_from([4096, 4097, 2**32 - 1]))
    body = b"".join(draw(st.lists(st.binary(min_size=16, max_size=16), max_size=5)))
    return REQUEST_MAGIC + count.to_bytes(4, "big") + body + draw(st.binary(max_size=3))


@FUZZ
@given(raw=requests())
@example(raw=REQUEST_MAGIC + (2**32 - 1).to_bytes(4, "big"))
def test_peer_requests_decode_or_are_refused(raw: bytes) -> None:
    try:
        got = decode_request(raw)
    except BadRequest:
        return
    assert encode_request(got) == raw


@st.composite
def response_stream(draw: st.DrawFn) -> tuple[list[bytes], list[bytes]]:
    """A response stream (well-formed frames, torn, with bad lengths or records) cut into chunks, and the
    digests of the records it holds intact."""
    parts, good = [], []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.integers(0, 3))
        data = draw(st.binary(max_size=64))
        digest = blake3.blake3(data).digest(DIGEST_BYTES)
        record = encode_record(digest, data)
        if kind == 0:
            parts.append(frame_header(digest, len(record)) + record)
            good.append(digest)
        elif kind == 1:  # a flipped byte in the record
            flip = draw(st.integers(0, len(record) - 1))
            bad = bytes(b ^ (0xFF if i == flip else 0) for i, b in enumerate(record))
            parts.append(frame_header(digest, len(bad)) + bad)
        elif kind == 2:  # any announced length
            parts.append(draw(edge_ints.filter(lambda n: 0 <= n < 2**32)).to_bytes(4, "big") + record)
            good.append(digest)
        else:
            parts.append(draw(st.binary(max_size=24)))
    stream = b"".join(parts)
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=4)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    return chunks, good


@FUZZ
@given(case=response_stream(), head=st.sampled_from([0, HEADER_BYTES]))
def test_response_frames_reassemble_or_break(case: tuple[list[bytes], list[bytes]], head: int) -> None:
    chunks, good = case
    reader = FrameReader(max_record_bytes=MAX_BLOCK + 1024, head_bytes=head)
    frames = [frame for chunk in chunks for frame in reader.feed(chunk)]
    assert reader.pending() >= 0
    whole = FrameReader(max_record_bytes=MAX_BLOCK + 1024, head_bytes=head)
    assert whole.feed(b"".join(chunks)) == frames  # however the stream was cut, the same frames
    assert (whole.broken is None) == (reader.broken is None) and whole.pending() == reader.pending()
    verified = []
    for frame in frames:
        with contextlib.suppress(CorruptBlock):
            decode_record(frame.digest, frame.head + frame.body)
            verified.append(frame.digest)
    assert set(verified) <= set(good)  # only intact records verify


@FUZZ
@given(digest=digests, raw=st.binary(max_size=96))
def test_records_verify_or_are_corrupt(digest: bytes, raw: bytes) -> None:
    with contextlib.suppress(CorruptBlock):
        decode_record(digest, raw)


# -- the local gRPC API ------------------------------------------------------------------------------------


class _Daemon:
    """A real ApiServer on a unix socket, run on an event loop of its own thread."""

    def __init__(self, root: Path) -> None:
        self.socket = root / "api.sock"
        self.store = TieredStore(16 * MAX_BLOCK, root / "ssd", 1 << 20, max_block_bytes=MAX_BLOCK)
        self.server = ApiServer(
            KvcachedService(self.store), listen_unix=str(self.socket), max_block_bytes=MAX_BLOCK
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kvcached-fuzz", daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.aclose(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()
        self.store.close()


@pytest.fixture(scope="module")
def channel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[grpc.Channel]:
    daemon = _Daemon(tmp_path_factory.mktemp("kvcached-fuzz"))
    with grpc.insecure_channel(f"unix:{daemon.socket}") as chan:
        yield chan
    daemon.close()


METHODS = (PUT, GET, CONTAINS, DELETE, STATS)
fields = st.sampled_from(["digest", "data", "checksum", "peers", "digests"]) | st.text(max_size=6)
field_values = digests | st.binary(max_size=MAX_BLOCK + 8) | st.lists(digests, max_size=3) | json_values(4)


@st.composite
def api_messages(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 2))
    if kind == 0:
        return draw(st.binary(max_size=64))
    if kind == 1:
        return msgspec.msgpack.encode(draw(json_values(8)))
    return msgspec.msgpack.encode(draw(st.dictionaries(fields, field_values, max_size=4)))


@FUZZ
@given(method=st.sampled_from(METHODS), raw=api_messages())
@example(method=PUT, raw=msgspec.msgpack.encode({"digest": b"\x01" * 16, "data": b"x" * (MAX_BLOCK + 1)}))
@example(method=CONTAINS, raw=msgspec.msgpack.encode({"digests": [b"\x01" * 3]}))
@example(method=GET, raw=b"\x81\xa1\x80\xc4\x01\x00")  # a key that is not UTF-8
def test_api_answers_any_message(channel: grpc.Channel, method: str, raw: bytes) -> None:
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        call(raw, timeout=30)
    except grpc.RpcError as exc:
        assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
    stats = channel.unary_unary(STATS, request_serializer=None, response_deserializer=None)
    assert stats(msgspec.msgpack.encode({}), timeout=30)  # still serving
