"""Prefix summaries: a Bloom filter over the chain digests a cluster's fleet holds at depths ``2^j``
blocks, built by the publisher, probed by the receiver (formulas: ``README.md``). Pure: no IO, no clock.

Why depths ``2^j``: a chain digest names its whole prefix (:mod:`contracts.digest`), so the digest at
depth ``d`` held means the first ``d`` blocks are held; sampling ``1, 2, 4, ...`` keeps ``log2`` entries
per prompt instead of one per block and still bounds the lead from below within a factor 2.
Why a plain (not a counting) filter: it is rebuilt from scratch at every refresh from what the index
still holds, so nothing is ever deleted from a filter.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from contracts.digest import Digest
from contracts.federation import ModelSummary

DEFAULT_BITS_PER_ENTRY = 16
"""Filter bits per entry: ``k = round(16 ln 2) = 11`` probes, false-positive rate 0.046 %."""
MIN_BYTES = 64
"""Smallest filter sent (512 bits), so an empty or tiny summary still decodes the same way."""
MAX_BYTES = 4 * 1024 * 1024
"""Largest filter sent (32 Mbit); past it the false-positive rate grows instead of the size."""
MAX_HASHES = 16


def depths(blocks: int) -> list[int]:
    """The sampled depths ``1, 2, 4, ...`` up to ``blocks`` (ascending)."""
    out: list[int] = []
    d = 1
    while d <= blocks:
        out.append(d)
        d *= 2
    return out


def sampled(digests: Sequence[Digest]) -> list[Digest]:
    """The digests of a chain at the sampled depths (depth ``d`` is ``digests[d - 1]``)."""
    return [digests[d - 1] for d in depths(len(digests))]


def _probes(digest: bytes, hashes: int, mask: int) -> Iterable[int]:
    # Kirsch-Mitzenmacher double hashing: BLAKE3 digests are uniform, so their two halves serve as h1, h2.
    h1 = int.from_bytes(digest[:8], "little")
    h2 = int.from_bytes(digest[8:16], "little") | 1
    for i in range(hashes):
        yield (h1 + i * h2) & mask


def sizing(entries: int, bits_per_entry: int = DEFAULT_BITS_PER_ENTRY) -> tuple[int, int]:
    """``(bytes, hashes)`` for ``entries`` digests: ``m`` = the next power of two >= ``entries x
    bits_per_entry`` bits (within [MIN_BYTES, MAX_BYTES] bytes), ``k = round(m / n x ln 2)`` in [1, 16]."""
    want = max(MIN_BYTES * 8, entries * bits_per_entry)
    m_bits = 1 << (want - 1).bit_length()
    m_bytes = min(MAX_BYTES, max(MIN_BYTES, m_bits // 8))
    k = round(m_bytes * 8 / max(1, entries) * math.log(2))
    return m_bytes, max(1, min(MAX_HASHES, k))


def false_positive_rate(entries: int, size_bytes: int, hashes: int) -> float:
    """``(1 - e^(-k n / m))^k``: the chance a digest never added tests as present."""
    if entries <= 0:
        return 0.0
    return (1.0 - math.exp(-hashes * entries / (size_bytes * 8))) ** hashes


def build_bits(entries: Iterable[bytes], size_bytes: int, hashes: int) -> bytes:
    """The filter's bit array (bit ``i`` is bit ``i % 8`` of byte ``i // 8``)."""
    bits = bytearray(size_bytes)
    mask = size_bytes * 8 - 1
    for digest in entries:
        for p in _probes(digest, hashes, mask):
            bits[p >> 3] |= 1 << (p & 7)
    return bytes(bits)


def contains(summary: ModelSummary, digest: bytes) -> bool:
    """Whether ``digest`` tests as present (false positives at :func:`false_positive_rate`)."""
    bits = summary.bits
    mask = len(bits) * 8 - 1
    return all(bits[p >> 3] >> (p & 7) & 1 for p in _probes(digest, summary.hashes, mask))


def lead(summary: ModelSummary, digests: Sequence[Digest]) -> int:
    """The prompt's lead in the summarised cluster, in blocks: the deepest sampled depth whose digest
    tests as present (probed deepest first), else 0. A lower bound within a factor 2 of the true lead
    (but for false positives)."""
    for d in reversed(depths(len(digests))):
        if contains(summary, digests[d - 1]):
            return d
    return 0


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """What the publisher reports for one model besides its prefixes."""

    queue_wait_s: float
    endpoints: int


class SummaryBuilder:
    """The sampled digests this gateway recorded lately, per model (an LRU of ``capacity`` digests), and
    the summaries built from them.

    :meth:`note` takes a routed prompt's chain; :meth:`build` encodes a filter per model over the noted
    digests some endpoint still holds (``held``: the prefix index).
    """

    def __init__(self, capacity: int = 65536, bits_per_entry: int = DEFAULT_BITS_PER_ENTRY) -> None:
        if capacity < 1 or bits_per_entry < 1:
            raise ValueError("capacity and bits_per_entry must be >= 1")
        self._capacity = capacity
        self._bits_per_entry = bits_per_entry
        self._entries: OrderedDict[Digest, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def note(self, model: str, digests: Sequence[Digest]) -> None:
        """A prompt of ``model`` whose chain is ``digests`` was routed in this cluster."""
        entries = self._entries
        for digest in sampled(digests):
            entries[digest] = model
            entries.move_to_end(digest)
        while len(entries) > self._capacity:
            entries.popitem(last=False)

    def build(
        self, block_size: int, loads: dict[str, ModelLoad], held: Callable[[Digest], bool]
    ) -> list[ModelSummary]:
        """One summary per model of ``loads`` (models without recorded digests get an empty filter) of the
        noted digests some endpoint still ``held``. Those not held now are left out of this summary but
        kept (up to the LRU's capacity): an index resync (a feed's snapshot clears an endpoint before it
        restates what the engine holds) must not drop a prefix from every later summary."""
        per_model: dict[str, list[Digest]] = {model: [] for model in loads}
        for digest, model in self._entries.items():
            if model in per_model and held(digest):
                per_model[model].append(digest)
        out: list[ModelSummary] = []
        for model, entries in per_model.items():
            size, hashes = sizing(len(entries), self._bits_per_entry)
            load = loads[model]
            out.append(
                ModelSummary(
                    model=model,
                    block_size=block_size,
                    hashes=hashes,
                    entries=len(entries),
                    bits=build_bits(entries, size, hashes),
                    queue_wait_s=load.queue_wait_s,
                    endpoints=load.endpoints,
                )
            )
        return out
