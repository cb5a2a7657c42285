r"""Prompt tokenization identical to the engine's, with a per-segment cache for multi-turn prompts.

``tokenizers`` (and so transformers and vLLM) first cuts the text at added tokens (``<|im_start|>``,
``<|im_end|>`` ...; leftmost-longest match), maps those straight to their ids, and normalizes,
pre-tokenizes and runs the model on each piece in between independently. :class:`SegmentTokenizer`
does the same cut itself with one compiled regex and caches the ids of every ordinary piece by its
text, so a follow-up turn of a chat (same history, one more message) only tokenizes its new pieces.

The cut is only exact when no added token strips neighbouring whitespace or needs word boundaries
(``lstrip``, ``rstrip``, ``single_word``), no added token is matched on normalized text while a
normalizer is set, no pre-tokenizer depends on a piece's position in the whole text (Metaspace with
``prepend_scheme: first``), the model is deterministic (no BPE dropout), no truncation or padding is
configured, and the post-processor only adds fixed tokens around the sequence. Any other tokenizer is
served by :meth:`SegmentTokenizer.encode_whole` (the reference path), with the reason logged once.

:class:`PrefixCursor` tokenizes a text in order, on demand, so a router can stop at the first block no
engine holds. A long piece is cut into chunks only where the cut provably does not change its tokens:
with GPT-2's byte-level pre-tokenizer (``ByteLevel`` with its regex, optionally after ``Digits``; no
normalizer; a BPE model), at a space (U+0020) right after a letter, digit, underscore or printable ASCII
character. No alternative of GPT-2's regex (``'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+``) can match across a non-whitespace character followed by a space (a
space only ever leads a match or sits in a whitespace run), and no attempt made left of the cut reads
past it: every greedy run there stops at the space, and a whitespace run ends before the non-whitespace
character, its lookahead reading that character. The regex has no anchors or lookbehind, so the
matches left of the cut are those of the text cut there and the matches right of it those of the rest
alone; ``Digits`` only isolates digit runs, which contain no space; and BPE runs on each pre-token
independently. So ``tokens(piece) == tokens(piece[:cut]) + tokens(piece[cut:])``. Any other
pre-tokenizer (Llama 3's and Qwen's ``Split`` regexes included) gets whole pieces.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from extproc.models.context import ByteBounds, byte_bounds

logger = logging.getLogger(__name__)

_POSITION_FREE_PRE_TOKENIZERS = frozenset(
    {
        "ByteLevel",
        "Digits",
        "Split",
        "Whitespace",
        "WhitespaceSplit",
        "Punctuation",
        "BertPreTokenizer",
        "CharDelimiterSplit",
        "UnicodeScripts",
        "Metaspace",
        "FixedLength",
    }
)
"""Pre-tokenizers whose output for a piece does not depend on where the piece sits in the text
(Metaspace only without ``prepend_scheme: first``, checked separately)."""


@dataclass(frozen=True)
class CacheLimits:
    """Bounds of the segment cache: least recently used segments are evicted past either bound.

    ``max_tokens`` counts the token ids held (a tuple of ints: about 36 bytes each); a segment longer
    than ``max_tokens`` is tokenized but not cached. The segments' text (the keys) is bounded too, at
    :data:`CHARS_PER_TOKEN` characters per token of ``max_tokens`` (:attr:`max_chars`): a vocabulary's
    long tokens (SmolLM2 has 80 ``#`` in one) would otherwise let a few hundred requests of such text
    hold 80 characters per cached token; prose and code (about 3 to 5 characters a token) never reach it.
    """

    max_entries: int = 100_000
    max_tokens: int = 4_000_000

    @property
    def max_chars(self) -> int:
        """The most characters of segment text held: :data:`CHARS_PER_TOKEN` times ``max_tokens``."""
        return CHARS_PER_TOKEN * self.max_tokens


CHARS_PER_TOKEN = 8
"""Characters of cached segment text allowed per token of :attr:`CacheLimits.max_tokens`."""


@dataclass(frozen=True)
class SegmentStats:
    """Counters since load: segment lookups served from the cache (``hits``) or tokenized (``misses``),
    and the tokens those produced; ``whole`` counts encode() calls served by the reference path."""

    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    whole: int = 0
    entries: int = 0
    cached_tokens: int = 0
    cached_chars: int = 0


@dataclass(frozen=True)
class _Plan:
    """How to cut text: added-token regexes (raw text first, then normalized-matched tokens inside the
    remaining pieces) with their ids, and the ids the post-processor puts around a single sequence."""

    raw: re.Pattern[str] | None
    normalized: re.Pattern[str] | None
    ids: dict[str, int]
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    chunkable: bool = False
    """Whether a long piece may be cut at :data:`_CHUNK_CUT` (see the module docstring)."""


_CHUNK_CUT = re.compile(r"[\w!-~] ")
"""A character that is never whitespace followed by a space: the space is a safe chunk boundary."""

FIRST_CHUNK_CHARS = 96
"""Characters of a long uncached piece tokenized first by a :class:`PrefixCursor` (about 24 tokens of
English, a 16-token block and a half: a follow-up turn's first unheld block, which starts in the held
history's last partial block, mostly completes within it); each next chunk of the same piece is twice as
long, so a piece costs O(log length) tokenizer calls. Measured with SmolLM2's tokenizer on this machine:
a 96-character chunk ~30 µs, a 256-character one ~64 µs (a call costs ~15 µs plus ~0.6 µs a token)."""


class SegmentTokenizer:
    """A ``tokenizers.Tokenizer`` with an exact, cached segment-wise fast path. Thread-safe."""

    def __init__(self, tokenizer: Tokenizer, limits: CacheLimits | None = None, *, name: str = "") -> None:
        self._tokenizer = tokenizer
        self.limits = limits or CacheLimits()
        self.name = name
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._cached_tokens = 0
        self._cached_chars = 0
        self._stats = SegmentStats()
        self._lock = threading.Lock()
        spec = json.loads(tokenizer.to_str())
        skip_special = bool(getattr(tokenizer, "encode_special_tokens", False))
        plan_or_reason = _plan(spec, encode_special_tokens=skip_special)
        self._plan = plan_or_reason if isinstance(plan_or_reason, _Plan) else None
        edges = _post_processor_edges(spec.get("post_processor"))
        #: Cheap token-count bounds from a text's UTF-8 length (byte-level BPE only; else ``None``).
        self.bounds: ByteBounds | None = (
            None if isinstance(edges, str) else byte_bounds(spec, len(edges[0]) + len(edges[1]))
        )
        self.fallback_reason = None if isinstance(plan_or_reason, _Plan) else plan_or_reason
        self._added_chars: dict[int, int] = {}
        self._reach: int | None = None
        if self._plan is not None and self._plan.normalized is None:
            lengths: dict[int, set[int]] = {}
            for content, token_id in self._plan.ids.items():
                lengths.setdefault(token_id, set()).add(len(content))
            if all(len(n) == 1 for n in lengths.values()):
                self._added_chars = {token_id: n.pop() for token_id, n in lengths.items()}
                self._reach = max(self._added_chars.values(), default=1)
        if self.fallback_reason is not None:
            logger.warning(
                "tokenizer %s: segment tokenization disabled (%s); every prompt is tokenized whole",
                name or "?",
                self.fallback_reason,
            )

    @classmethod
    def from_file(cls, path: Path, limits: CacheLimits | None = None, *, name: str = "") -> SegmentTokenizer:
        """Load ``tokenizer.json`` (or a model directory containing it)."""
        if path.is_dir():
            path = path / "tokenizer.json"
        return cls(Tokenizer.from_file(str(path)), limits, name=name)

    @property
    def exact(self) -> bool:
        """Whether :meth:`encode` uses the segment fast path (else it is :meth:`encode_whole`)."""
        return self._plan is not None

    @property
    def backend(self) -> Tokenizer:
        """The wrapped ``tokenizers.Tokenizer`` (read-only use)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def stats(self) -> SegmentStats:
        """A snapshot of the cache counters."""
        with self._lock:
            return replace(
                self._stats,
                entries=len(self._cache),
                cached_tokens=self._cached_tokens,
                cached_chars=self._cached_chars,
            )

    def encode_whole(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text`` tokenized in one piece: exactly what the engine computes."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def split(self, text: str) -> list[str | int]:
        """``text`` cut at added tokens: ordinary pieces as strings, added tokens as their ids.

        Raises RuntimeError when the tokenizer has no exact segment path (see :attr:`fallback_reason`).
        """
        return self._split(text)[0]

    def _split(self, text: str) -> tuple[list[str | int], tuple[int, int]]:
        """:meth:`split`, and how many of its pieces are added tokens and how many characters its
        ordinary pieces hold (the text's, less its added tokens': the pieces partition it)."""
        plan = self._plan
        if plan is None:
            raise RuntimeError(f"segment splitting is not exact for this tokenizer: {self.fallback_reason}")
        pieces, specials, special_chars = _cut(text, plan.raw, plan.ids)
        if plan.normalized is None:
            return pieces, (specials, len(text) - special_chars)
        out: list[str | int] = []
        for piece in pieces:
            if isinstance(piece, str):
                cut, found, found_chars = _cut(piece, plan.normalized, plan.ids)
                out.extend(cut)
                specials += found
                special_chars += found_chars
            else:
                out.append(piece)
        return out, (specials, len(text) - special_chars)

    @property
    def reach(self) -> int | None:
        """How far (characters) the added-token scan of one position reads: the longest added token.
        ``None`` when a text's cut cannot be taken up from a position within it (no exact segment path,
        or added tokens matched inside pieces after normalization, or one id for texts of two lengths):
        :mod:`extproc.routing.history` then finds a follow-up's state by its pieces only."""
        return self._reach

    def piece_chars(self, piece: str | int) -> int:
        """Characters of ``piece`` in the text (an added token's own text); only when :attr:`reach` is
        set."""
        return len(piece) if isinstance(piece, str) else self._added_chars[piece]

    def cut_from(self, text: str, start: int) -> tuple[list[str | int], int, int]:
        """:meth:`split` of ``text[start:]``, the added tokens in it and their characters; only when
        :attr:`reach` is set. It is the rest of ``split(text)`` when ``start`` is a boundary of it."""
        plan = self._plan
        assert plan is not None and plan.normalized is None
        return _cut(text, plan.raw, plan.ids, start)

    def cursor_over(self, pieces: list[str | int], totals: tuple[int, int]) -> PrefixCursor:
        """:meth:`cursor` (``add_special_tokens=False``) over a text whose :meth:`split` is ``pieces``
        (``totals``: its added tokens, its ordinary pieces' characters), the caller vouching for them."""
        plan = self._plan
        assert plan is not None
        return PrefixCursor(self, pieces, [], (), chunkable=plan.chunkable, totals=totals)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``, equal to :meth:`encode_whole`, reusing cached pieces."""
        plan = self._plan
        if plan is None:
            with self._lock:
                self._stats = replace(self._stats, whole=self._stats.whole + 1)
            return self.encode_whole(text, add_special_tokens)
        pieces = self.split(text)
        found: dict[str, tuple[int, ...]] = {}
        hits = hit_tokens = 0
        with self._lock:
            for piece in pieces:
                if isinstance(piece, str) and piece not in found:
                    ids = self._cache.get(piece)
                    if ids is not None:
                        self._cache.move_to_end(piece)
                        found[piece] = ids
        missing = [p for p in dict.fromkeys(p for p in pieces if isinstance(p, str)) if p not in found]
        if missing:
            found.update(self._tokenize(missing))
        out = list(plan.prefix) if add_special_tokens else []
        for piece in pieces:
            if isinstance(piece, int):
                out.append(piece)
            else:
                ids = found[piece]
                out.extend(ids)
                hits += 1
                hit_tokens += len(ids)
        if add_special_tokens:
            out.extend(plan.suffix)
        miss_tokens = sum(len(found[p]) for p in missing)
        with self._lock:
            s = self._stats
            self._stats = replace(
                s,
                hits=s.hits + hits - len(missing),
                misses=s.misses + len(missing),
                hit_tokens=s.hit_tokens + hit_tokens - miss_tokens,
                miss_tokens=s.miss_tokens + miss_tokens,
            )
        return out

    def encode_prefix(self, text: str, add_special_tokens: bool, limit: int) -> tuple[list[int], int]:
        """The leading token ids of ``text`` (at least ``limit`` of them, when it has that many) and an
        estimate of its total length in tokens.

        The ids are exactly ``encode(text)[:len(ids)]``: :meth:`cursor` advanced to ``limit`` tokens (the
        rest is not tokenized at all; its length is :meth:`PrefixCursor.estimate`). A router that hashes
        only a prompt's first blocks needs no more; a long first turn then costs the window, not the
        whole prompt.
        """
        cursor = self.cursor(text, add_special_tokens)
        cursor.advance(limit)
        return list(cursor.ids), cursor.estimate()

    def cursor(self, text: str, add_special_tokens: bool) -> PrefixCursor:
        """A :class:`PrefixCursor` over ``text`` (nothing tokenized yet, unless the tokenizer has no exact
        segment path: then the whole text is tokenized at once and the cursor is done)."""
        plan = self._plan
        if plan is None:
            return PrefixCursor(self, [], self.encode_whole(text, add_special_tokens), (), chunkable=False)
        pieces, totals = self._split(text)
        if not add_special_tokens:
            return PrefixCursor(self, pieces, [], (), chunkable=plan.chunkable, totals=totals)
        return PrefixCursor(
            self, pieces, list(plan.prefix), plan.suffix, chunkable=plan.chunkable, totals=totals
        )

    def holds(self, piece: str) -> bool:
        """Whether ``piece``'s ids are in the segment cache (refreshed as a hit would be): a
        :class:`PrefixCursor` then takes it whole in one step."""
        return self._cached(piece) is not None

    def _cached(self, piece: str) -> tuple[int, ...] | None:
        with self._lock:
            ids = self._cache.get(piece)
            if ids is not None:
                self._cache.move_to_end(piece)
            return ids

    def _remember(self, piece: str, ids: tuple[int, ...]) -> None:
        """Cache ``ids`` (tokenized in chunks) for ``piece``, as :meth:`_tokenize` would have."""
        with self._lock:
            self._store({piece: ids})

    def _store(self, found: dict[str, tuple[int, ...]]) -> None:
        """Insert tokenized pieces (one over ``max_tokens`` or ``max_chars``, or already there, is
        skipped), then drop least recently used segments past any bound; the lock is held."""
        limits = self.limits
        max_chars = limits.max_chars
        for piece, ids in found.items():
            if len(ids) > limits.max_tokens or len(piece) > max_chars or piece in self._cache:
                continue
            self._cache[piece] = ids
            self._cached_tokens += len(ids)
            self._cached_chars += len(piece)
        while (
            len(self._cache) > limits.max_entries
            or self._cached_tokens > limits.max_tokens
            or self._cached_chars > max_chars
        ):
            piece, evicted = self._cache.popitem(last=False)
            self._cached_tokens -= len(evicted)
            self._cached_chars -= len(piece)

    def _chunk(self, text: str) -> list[int]:
        """Ids of a chunk of a piece (not cached: a chunk is not a piece)."""
        return list(self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids)

    def _tokenize(self, pieces: list[str]) -> dict[str, tuple[int, ...]]:
        """Tokenize cache misses in one batch call and insert them into the cache."""
        # encode_batch_fast skips offsets: ~25% cheaper than encode/encode_batch (measured here).
        encodings = self._tokenizer.encode_batch_fast(pieces, add_special_tokens=False)
        result = {p: tuple(e.ids) for p, e in zip(pieces, encodings, strict=True)}
        with self._lock:
            self._store(result)
        return result

    def token_count(self, text: str, add_special_tokens: bool) -> int:
        """Number of tokens :meth:`encode` returns for ``text``."""
        return len(self.encode(text, add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text for token ids (for logs of lengths and tests; never log prompt text)."""
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def clear_cache(self) -> None:
        """Drop every cached segment (counters are kept)."""
        with self._lock:
            self._cache.clear()
            self._cached_tokens = 0
            self._cached_chars = 0


class PrefixCursor:
    """One text's token ids, produced in order on demand (:meth:`SegmentTokenizer.cursor`).

    Invariant: :attr:`ids` is always exactly ``SegmentTokenizer.encode(text)[:len(ids)]``. Each step
    takes the next added token, the next cached piece whole, or the next chunk of an uncached piece
    (whole when the plan is not chunkable or no safe cut lies ahead; see the module docstring). A piece
    finished through chunks is cached whole. Not thread-safe: one request uses it at a time.
    """

    __slots__ = (
        "_chars",
        "_chunk",
        "_chunkable",
        "_next",
        "_offset",
        "_partial",
        "_pieces",
        "_prefix",
        "_rest_chars",
        "_rest_specials",
        "_specials",
        "_suffix",
        "_tok",
        "ids",
        "marks",
    )

    def __init__(
        self,
        tokenizer: SegmentTokenizer,
        pieces: list[str | int],
        ids: Iterable[int],
        suffix: tuple[int, ...],
        *,
        chunkable: bool,
        totals: tuple[int, int] | None = None,
    ) -> None:
        self._tok = tokenizer
        self._pieces = pieces
        self._suffix = suffix
        self._chunkable = chunkable
        self._next = 0  # index of the piece being tokenized
        self._offset = 0  # characters of it already tokenized (chunks)
        self._partial: list[int] = []  # ids of those characters
        self._chunk = FIRST_CHUNK_CHARS
        self._chars = 0  # characters of ordinary pieces tokenized so far
        if totals is None:
            totals = (
                sum(1 for p in pieces if isinstance(p, int)),
                sum(len(p) for p in pieces if isinstance(p, str)),
            )
        self._specials = self._rest_specials = totals[0]  # added tokens (all; not yet taken)
        self._rest_chars = totals[1]  # characters of ordinary pieces (all of them: less _chars left)
        #: The ids so far (read-only for callers; an array: a resumed history is copied in, not boxed).
        self.ids: array[int] = array("q", ids)
        self._prefix = len(self.ids)  # the post-processor's ids before the text
        #: ``len(ids)`` after each piece tokenized so far (read-only; :mod:`extproc.routing.history`).
        self.marks: list[int] = []
        if not pieces:
            self._finish()

    @property
    def done(self) -> bool:
        """Whether :attr:`ids` is the whole text's tokenization (post-processor suffix included)."""
        return self._next > len(self._pieces)

    def advance(self, want: int) -> bool:
        """Tokenize on until :attr:`ids` holds at least ``want`` ids or the text is done; returns
        :attr:`done`."""
        while len(self.ids) < want and not self.done:
            self.step()
        return self.done

    def step(self) -> None:
        """Tokenize the next added token, piece or chunk (nothing when :attr:`done`)."""
        if self.done:
            return
        piece = self._pieces[self._next]
        if isinstance(piece, int):
            self.ids.append(piece)
            self._rest_specials -= 1
            self._next_piece()
            return
        tok = self._tok
        offset = self._offset
        if offset == 0:
            cached = tok._cached(piece)
            if cached is not None:
                self.ids.extend(cached)
                self._chars += len(piece)
                self._next_piece()
                return
        if self._chunkable and len(piece) - offset > self._chunk:
            cut = _CHUNK_CUT.search(piece, offset + self._chunk - 1)
            if cut is not None:
                end = cut.start() + 1
                ids = tok._chunk(piece[offset:end])
                self.ids.extend(ids)
                self._partial.extend(ids)
                self._chars += end - offset
                self._offset = end
                self._chunk *= 2
                return
        self._end(piece)

    def end_piece(self) -> None:
        """Tokenize the rest of the piece in progress in one call and cache the piece whole (as
        :meth:`step` does with its last chunk); nothing at a piece boundary or when :attr:`done`."""
        if self._offset and not self.done:
            piece = self._pieces[self._next]
            assert isinstance(piece, str)  # only an ordinary piece is chunked
            self._end(piece)

    @property
    def chars_left(self) -> int:
        """Characters of ordinary pieces not tokenized yet (cached pieces among them included): a bound
        on the tokenizing left to :attr:`done` (added tokens cost none)."""
        return 0 if self.done else self._rest_chars - self._chars

    @property
    def at_boundary(self) -> bool:
        """Whether no piece is part-way tokenized (every id so far belongs to whole pieces)."""
        return self._offset == 0

    def _end(self, piece: str) -> None:
        tok, offset = self._tok, self._offset
        if offset == 0:
            self.ids.extend(tok._tokenize([piece])[piece])
        else:
            rest = tok._chunk(piece[offset:])
            self.ids.extend(rest)
            tok._remember(piece, (*self._partial, *rest))
        self._chars += len(piece) - offset
        self._next_piece()

    @property
    def pieces(self) -> list[str | int]:
        """The text cut at added tokens (:meth:`SegmentTokenizer.split`; read-only)."""
        return self._pieces

    @property
    def tokenizer(self) -> SegmentTokenizer:
        """The tokenizer this cursor steps with."""
        return self._tok

    def resume(self, k: int, ids: array[int], marks: Iterable[int], chars: int, specials: int) -> None:
        """Put a fresh cursor (nothing stepped) where it would be after its first ``k`` pieces: ``ids``
        must be exactly their tokenization (with the prefix the cursor started with), ``marks`` the ids
        after each, ``chars`` their ordinary characters and ``specials`` how many of them are added
        tokens (:class:`~extproc.routing.history.HistoryMemo` checks the pieces are the ones these were
        remembered for)."""
        if self._next or self._offset or self.done or not 0 < k <= len(self._pieces):
            raise ValueError("resume needs a fresh cursor and a boundary within its pieces")
        self.ids = array("q", ids)  # one copy of the buffer (an "q" array), no int objects made
        self.marks[:] = marks
        self._chars = chars
        self._rest_specials -= specials
        self._next = k
        if k == len(self._pieces):
            self._finish()

    def estimate(self) -> int:
        """The text's length in tokens: exact when :attr:`done`, else the ids so far plus the added tokens
        left, the post-processor's suffix, and the characters left at the ratio of the ordinary pieces'
        ids so far (not the added tokens' nor the prefix's, counted apart) to characters tokenized so far
        (0.25 a character before any)."""
        if self.done:
            return len(self.ids)
        rest_chars = self._rest_chars - self._chars  # those of the pieces left, less the chunks taken
        ordinary = len(self.ids) - self._prefix - (self._specials - self._rest_specials)
        per_char = (ordinary / self._chars) if self._chars else 0.25
        return len(self.ids) + self._rest_specials + round(rest_chars * per_char) + len(self._suffix)

    def _next_piece(self) -> None:
        self.marks.append(len(self.ids))
        self._next += 1
        self._offset = 0
        self._partial = []
        self._chunk = FIRST_CHUNK_CHARS
        if self._next == len(self._pieces):
            self._finish()

    def _finish(self) -> None:
        self.ids.extend(self._suffix)
        self._next = len(self._pieces) + 1


def _cut(
    text: str, pattern: re.Pattern[str] | None, ids: dict[str, int], start: int = 0
) -> tuple[list[str | int], int, int]:
    """``text[start:]`` cut at ``pattern``'s matches (added tokens, as their ids), how many matched and
    their characters. The regex has no anchors or lookbehind, so from a position the scan of the whole
    text tries (a piece boundary) this is the rest of the whole text's cut."""
    if pattern is None:
        return ([text[start:]] if len(text) > start else []), 0, 0
    out: list[str | int] = []
    found = chars = 0
    for match in pattern.finditer(text, start):
        begin, end = match.span()
        if begin > start:
            out.append(text[start:begin])
        out.append(ids[match.group()])
        found += 1
        chars += end - begin
        start = end
    if start < len(text):
        out.append(text[start:])
    return out, found, chars


def _alternation(tokens: Iterable[str]) -> re.Pattern[str] | None:
    """One regex matching any of ``tokens``, longest first so the leftmost match is also the longest."""
    ordered = sorted(set(tokens), key=lambda t: (-len(t), t))
    return re.compile("|".join(map(re.escape, ordered))) if ordered else None


def _plan(spec: dict[str, Any], *, encode_special_tokens: bool) -> _Plan | str:
    """The cutting plan for a serialized tokenizer, or the reason the cut would not be exact."""
    if spec.get("truncation") is not None or spec.get("padding") is not None:
        return "truncation or padding is configured"
    has_normalizer = spec.get("normalizer") is not None
    raw: list[str] = []
    normalized: list[str] = []
    ids: dict[str, int] = {}
    for token in spec.get("added_tokens", []):
        content = token["content"]
        if not content or (encode_special_tokens and token.get("special")):
            continue  # never extracted: plain text for the model
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return f"added token {content!r} has lstrip/rstrip/single_word"
        if token.get("normalized") and has_normalizer:
            return f"added token {content!r} is matched after normalization"
        (normalized if token.get("normalized") else raw).append(content)
        ids[content] = int(token["id"])
    if reason := _pre_tokenizer_reason(spec.get("pre_tokenizer")):
        return reason
    model = spec.get("model") or {}
    if model.get("dropout"):
        return "BPE dropout makes tokenization random"
    edges = _post_processor_edges(spec.get("post_processor"))
    if isinstance(edges, str):
        return edges
    chunkable = (
        spec.get("normalizer") is None
        and model.get("type") == "BPE"
        and _gpt2_split(spec.get("pre_tokenizer"))
    )
    return _Plan(_alternation(raw), _alternation(normalized), ids, edges[0], edges[1], chunkable)


def _gpt2_split(pre: dict[str, Any] | None) -> bool:
    """Whether ``pre`` is GPT-2's byte-level regex split, optionally after ``Digits`` (what a chunk cut at
    :data:`_CHUNK_CUT` is proven exact for; see the module docstring)."""
    if pre is None:
        return False
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not steps or any(step.get("type") != "Digits" for step in steps[:-1]):
        return False
    last = steps[-1]
    return (
        last.get("type") == "ByteLevel"
        and bool(last.get("use_regex", True))
        and not last.get("add_prefix_space", False)
    )


def _pre_tokenizer_reason(pre: dict[str, Any] | None) -> str | None:
    if pre is None:
        return None
    kind = pre.get("type")
    if kind == "Sequence":
        return next((r for p in pre.get("pretokenizers", []) if (r := _pre_tokenizer_reason(p))), None)
    if kind not in _POSITION_FREE_PRE_TOKENIZERS:
        return f"pre-tokenizer {kind} is not known to be position-independent"
    if kind == "Metaspace" and str(pre.get("prepend_scheme", "always")).lower() == "first":
        return "Metaspace prepend_scheme=first depends on the piece's position"
    return None


def _post_processor_edges(post: dict[str, Any] | None) -> tuple[tuple[int, ...], tuple[int, ...]] | str:
    """(ids before, ids after) a single sequence added by the post-processor with add_special_tokens."""
    if post is None:
        return (), ()
    kind = post.get("type")
    if kind == "ByteLevel":
        return (), ()
    if kind in ("BertProcessing", "RobertaProcessing"):
        return (int(post["cls"][1]),), (int(post["sep"][1]),)
    if kind == "Sequence":
        prefix: tuple[int, ...] = ()
        suffix: tuple[int, ...] = ()
        for inner in post.get("processors", []):
            edges = _post_processor_edges(inner)
            if isinstance(edges, str):
                return edges
            prefix, suffix = edges[0] + prefix, suffix + edges[1]
        return prefix, suffix
    if kind == "TemplateProcessing":
        before: list[int] = []
        after: list[int] = []
        seen_sequence = False
        for item in post["single"]:
            if "Sequence" in item:
                seen_sequence = True
            else:
                special = post["special_tokens"][item["SpecialToken"]["id"]]
                (after if seen_sequence else before).extend(special["ids"])
        return tuple(before), tuple(after)
    return f"post-processor {kind} is not supported"
