"""The block record format: round trip, and every kind of damage is refused."""

from __future__ import annotations

import pytest

from contracts.kvcached import MAX_BLOCK_BYTES_DEFAULT
from kvcached.block import (
    HEADER_BYTES,
    check_digest,
    checksum,
    decode_record,
    encode_record,
    record_bytes,
)
from kvcached.errors import BadRequest, CorruptBlock, KvcachedConfigError, KvcachedError

DIGEST = bytes(range(16))
OTHER = bytes(range(1, 17))


@pytest.mark.parametrize("size", [0, 1, 4096, 1 << 20])
def test_round_trip(size: int) -> None:
    data = bytes(i % 251 for i in range(size))
    raw = encode_record(DIGEST, data)
    assert len(raw) == record_bytes(size) == HEADER_BYTES + size
    assert decode_record(DIGEST, raw) == data


def test_given_checksum_is_used() -> None:
    data = b"kv" * 100
    assert encode_record(DIGEST, data, data_checksum=checksum(data)) == encode_record(DIGEST, data)


def test_checksum_is_16_byte_blake3() -> None:
    assert len(checksum(b"")) == 16
    assert checksum(b"a") != checksum(b"b")


def test_every_flipped_byte_is_detected() -> None:
    raw = bytearray(encode_record(DIGEST, b"payload bytes"))
    for i in range(len(raw)):
        damaged = bytearray(raw)
        damaged[i] ^= 0x40
        with pytest.raises(CorruptBlock):
            decode_record(DIGEST, bytes(damaged))


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"", "shorter"),
        (encode_record(DIGEST, b"x" * 100)[:-1], "header says"),
        (encode_record(DIGEST, b"x" * 100)[: HEADER_BYTES - 1], "shorter"),
        (encode_record(DIGEST, b"x" * 100) + b"\x00", "header says"),
        (encode_record(OTHER, b"x" * 100), "another digest"),
        (b"XXXX" + encode_record(DIGEST, b"x")[4:], "magic"),
        (encode_record(DIGEST, b"x")[:4] + b"\x02" + encode_record(DIGEST, b"x")[5:], "version"),
    ],
)
def test_damaged_records(raw: bytes, reason: str) -> None:
    with pytest.raises(CorruptBlock, match=reason):
        decode_record(DIGEST, raw)


@pytest.mark.parametrize("digest", [b"", b"x" * 15, b"x" * 17, b"x" * 32])
def test_check_digest_refuses_other_widths(digest: bytes) -> None:
    with pytest.raises(BadRequest, match="16 bytes"):
        check_digest(digest)
    with pytest.raises(BadRequest):
        encode_record(digest, b"data")


def test_check_digest_refuses_non_bytes() -> None:
    with pytest.raises(BadRequest, match="bytes"):
        check_digest("0123456789abcdef")  # type: ignore[arg-type]
    assert check_digest(bytearray(DIGEST)) == DIGEST


def test_error_hierarchy() -> None:
    assert issubclass(BadRequest, KvcachedError)
    assert issubclass(CorruptBlock, KvcachedError)
    assert issubclass(KvcachedConfigError, ValueError)
    assert MAX_BLOCK_BYTES_DEFAULT == 64 * 1024 * 1024
