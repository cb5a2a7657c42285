"""The held history's chain without walking it: a follow-up turn resumes where the previous turn's
prompt reached a boundary (issue 27.1).

A follow-up's rendered prompt starts with the previous turn's, up to the previous generation prompt's
last added token (``<|im_start|>`` before ``assistant``). :class:`HistoryMemo` remembers, for a chat
prompt's pieces up to such a boundary (:meth:`~extproc.models.tokenizer.SegmentTokenizer.split`: the
text cut at added tokens, pieces the tokenizer treats independently), the state the lazy path
(:class:`~extproc.routing.router.LazyPrompt`) has there: the ids (exactly the tokenization of those
pieces), the ids after each piece, the characters of ordinary pieces, and the chain digests of the
complete blocks within the window. The next turn looks its own pieces' prefixes up (one rolling hash
per piece, longest first), checks the hit exactly, and starts its cursor there instead of stepping over
the history's cached pieces and hashing its blocks.

Exact (the lazy path's invariants hold and it ends in the state the unmemoised path ends in):

- the key is the piece sequence itself (plus the tokenizer, chain seed, block size and window),
  compared for equality on a hit, never just a hash: the ids of equal pieces are equal (the segment
  path's own invariant: ``encode(text) == concat(ids of its pieces)``);
- a state is remembered only where the window is not yet full (fewer than ``window`` digests), so the
  unmemoised path, which stops only at the window's end or a block nobody holds, passes through that
  boundary with exactly those ids and digests (at a piece boundary its digests are always every complete
  block: it hashes whenever a block completes);
- it is used only when every digest it carries is held now (``PrefixIndex.unheld`` from 0), else the
  unmemoised path would have stopped earlier: the prompt is then tokenized from its start as before.

The ids and marks are kept in arrays, which the garbage collector does not traverse: in tuples, the young
4k-item tuples made each of CPython's young collections in the decision bench's ~4k follow-up cells about
twice as long (BENCHMARKS.md). Each remembered state still leaves a few tracked objects (the state, its
pieces and digests tuples), so young collections run more often (about twice in those cells): with
``[extproc] gc = "python"`` some land inside decisions; the default ``deferred`` runs them after answers.
The memo is per process: with ``[extproc] workers`` above 1, a turn routed by another worker than the
previous one walks its history as before.

Bound: least recently used states are dropped past ``max_entries`` states or ``max_units`` characters
plus token ids held (each state holds its pieces' text, its ids and its digests: about 1 byte a
character plus 8 bytes an id and ~50 a digest). Nothing needs invalidating: a state is a function of its
key; a tokenizer reloaded is a different key (held by identity), a policy's new block size too.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from contracts.digest import Digest
from extproc.models.tokenizer import PrefixCursor, SegmentTokenizer


@dataclass(frozen=True, slots=True)
class _State:
    tokenizer: SegmentTokenizer
    seed: Digest
    block_size: int
    window: int
    pieces: tuple[str | int, ...]
    ids: array[int]
    marks: array[int]
    chars: int
    digests: tuple[Digest, ...]

    @property
    def units(self) -> int:
        return self.chars + len(self.ids)


class HistoryMemo:
    """Bounded LRU of lazy-path states at piece boundaries (see the module docstring). Thread-safe (a
    large body is tokenized in a worker thread while the loop commits others)."""

    def __init__(self, max_entries: int = 4096, max_units: int = 64_000_000) -> None:
        self.max_entries = max_entries
        self.max_units = max_units
        self._states: OrderedDict[int, _State] = OrderedDict()
        self._units = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._states)

    @property
    def units(self) -> int:
        """Characters plus token ids held."""
        return self._units

    @staticmethod
    def _hashes(head: int, pieces: Sequence[str | int]) -> list[int]:
        """``out[k]``: the rolling hash of ``pieces[:k]`` under ``head``."""
        out = [head]
        h = head
        for piece in pieces:
            h = hash((h, piece))
            out.append(h)
        return out

    @staticmethod
    def _head(tokenizer: SegmentTokenizer, seed: Digest, block_size: int, window: int) -> int:
        return hash((id(tokenizer), seed, block_size, window))

    def resume(
        self,
        cursor: PrefixCursor,
        seed: Digest,
        block_size: int,
        window: int,
        unheld: Callable[[Sequence[Digest], int], int],
    ) -> tuple[Digest, ...] | None:
        """Move a fresh ``cursor`` to the longest remembered boundary of its pieces whose digests are
        all held (``unheld``: :meth:`~extproc.index.interface.PrefixIndex.unheld`) and return those
        digests; ``None`` (cursor untouched) when there is none."""
        pieces = cursor.pieces
        tokenizer = cursor.tokenizer
        hashes = self._hashes(self._head(tokenizer, seed, block_size, window), pieces)
        with self._lock:
            return self._resume(cursor, pieces, hashes, seed, block_size, window, unheld)

    def _resume(
        self,
        cursor: PrefixCursor,
        pieces: Sequence[str | int],
        hashes: list[int],
        seed: Digest,
        block_size: int,
        window: int,
        unheld: Callable[[Sequence[Digest], int], int],
    ) -> tuple[Digest, ...] | None:
        tokenizer = cursor.tokenizer
        states = self._states
        for k in range(len(pieces), 0, -1):
            state = states.get(hashes[k])
            if state is None:
                continue
            if (
                state.tokenizer is not tokenizer
                or state.seed != seed
                or state.block_size != block_size
                or state.window != window
                or len(state.pieces) != k
                or tuple(pieces[:k]) != state.pieces
            ):
                continue
            digests = state.digests
            if unheld(digests, 0) != len(digests):
                break
            states.move_to_end(hashes[k])
            cursor.resume(k, state.ids, state.marks, state.chars)
            self.hits += 1
            return digests
        self.misses += 1
        return None

    def remember(
        self, cursor: PrefixCursor, seed: Digest, block_size: int, window: int, digests: Sequence[Digest]
    ) -> None:
        """Remember ``cursor``'s state (a chat prompt's, tokenized at least as far as ``digests``, its
        window's chain so far) at its last piece boundary that follows an added token and comes before
        the window is full."""
        pieces, marks = cursor.pieces, cursor.marks
        limit = window * block_size
        k = len(marks)
        while k > 0 and (not isinstance(pieces[k - 1], int) or marks[k - 1] >= limit or k == len(pieces)):
            k -= 1
        if k == 0:
            return
        n = marks[k - 1]
        blocks = n // block_size
        if blocks > len(digests):
            return
        key = self._hashes(self._head(cursor.tokenizer, seed, block_size, window), pieces[:k])[k]
        with self._lock:
            if key in self._states:
                self._states.move_to_end(key)
                return
        chars = sum(len(p) for p in pieces[:k] if isinstance(p, str))
        state = _State(
            cursor.tokenizer,
            seed,
            block_size,
            window,
            tuple(pieces[:k]),
            array("q", cursor.ids[:n]),
            array("q", marks[:k]),
            chars,
            tuple(digests[:blocks]),
        )
        if state.units > self.max_units:
            return
        with self._lock:
            if key in self._states:
                return
            self._states[key] = state
            self._units += state.units
            while len(self._states) > self.max_entries or self._units > self.max_units:
                _, old = self._states.popitem(last=False)
                self._units -= old.units

    def clear(self) -> None:
        with self._lock:
            self._states.clear()
            self._units = 0
