"""The held history's chain without walking it: a follow-up turn resumes where the previous turn's
prompt reached a boundary (issue 27.1).

A follow-up's rendered prompt starts with the previous turn's, up to the previous generation prompt's
last added token (``<|im_start|>`` before ``assistant``). :class:`HistoryMemo` remembers, for a chat
prompt's pieces up to a boundary the follow-up shares
(:meth:`~extproc.models.tokenizer.SegmentTokenizer.split`: the text cut at added tokens, pieces the
tokenizer treats independently), the state the lazy path (:class:`~extproc.routing.router.LazyPrompt`)
has there: the ids (exactly the tokenization of those pieces), the ids after each piece, the characters
of ordinary pieces and the count of added tokens, and the chain digests of the complete blocks within
the window. The next turn looks its own pieces' prefixes up (one rolling hash per piece, longest first),
checks the hit exactly, and starts its cursor there instead of stepping over the history's cached pieces
and hashing its blocks. The boundary kept (:meth:`HistoryMemo._boundary`), with ``P`` the pieces and
``k`` at most the last index after an added token below ``len(P)`` (what the follow-up shares):

- where the window is full and it filled within those shared pieces: right after the piece ``P[j]`` in
  which it filled; the commit first tokenizes ``P[j]`` to its end (:meth:`HistoryMemo.settle`; at most
  :data:`MAX_PIECE_CHARS`), which also caches it whole. The state's digests are the whole window, so the
  follow-up tokenizes nothing;
- else the last shared boundary before the window is full.

Exact (the lazy path's invariants hold and it ends in the state the unmemoised path ends in):

- the key is the piece sequence itself (plus the tokenizer, chain seed, block size and window),
  compared for equality on a hit, never just a hash: the ids of equal pieces are equal (the segment
  path's own invariant: ``encode(text) == concat(ids of its pieces)``);
- a state before the window is full: the unmemoised path, which stops only at the window's end or a
  block nobody holds, passes through that boundary with exactly those ids and digests (at a piece
  boundary its digests are always every complete block: it hashes whenever a block completes);
- a full window's state (``window`` digests, after ``P[j]``): the unmemoised path reaches ``P[j]`` with
  the window not yet full and, ``P[j]`` being cached (an added token needs no cache), takes it in one
  step, completes the window and stops right there, with those ids, marks, characters and digests, so
  with the same length estimate too. It is used only while the segment cache holds ``P[j]``
  (:meth:`~extproc.models.tokenizer.SegmentTokenizer.holds`); else a shorter state is looked for (the
  walk would then chunk ``P[j]`` and stop inside it);
- it is used only when every digest it carries is held now (``PrefixIndex.unheld`` from 0), else the
  unmemoised path would have stopped earlier: the prompt is then tokenized from its start as before.
  That check is skipped when the index's :attr:`~extproc.index.interface.PrefixIndex.generation` reads
  as it did when the state's digests were last known held (a record only adds; every path that can
  make a digest unheld, an eviction, ``Removed``, ``Cleared``, an expiry swept, an endpoint cleared or
  dropped, moves it): at the resume that checked them, or at the commit that remembered the state when
  the record there removed nothing (its digests, a prefix of the chain just recorded and no longer than
  the index's ``max_match_blocks``, are then all held).

Found by text (:meth:`HistoryMemo.open`): a state also keeps ``P``, the rendered prompt's first ``L``
characters up to the last boundary a follow-up shares (its pieces, then for a full window's state the
shared pieces after them, kept too), in one sorted list per tokenizer, seed, block size and window. A
follow-up's text ``T`` is looked up by bisection: the greatest kept text ``<= T`` is the longest kept
prefix of ``T`` when it is one (a longer one would lie between them), confirmed with ``startswith`` (a
memcmp). Then only ``T``'s rest is cut at added tokens, from ``b``, the start of the state's piece ``i``,
the last one right after an added token with ``b <= L - m + 1`` or at an added token with ``b <= L -
m`` (or 0; ``m``: the longest added token, :attr:`~extproc.models.tokenizer.SegmentTokenizer.reach`).
The scan of ``T`` tries a position by reading at most ``m`` characters, so up to ``b`` it reads only
``T[:L] == P``: it finds the previous text's added tokens there, the one ending or starting at ``b``
included, so ``T``'s pieces before ``b`` are the state's and its cut from ``b`` on is ``T[b:]``'s own
(the regex has no anchors or lookbehind). The state
is used when those pieces from ``i`` to its end are its own (a longer added token may now match
across ``L``); else, or for a tokenizer without :attr:`reach`, the pieces are cut whole and hashed as
above. The state found is the one the piece lookup would find (the longest kept prefix), so the
result is the same; the lookup costs a bisection and a memcmp instead of cutting and hashing the
whole text.

The ids and marks are kept in arrays, which the garbage collector does not traverse: in tuples, the young
4k-item tuples made each of CPython's young collections in the decision bench's ~4k follow-up cells about
twice as long (BENCHMARKS.md). Each remembered state still leaves a few tracked objects (the state, its
pieces and digests tuples), so young collections run more often (about twice in those cells): with
``[extproc] gc = "python"`` some land inside decisions; the default ``deferred`` runs them after answers.
The memo is per process: with ``[extproc] workers`` above 1, a turn routed by another worker than the
previous one walks its history as before.

Bound: least recently used states are dropped past ``max_entries`` states or ``max_units`` characters
plus token ids held (each state holds its pieces' text, the text kept for :meth:`HistoryMemo.open`, its
ids and its digests: about 1 byte a character plus 8 bytes an id and ~50 a digest). Nothing needs
invalidating: a state is a function of its key; a tokenizer reloaded is a different key (held by
identity), a policy's new block size too. Keeping a state's text costs the commit ~15 us at ~4k tokens
(its pieces' offsets, a copy of the text, an insertion into the sorted list).
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from contracts.digest import Digest
from extproc.models.tokenizer import PrefixCursor, SegmentTokenizer

MAX_PARENTS = 4
"""Ancestors of a sibling branch :meth:`HistoryMemo.open` tries at most before cutting the text whole."""

MAX_PIECE_CHARS = 65_536
"""The longest piece (characters, ~16k tokens of English: ~10 ms of tokenizing once, after the answer)
in which a full window ends that :meth:`HistoryMemo.settle` tokenizes to its end so that the full
window's state can be kept; a longer one keeps the last boundary before the window is full."""


class Holdings(Protocol):
    """What the memo asks the index (:class:`~extproc.index.interface.PrefixIndex` has both)."""

    def unheld(self, digests: Sequence[Digest], start: int) -> int:
        """:meth:`~extproc.index.interface.PrefixIndex.unheld`."""
        ...

    @property
    def generation(self) -> int:
        """:attr:`~extproc.index.interface.PrefixIndex.generation`."""
        ...


@dataclass(slots=True)
class _State:
    tokenizer: SegmentTokenizer
    seed: Digest
    block_size: int
    window: int
    pieces: tuple[str | int, ...]
    ids: array[int]
    marks: array[int]
    chars: int
    specials: int
    digests: tuple[Digest, ...]
    key: int
    #: The text kept (``None``: not known, found by its pieces only): that of ``pieces`` and ``shared``,
    #: the pieces after them up to the last boundary a follow-up shares (a full window's state ends
    #: before it); where a follow-up's text is cut from: piece ``cut`` of those, at character
    #: ``cut_at``, with ``cut_specials`` added tokens and ``cut_chars`` ordinary characters before it.
    text: str | None = None
    shared: tuple[str | int, ...] = ()
    cut: int = 0
    cut_at: int = 0
    cut_specials: int = 0
    cut_chars: int = 0
    #: The index's generation when every digest was last known held (-1: never).
    checked: int = -1
    #: The key of the state the prompt remembered here was resumed from (``None``: none), a prefix of it.
    parent: int | None = None

    @property
    def units(self) -> int:
        kept = 0 if self.text is None else 2 * len(self.text) - self.chars  # the text and ``shared``
        return self.chars + len(self.ids) + kept


_Head = tuple[int, Digest, int, int]


class HistoryMemo:
    """Bounded LRU of lazy-path states at piece boundaries (see the module docstring). Thread-safe (a
    large body is tokenized in a worker thread while the loop commits others)."""

    def __init__(
        self, max_entries: int = 4096, max_units: int = 64_000_000, max_piece_chars: int = MAX_PIECE_CHARS
    ) -> None:
        self.max_entries = max_entries
        self.max_units = max_units
        #: The longest piece in which a full window ends that :meth:`settle` tokenizes to its end.
        self.max_piece_chars = max_piece_chars
        self._states: OrderedDict[int, _State] = OrderedDict()
        #: Per tokenizer (by identity), seed, block size and window: the kept texts, sorted, and their
        #: states' keys in the same order.
        self._texts: dict[_Head, tuple[list[str], list[int]]] = {}
        self._units = 0
        self._lock = threading.Lock()
        self.hits = 0
        #: Hits on a full window's state (a follow-up then tokenizes nothing).
        self.full_hits = 0
        #: Hits found by text (:meth:`open`), and resumes that skipped the held check (generation).
        self.text_hits = 0
        self.unchecked = 0
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

    def open(
        self,
        tokenizer: SegmentTokenizer,
        text: str,
        seed: Digest,
        block_size: int,
        window: int,
        index: Holdings,
    ) -> tuple[PrefixCursor, tuple[Digest, ...] | None, int] | None:
        """A cursor over the chat prompt ``text`` (no special tokens added) without cutting the text
        whole, found by text (see the module docstring): with the digests of the state it was moved to,
        or ``None`` when that state's digests are not all held (the cursor then fresh, as
        :meth:`resume` leaves it), and that state's key. ``None`` when no kept text is a prefix of
        ``text`` that can be taken up (the caller cuts the text whole and calls :meth:`resume`).

        The greatest kept text ``<= text`` may be a sibling branch (another reply to the same history):
        then the states its prompt was resumed from (:attr:`_State.parent`, a few) are tried."""
        if tokenizer.reach is None:
            return None
        with self._lock:
            kept = self._texts.get((id(tokenizer), seed, block_size, window))
            if kept is None:
                return None
            texts, keys = kept
            at = bisect_right(texts, text)
            if not at:
                return None
            state = self._states.get(keys[at - 1])
            for _ in range(MAX_PARENTS):
                if state is None or state.text is None or text.startswith(state.text):
                    break
                state = None if state.parent is None else self._states.get(state.parent)
        if (
            state is None
            or state.text is None
            or not text.startswith(state.text)
            or state.tokenizer is not tokenizer
            or state.seed != seed
            or state.block_size != block_size
            or state.window != window
            or state.text is None
        ):
            return None
        cut, k = state.cut, len(state.pieces)
        known = state.pieces + state.shared if state.shared else state.pieces
        tail, specials, special_chars = tokenizer.cut_from(text, state.cut_at)
        if len(tail) < len(known) - cut or any(a != b for a, b in zip(tail, known[cut:], strict=False)):
            return None  # an added token now matches across the kept text's end
        digests = state.digests
        last = state.pieces[-1]
        if len(digests) >= window and isinstance(last, str) and not tokenizer.holds(last):
            return None  # a full window's state without its last piece cached: the walk finds another
        pieces = list(known[:cut])
        pieces += tail
        totals = (
            state.cut_specials + specials,
            state.cut_chars + len(text) - state.cut_at - special_chars,
        )
        cursor = tokenizer.cursor_over(pieces, totals)
        with self._lock:
            if not self._held(state, index):
                self.misses += 1
                return cursor, None, state.key
            if state.key in self._states:
                self._states.move_to_end(state.key)
            self.text_hits += 1
            self._hit(state)
        cursor.resume(k, state.ids, state.marks, state.chars, state.specials)
        return cursor, digests, state.key

    def _held(self, state: _State, index: Holdings) -> bool:
        """Whether every digest of ``state`` is held (not asked again while the generation stands)."""
        generation = index.generation
        if state.checked == generation:
            self.unchecked += 1
            return True
        digests = state.digests
        if index.unheld(digests, 0) != len(digests):
            return False
        state.checked = generation
        return True

    def _hit(self, state: _State) -> None:
        self.hits += 1
        self.full_hits += len(state.digests) >= state.window

    def resume(
        self, cursor: PrefixCursor, seed: Digest, block_size: int, window: int, index: Holdings
    ) -> tuple[tuple[Digest, ...], int] | None:
        """Move a fresh ``cursor`` to the longest remembered boundary of its pieces whose digests are
        all held (``index``: :meth:`~extproc.index.interface.PrefixIndex.unheld` and
        :attr:`~extproc.index.interface.PrefixIndex.generation`) and return those digests and the
        state's key; ``None`` (cursor untouched) when there is none."""
        pieces = cursor.pieces
        tokenizer = cursor.tokenizer
        hashes = self._hashes(self._head(tokenizer, seed, block_size, window), pieces)
        with self._lock:
            return self._resume(cursor, pieces, hashes, seed, block_size, window, index)

    def _resume(
        self,
        cursor: PrefixCursor,
        pieces: Sequence[str | int],
        hashes: list[int],
        seed: Digest,
        block_size: int,
        window: int,
        index: Holdings,
    ) -> tuple[tuple[Digest, ...], int] | None:
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
            last = state.pieces[-1]
            if len(digests) >= window and isinstance(last, str) and not tokenizer.holds(last):
                continue  # a full window's state is where the walk stops only with its last piece cached
            if not self._held(state, index):
                break
            states.move_to_end(hashes[k])
            cursor.resume(k, state.ids, state.marks, state.chars, state.specials)
            self._hit(state)
            return digests, state.key
        self.misses += 1
        return None

    def settle(self, cursor: PrefixCursor, block_size: int, window: int, digests: Sequence[Digest]) -> None:
        """Tokenize the rest of the piece in which a full window ended, when :meth:`remember` would keep
        the full window's state after it (the work :meth:`remember` does first; a caller runs it off the
        event loop for a large prompt)."""
        found = self._boundary(cursor, block_size, window, len(digests))
        if found is not None and found[1] and len(cursor.marks) < found[0]:
            cursor.end_piece()

    def _boundary(
        self, cursor: PrefixCursor, block_size: int, window: int, hashed: int
    ) -> tuple[int, bool] | None:
        """``(k, full)``: the boundary :meth:`remember` keeps for ``cursor`` with ``hashed`` digests, the
        last one a follow-up shares (``k < len(pieces)``, after an added token) at most:

        - ``full``: the window is full (``hashed >= window``) and the piece in which it filled, ``k - 1``,
          is shared and either tokenized whole already or at most :attr:`max_piece_chars` long: the
          boundary right after it;
        - else the last shared boundary before the window is full (its ids fewer than the window's).
        """
        pieces, marks = cursor.pieces, cursor.marks
        last = len(pieces) - 1
        while last > 0 and not isinstance(pieces[last - 1], int):
            last -= 1
        if last <= 0:
            return None
        limit = window * block_size
        if hashed >= window:
            j = bisect_left(marks, limit)  # the piece in which the window filled (in progress: len(marks))
            if j < last:
                piece = pieces[j]
                if j < len(marks) or (
                    not cursor.at_boundary and isinstance(piece, str) and len(piece) <= self.max_piece_chars
                ):
                    return j + 1, True
        k = min(len(marks), last)
        while k > 0 and (not isinstance(pieces[k - 1], int) or marks[k - 1] >= limit):
            k -= 1
        return (k, False) if k else None

    def remember(
        self,
        cursor: PrefixCursor,
        seed: Digest,
        block_size: int,
        window: int,
        digests: Sequence[Digest],
        *,
        text: str | None = None,
        held: tuple[int, int] | None = None,
        parent: int | None = None,
    ) -> None:
        """Remember ``cursor``'s state (a chat prompt's, tokenized at least as far as ``digests``, its
        window's chain so far) at the boundary :meth:`_boundary` picks, after :meth:`settle`. ``text``:
        the prompt's text (the state is then found by text too, :meth:`open`); ``held``:
        ``(generation, n)``, the first ``n`` of ``digests`` known held at that index generation (a
        state within them skips its next held check while the generation stands); ``parent``: the key of
        the state the prompt was resumed from (:meth:`open` tries it for a sibling branch)."""
        self.settle(cursor, block_size, window, digests)
        found = self._boundary(cursor, block_size, window, len(digests))
        if found is None:
            return
        k, full = found
        pieces, marks = cursor.pieces, cursor.marks
        if len(marks) < k:
            return
        n = marks[k - 1]
        blocks = window if full else n // block_size
        if blocks > len(digests) or n < blocks * block_size:
            return
        checked = held[0] if held is not None and blocks <= held[1] else -1
        key = self._hashes(self._head(cursor.tokenizer, seed, block_size, window), pieces[:k])[k]
        with self._lock:
            known = self._states.get(key)
            if known is not None:
                self._states.move_to_end(key)
                if checked >= 0:
                    known.checked = checked
                return
        tokenizer = cursor.tokenizer
        chars = sum(len(p) for p in pieces[:k] if isinstance(p, str))
        specials = sum(1 for p in pieces[:k] if isinstance(p, int))
        state = _State(
            tokenizer,
            seed,
            block_size,
            window,
            tuple(pieces[:k]),
            cursor.ids[:n],
            array("q", marks[:k]),
            chars,
            specials,
            tuple(digests[:blocks]),
            key,
            checked=checked,
            parent=parent if parent != key else None,
        )
        reach = tokenizer.reach
        if text is not None and reach is not None:
            shared = len(pieces) - 1  # the last boundary a follow-up shares (after an added token)
            while shared > k and not isinstance(pieces[shared - 1], int):
                shared -= 1
            _place(state, text, reach, tuple(pieces[k:shared]))
        if state.units > self.max_units:
            return
        with self._lock:
            if key in self._states:
                return
            self._states[key] = state
            self._units += state.units
            if state.text is not None:
                texts, keys = self._texts.setdefault((id(tokenizer), seed, block_size, window), ([], []))
                at = bisect_right(texts, state.text)
                texts.insert(at, state.text)
                keys.insert(at, key)
            while len(self._states) > self.max_entries or self._units > self.max_units:
                _, old = self._states.popitem(last=False)
                self._forget(old)

    def _forget(self, state: _State) -> None:
        """Take a state dropped from ``_states`` out of the text lists and the units; the lock is held."""
        self._units -= state.units
        if state.text is None:
            return
        head = (id(state.tokenizer), state.seed, state.block_size, state.window)
        kept = self._texts.get(head)
        if kept is None:
            return
        texts, keys = kept
        at = bisect_left(texts, state.text)
        while at < len(texts) and texts[at] == state.text:
            if keys[at] == state.key:
                del texts[at], keys[at]
                break
            at += 1
        if not texts:
            del self._texts[head]

    def clear(self) -> None:
        with self._lock:
            self._states.clear()
            self._texts.clear()
            self._units = 0


def _place(state: _State, text: str, reach: int, shared: tuple[str | int, ...]) -> None:
    """Set ``state``'s text (``text``'s first characters, up to the end of its pieces and ``shared``,
    the pieces after them that a follow-up shares) and where a follow-up's text is cut from (see the
    module docstring)."""
    tokenizer = state.tokenizer
    pieces = state.pieces + shared
    starts = [0]
    for piece in pieces:
        starts.append(starts[-1] + tokenizer.piece_chars(piece))
    end = starts[-1]
    if end > len(text):
        return
    cut = len(pieces)
    while cut and not (
        (isinstance(pieces[cut - 1], int) and starts[cut] <= end - reach + 1)
        or (cut < len(pieces) and isinstance(pieces[cut], int) and starts[cut] <= end - reach)
    ):
        cut -= 1
    state.text = text[:end]
    state.shared = shared
    state.cut = cut
    state.cut_at = starts[cut]
    state.cut_specials = sum(1 for p in pieces[:cut] if isinstance(p, int))
    state.cut_chars = sum(len(p) for p in pieces[:cut] if isinstance(p, str))
