"""The block digest chain (DESIGN.md contract 1): the one place it is computed.

``d_0 = BLAKE3(seed || tokens[0:B])`` and ``d_i = BLAKE3(d_{i-1} || tokens[iB:(i+1)B])`` over full
blocks only. Tokens are packed as 4-byte little-endian unsigned integers. The seed binds the chain to a
model, a LoRA adapter and a cache salt, so the same tokens under another model never share a digest, and
because every digest folds in its predecessor, an identical chunk at another position never matches.
Digests are truncated to 16 bytes (128 bits): collisions stay negligible and index entries stay small.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import NewType

from blake3 import blake3

from contracts.versions import DIGEST_VERSION

Digest = NewType("Digest", bytes)
DIGEST_BYTES = 16
TOKEN_BYTES = 4
#: The largest token id a digest can hold (``TOKEN_BYTES`` unsigned): readers refuse larger ones (a client's
#: prompt: 400; an engine's event: malformed) before hashing, since :func:`pack_tokens` cannot pack them.
MAX_TOKEN_ID = (1 << (8 * TOKEN_BYTES)) - 1

_SEED_TAG = f"kvgate-v{DIGEST_VERSION}\x00".encode()

if array("I").itemsize != TOKEN_BYTES:  # pragma: no cover - every platform we support has 32-bit "I"
    raise ImportError("array('I') is not 32-bit on this platform")


def chain_seed(model: str, lora: str | None = None, salt: str | None = None) -> Digest:
    """The chain seed for a model, optional LoRA adapter and optional cache salt: the one seed function.

    Every side feeds it the same three fields, as vLLM's block hash does through its extra keys (the
    adapter's name on every block, the request's ``cache_salt`` on the first; REFERENCE.md section 5):
    ``model`` the engine's base (served) model name, ``lora`` the adapter's name for a LoRA request (the
    name clients put in ``model``, vLLM's ``lora_name``), ``salt`` the request's ``cache_salt``. The router
    resolves an adapter to its base model from the fleet (``Endpoint.adapters``); the agent reads the
    adapter and salt from each ``BlockStored`` (``lora_name``, ``extra_keys``); the simulator seeds each
    request itself. The material starts with the digest version (:data:`contracts.versions.DIGEST_VERSION`):
    chains of two versions never share a digest, and readers never compare them
    (:func:`contracts.versions.digest_matches`)."""
    material = _SEED_TAG + model.encode() + b"\x00" + (lora or "").encode() + b"\x00" + (salt or "").encode()
    return Digest(blake3(material).digest(DIGEST_BYTES))


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Tokens as fixed-width little-endian uint32 bytes (each 0..:data:`MAX_TOKEN_ID`; OverflowError
    otherwise)."""
    packed = array("I", tokens)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def block_digests(
    seed: Digest, tokens: Sequence[int], block_size: int, *, start: int = 0, parent: Digest | None = None
) -> list[Digest]:
    """Digests of the full blocks of ``tokens``.

    ``start``/``parent`` resume a chain: blocks before ``start`` (a multiple of ``block_size``) are taken
    as already hashed, ``parent`` being the digest of the last of them.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if start % block_size:
        raise ValueError("start must be a multiple of block_size")
    n_full = len(tokens) // block_size
    first = start // block_size
    if first >= n_full:
        return []
    raw = pack_tokens(tokens[first * block_size : n_full * block_size])
    step = block_size * TOKEN_BYTES
    prev: bytes = parent if (parent is not None and first > 0) else seed
    out: list[Digest] = []
    append = out.append
    for off in range(0, len(raw), step):
        prev = blake3(prev + raw[off : off + step]).digest(DIGEST_BYTES)
        append(Digest(prev))
    return out


class ChainCache:
    """:func:`block_digests` with a memo of recent ``(parent, block) -> digest`` steps.

    A follow-up turn repeats the previous turn's blocks, so most of its chain is memo hits; a hit costs a
    dictionary lookup where BLAKE3 costs a call into C (several times more from Python). Results are
    identical to :func:`block_digests` (the memo only stores what BLAKE3 returned). Bounded: two
    generations of at most ``max_entries`` each; a full current generation becomes the old one and the
    previous old one is dropped (an LRU approximation with O(1) bookkeeping). About 200 bytes an entry.
    """

    __slots__ = ("_cur", "_max", "_old", "hits", "misses")

    def __init__(self, max_entries: int = 200_000) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self._max = max_entries
        self._cur: dict[bytes, Digest] = {}
        self._old: dict[bytes, Digest] = {}
        self.hits = 0
        self.misses = 0

    @property
    def max_entries(self) -> int:
        """The bound of each generation."""
        return self._max

    def digests(self, seed: Digest, tokens: Sequence[int], block_size: int) -> list[Digest]:
        """The same as ``block_digests(seed, tokens, block_size)``."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        n_full = len(tokens) // block_size
        if n_full == 0:
            return []
        raw = pack_tokens(tokens[: n_full * block_size])
        step = block_size * TOKEN_BYTES
        cur, old = self._cur, self._old
        prev: bytes = seed
        out: list[Digest] = []
        hits = 0
        for off in range(0, len(raw), step):
            key = prev + raw[off : off + step]
            digest = cur.get(key)
            if digest is None:
                digest = old.get(key)
                if digest is None:
                    digest = Digest(blake3(key).digest(DIGEST_BYTES))
                else:
                    hits += 1
                cur[key] = digest
            else:
                hits += 1
            out.append(digest)
            prev = digest
        self.hits += hits
        self.misses += n_full - hits
        if len(cur) > self._max:
            self._old, self._cur = cur, {}
        return out
