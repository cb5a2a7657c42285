"""Prompt rendering and tokenization with ``transformers``, as vLLM does it, and the output vocabulary.

Chat requests are rendered with the tokenizer's chat template (``add_generation_prompt``, ``tools`` and
template kwargs passed through) to text, which is then tokenized with ``add_special_tokens=False``;
completion prompts are tokenized with ``add_special_tokens=True``. This is an implementation independent
of kvgate's own template and tokenizer code, which is checked against it.

Simulated output is drawn from plain-word tokens of the vocabulary (``" the"``, ``" cat"``, ...),
seeded by the request, so the same request always produces the same text. The output text is the
concatenation of each token's own decoding.

``transformers`` is imported only when a tokenizer is first loaded, and each model directory (with its
template override) is loaded once per process however many replicas use it.
"""

from __future__ import annotations

import random
import re
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from contracts.digest import pack_tokens

OUTPUT_VOCAB_SIZE = 2048
_MEMO_MIN_CHARS = 1024
_MEMO_ENTRIES = 256
_WORD = re.compile(r" [A-Za-z]{2,}")
_BARE_WORD = re.compile(r"[A-Za-z]+")


class SimTokenizer:
    """A loaded Hugging Face tokenizer plus the simulator's output vocabulary."""

    def __init__(self, hf: Any, chat_template: str | None = None) -> None:
        self._hf = hf
        self._template = chat_template
        self.vocab_size: int = len(hf)
        self._pieces = _output_vocab(hf)
        self._pool = sorted(self._pieces)
        self._memo: OrderedDict[tuple[str, bool], tuple[int, ...]] = OrderedDict()
        self._memo_lock = threading.Lock()

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``. Long texts are memoised (LRU, shared by the replicas of a process): a
        router that asks every replica to tokenize each request (vLLM's router does) would otherwise
        cost the one simulator process N tokenizations per request, CPU that N real engines would not
        take from each other."""
        if len(text) < _MEMO_MIN_CHARS:
            return list(self._hf.encode(text, add_special_tokens=add_special_tokens))
        key = (text, add_special_tokens)
        with self._memo_lock:
            ids = self._memo.get(key)
            if ids is not None:
                self._memo.move_to_end(key)
                return list(ids)
        ids = tuple(self._hf.encode(text, add_special_tokens=add_special_tokens))
        with self._memo_lock:
            self._memo[key] = ids
            if len(self._memo) > _MEMO_ENTRIES:
                self._memo.popitem(last=False)
        return list(ids)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat template applied to ``messages``; raises ``ValueError`` when rendering fails."""
        try:
            text = self._hf.apply_chat_template(
                messages,
                tools=tools,
                chat_template=self._template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(template_kwargs or {}),
            )
        except Exception as exc:  # jinja2 errors, missing template, raise_exception() in templates
            raise ValueError(f"chat template failed: {exc}") from exc
        if not isinstance(text, str):
            raise ValueError("chat template did not render to text")
        return text

    def chat_ids(
        self, messages: list[dict[str, Any]], *, add_special_tokens: bool = False, **kw: Any
    ) -> list[int]:
        """Token ids of a rendered chat, as vLLM feeds them to the engine."""
        return self.encode(self.render_chat(messages, **kw), add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of arbitrary token ids."""
        return str(self._hf.decode(list(token_ids)))

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """Vocabulary strings of token ids (vLLM's ``token_strs``)."""
        return list(self._hf.convert_ids_to_tokens(list(token_ids)))

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence token id, if the tokenizer has one."""
        eos = self._hf.eos_token_id
        return eos if isinstance(eos, int) else None

    def sample_output(
        self, n: int, prompt_ids: Sequence[int], seed: int | None = None, index: int = 0
    ) -> list[int]:
        """``n`` output token ids of choice ``index``, determined by ``seed`` or else by the prompt."""
        base = zlib.crc32(pack_tokens(prompt_ids)) if seed is None else seed
        rng = random.Random(base if index == 0 else f"{base}/{index}")
        pool = self._pool
        return [pool[rng.randrange(len(pool))] for _ in range(n)]

    def pieces(self, token_ids: Sequence[int]) -> list[str]:
        """The text each token adds when ``token_ids`` are decoded in order: output-vocabulary words
        directly, any other ids by incremental decoding (as vLLM's detokenizer streams them)."""
        words = self._pieces
        if all(t in words for t in token_ids):
            return [words[t] for t in token_ids]
        out, previous = [], ""
        for i in range(len(token_ids)):
            text = self.decode(token_ids[: i + 1])
            if text.endswith("\ufffd"):  # a character split across tokens: it comes with the next one
                out.append("")
                continue
            out.append(text[len(previous) :])
            previous = text
        return out

    def alternatives(self, token_id: int, k: int) -> list[int]:
        """``k`` other output-vocabulary tokens, fixed per ``token_id`` (the sim's top logprobs)."""
        pool = self._pool
        start = token_id * 31
        picks = [pool[(start + 7 * j) % len(pool)] for j in range(1, k + 2)]
        return [t for t in picks if t != token_id][:k]

    def token_text(self, token_id: int) -> str:
        """The text of one token alone (what vLLM shows as a logprob's ``token``)."""
        return self._pieces.get(token_id) or self.decode([token_id])


def _output_vocab(hf: Any) -> dict[int, str]:
    """Up to ``OUTPUT_VOCAB_SIZE`` tokens that decode alone to a space and a word (else to a bare word)."""
    special = set(hf.all_special_ids) | set(getattr(hf, "added_tokens_decoder", {}))
    words: dict[int, str] = {}
    bare: dict[int, str] = {}
    for token_id in range(len(hf)):
        if token_id in special:
            continue
        piece = hf.decode([token_id])
        if _WORD.fullmatch(piece):
            words[token_id] = piece
            if len(words) >= OUTPUT_VOCAB_SIZE:
                break
        elif len(bare) < OUTPUT_VOCAB_SIZE and _BARE_WORD.fullmatch(piece):
            bare[token_id] = piece
    if len(words) < 16:
        words.update(bare)
    if not words:
        raise ValueError("the vocabulary has no plain-word tokens to draw output from")
    return words


def read_chat_template(value: str) -> str:
    """vLLM's ``--chat-template``: the contents of a file, or the template text itself."""
    path = Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # inline template text too long to be a file name
        is_file = False
    if is_file:
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat template {value!r} is neither a readable file nor a Jinja template")


_LOCK = threading.Lock()
_LOADED: dict[tuple[str, str | None], SimTokenizer] = {}


def load_tokenizer(model_dir: Path, chat_template: str | None = None) -> SimTokenizer:
    """The tokenizer of ``model_dir`` with an optional template override, loaded once per process."""
    if not (Path(model_dir) / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a model directory (no tokenizer_config.json)")
    key = (str(Path(model_dir).resolve()), chat_template)
    with _LOCK:
        loaded = _LOADED.get(key)
        if loaded is None:
            try:
                from transformers import AutoTokenizer
            except ImportError as exc:  # the simulator is an optional extra of the kvgate distribution
                raise FileNotFoundError(
                    "the simulator needs transformers: pip install 'kvgate[sim]' (./dev installs it)"
                ) from exc

            template = read_chat_template(chat_template) if chat_template is not None else None
            hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
            loaded = _LOADED[key] = SimTokenizer(hf, template)
    return loaded
