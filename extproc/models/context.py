"""A model's context window: its length in tokens, and cheap bounds on how many tokens a text can be.

The context length (``max_model_len``, prompt plus output tokens) comes from the gateway config, else from
the model directory's ``tokenizer_config.json`` ``model_max_length`` (the GGUF export writes the GGUF's
``<arch>.context_length`` there, :func:`engines.gguf.tokenizer_config`). Transformers writes huge
sentinels such as ``int(1e30)`` when the length is unknown: values above :data:`MAX_CONTEXT` mean unknown.

:class:`ByteBounds` holds for byte-level BPE tokenizers (GPT-2 style: ``ByteLevel`` pre-tokenizer, BPE over
the 256 byte symbols, no normalizer). There every ordinary token stands for 1 to ``max_token_bytes`` UTF-8
bytes of the text and every added token matches at least one byte of it, so a text of ``B`` bytes has
between ``ceil(B / max_token_bytes)`` and ``B`` tokens, plus the ones the post-processor puts around it
(bytes the vocabulary has no symbol for are dropped and not counted).
For any other tokenizer the bounds are unknown (``None``) and only tokenizing tells.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_CONTEXT = 1 << 30
"""Larger ``model_max_length`` values are "unknown" sentinels, not context lengths."""

#: Pre-tokenizers that only cut the text, never drop, add or change a byte of it (``Split`` unless its
#: behavior is ``Removed``; ``ByteLevel`` without ``add_prefix_space``; both checked separately).
_CUTTING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Digits", "Split"})


def read_max_model_len(model_dir: Path) -> int | None:
    """``model_max_length`` from ``model_dir/tokenizer_config.json`` when it is a sane length in tokens
    (an integer from 1 to :data:`MAX_CONTEXT`); ``None`` when absent, unreadable or a sentinel."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = config.get("model_max_length") if isinstance(config, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONTEXT:
        return None
    return value


@dataclass(frozen=True, slots=True)
class ByteBounds:
    """Token-count bounds of a byte-level BPE tokenizer.

    ``max_token_bytes``: the most UTF-8 bytes one token (ordinary or added) stands for; ``edge_tokens``:
    the tokens the post-processor adds around a sequence when special tokens are added (they stand for
    no bytes of the text); ``dropped``: the bytes the vocabulary has no symbol for, which BPE without an
    unknown token silently drops (SmolLM2 lacks six ASCII control characters and two 4-byte UTF-8 leads).
    """

    max_token_bytes: int
    edge_tokens: int = 0
    dropped: bytes = b""

    def most(self, size: int, add_special_tokens: bool) -> int:
        """The most tokens a text of ``size`` UTF-8 bytes can be: one per byte, plus the edges."""
        return size + (self.edge_tokens if add_special_tokens else 0)

    def fewest(self, data: bytes, add_special_tokens: bool) -> int:
        """The fewest tokens the UTF-8 text ``data`` can be: its bytes that have a symbol, divided by the
        longest token (rounded up), plus the edges. Counts the dropped bytes: one pass over ``data`` per
        dropped byte (ASCII ones only for ASCII text)."""
        ascii_only = data.isascii()
        dropped = sum(data.count(b) for b in self.dropped if b < 0x80 or not ascii_only)
        edges = self.edge_tokens if add_special_tokens else 0
        return -(-(len(data) - dropped) // self.max_token_bytes) + edges


def byte_bounds(spec: dict[str, Any], edge_tokens: int) -> ByteBounds | None:
    """The bounds of the serialized tokenizer ``spec`` (``tokenizer.json``), or ``None`` when it is not
    byte-level BPE as :class:`ByteBounds` needs: a BPE model without dropout, unknown-token fusing or word
    affixes; no normalizer; pre-tokenizers that only cut the text, one of them ``ByteLevel``.
    ``edge_tokens``: what the post-processor adds around one sequence."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") or model.get("fuse_unk"):
        return None
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None
    if spec.get("normalizer") is not None or not _byte_level(spec.get("pre_tokenizer")):
        return None
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not vocab:
        return None
    # With an unknown token, a byte without a symbol becomes one token of one byte; without, it is dropped.
    missing = bytes(b for b in _UTF8_BYTES if _BYTE_SYMBOLS[b] not in vocab)
    dropped = b"" if model.get("unk_token") else missing
    # A vocabulary entry has one symbol per byte (entries with other symbols are never produced from
    # byte-level text; counting their characters only loosens the bound).
    longest = max(len(token) for token in vocab)
    for added in spec.get("added_tokens", []):
        longest = max(longest, len(str(added.get("content", "")).encode("utf-8")))
    return ByteBounds(max_token_bytes=longest, edge_tokens=edge_tokens, dropped=dropped)


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet in byte order: printable Latin-1 bytes stand for themselves, the
    others for the code points from 256 on, in byte order (the mapping ``ByteLevel`` uses)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


_BYTE_SYMBOLS = _byte_symbols()
#: Bytes that occur in UTF-8 text (never 0xC0, 0xC1 or 0xF5 and up).
_UTF8_BYTES = [b for b in range(256) if b not in (0xC0, 0xC1) and b < 0xF5]


def _byte_level(pre: dict[str, Any] | None) -> bool:
    """Whether ``pre`` keeps every byte of the text and includes a ``ByteLevel`` step."""
    steps = _steps(pre)
    return steps is not None and any(step.get("type") == "ByteLevel" for step in steps)


def _steps(pre: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """The pre-tokenizer's steps, flattened; ``None`` when one of them may drop or add bytes."""
    if pre is None:
        return []
    kind = pre.get("type")
    if kind == "Sequence":
        steps: list[dict[str, Any]] = []
        for inner in pre.get("pretokenizers", []):
            inner_steps = _steps(inner)
            if inner_steps is None:
                return None
            steps += inner_steps
        return steps
    if kind not in _CUTTING_PRE_TOKENIZERS:
        return None
    if kind == "ByteLevel" and pre.get("add_prefix_space"):
        return None
    if kind == "Split" and str(pre.get("behavior", "")).lower() == "removed":
        return None
    return [pre]
