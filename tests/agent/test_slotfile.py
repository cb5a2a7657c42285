"""agent.slotfile: the token list of llama-server slot files (a real file is parsed in test_slot_chain.py)
and the chain marker format."""

from __future__ import annotations

import struct

import pytest

from agent.slotfile import (
    MARKER_BYTES,
    STATE_MAGIC,
    ChainMarker,
    decode_marker,
    encode_marker,
    state_tokens,
)

TOKENS = [1, 9690, 198, 2683, 359, 253]


def state_file(
    entries: list[int], *, magic: int = STATE_MAGIC, version: int = 4, n: int | None = None
) -> bytes:
    """A slot file: header, ``entries`` as int32, then some bytes standing for the KV state."""
    count = len(entries) if n is None else n
    return struct.pack("<III", magic, version, count) + struct.pack(f"<{len(entries)}i", *entries) + b"kv" * 8


def packed(tokens: list[int], media: int = 0) -> list[int]:
    """``server_tokens::serialize``: -1, version 1, count, ids, media key count (then keys)."""
    return [-1, 1, len(tokens), *tokens, media, *range(media)]


def test_packed_and_plain_token_lists() -> None:
    assert state_tokens(state_file(packed(TOKENS))) == TOKENS
    assert state_tokens(state_file(TOKENS)) == TOKENS  # older servers: the plain id list
    assert state_tokens(state_file(packed([]))) == []
    assert state_file(TOKENS)[:4] == b"qsgg"


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "empty"),
        (b"qsgg\x04\x00", "header cut short"),
        (state_file(packed(TOKENS), magic=0x6767736E), "a whole-context session file (ggsn), not a slot"),
        (state_file(packed(TOKENS), n=len(packed(TOKENS)) + 50)[:40], "token list cut short"),
        (state_file(packed(TOKENS), n=1 << 30), "absurd count"),
        (state_file([-1, 2, len(TOKENS), *TOKENS, 0]), "unknown packed version"),
        (state_file([-1, 1, len(TOKENS) + 3, *TOKENS, 0]), "count runs past the list"),
        (state_file([-1, 1, -4, *TOKENS, 0]), "negative count"),
        (state_file(packed(TOKENS, media=2)), "media chunks (multimodal)"),
        (state_file([-1, 1]), "packed form without a count"),
        (state_file([*TOKENS, -7]), "negative id in a plain list"),
        (state_file(packed([*TOKENS, -3])), "negative id in a packed list"),
    ],
)
def test_not_a_readable_token_list(data: bytes, why: str) -> None:
    assert state_tokens(data) is None, why


def test_marker_round_trip_and_rejects() -> None:
    marker = ChainMarker(prefix_tokens=32, blob=bytes(range(16)), blob_tokens=96, block_size=16)
    raw = encode_marker(marker)
    assert len(raw) == MARKER_BYTES == 32 and raw[:4] == b"KVSR"
    assert decode_marker(raw) == marker
    assert decode_marker(raw[:-1]) is None
    assert decode_marker(raw + b"x") is None
    assert decode_marker(b"KVSL" + raw[4:]) is None  # a slot record's magic
    assert decode_marker(raw[:4] + b"\x02" + raw[5:]) is None  # another version
    for bad in (
        ChainMarker(0, marker.blob, 96, 16),  # covers nothing
        ChainMarker(33, marker.blob, 96, 16),  # not a whole block
        ChainMarker(96, marker.blob, 96, 16),  # not inside the blob's prefix
        ChainMarker(32, marker.blob, 100, 16),
    ):
        assert decode_marker(encode_marker(bad)) is None, bad
