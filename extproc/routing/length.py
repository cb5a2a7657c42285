"""The context-length check: a prompt that leaves no room in the model's context is refused with a 400
before any engine sees it, tokenizing no more of the prompt than it takes to know.

The rule is vLLM's (0.33, ``renderers/params.py`` ``_token_len_check`` and
``entrypoints/serve/utils/api_utils.py`` ``get_max_tokens``): a prompt of more than ``max_model_len``
tokens is refused, and one of exactly ``max_model_len`` is too (no output token fits: vLLM's
"max_tokens must be at least 1"). ``max_tokens`` does not enter into it: vLLM clamps it to what the prompt
leaves of the context rather than refusing, so the gateway refuses only what every engine would.

The answer is 400 with OpenAI's body, not vLLM's::

    {"error": {"message": "This model's maximum context length is 8192 tokens. However, your prompt
     contains at least 8193 input tokens, which exceeds this limit even without any output tokens. Please
     reduce the length of the input prompt.",
     "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}

vLLM answers ``{"type": "BadRequestError", "param": "input_tokens", "code": 400}`` (an integer);
kvgate uses OpenAI's string code ``context_length_exceeded``, which OpenAI SDK users already match on
(``openai.BadRequestError.code``), with ``param`` ``messages`` (chat) or ``prompt`` (completions). The
message is vLLM's; like vLLM, which tokenizes at most one token past the context, it states "at least" a
count: exact when the whole prompt was tokenized, a lower bound otherwise.

How little is tokenized (:func:`triage`): with a byte-level BPE tokenizer
(:class:`extproc.models.context.ByteBounds`), a prompt of no more UTF-8 bytes than tokens allowed fits
without tokenizing beyond the digest window, and one longer than the allowance times the longest token's
bytes is refused without tokenizing at all (vLLM makes the same check on characters); in between, and for
any other tokenizer, the leading ``allowed + 1`` tokens are counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from extproc.errors import ContextLengthExceeded
from extproc.models.context import ByteBounds


class Verdict(Enum):
    """What a prompt's UTF-8 length says about its token count against the allowance."""

    FITS = "fits"
    """At most the allowed tokens, whatever they are."""
    TOO_LONG = "too_long"
    """More than allowed, whatever they are."""
    COUNT = "count"
    """Unknown until the leading ``allowed + 1`` tokens are counted."""


def verdict(fewest: int, most: int, allowed: int) -> Verdict:
    """The verdict for a prompt known to be ``fewest`` to ``most`` tokens when ``allowed`` may be used."""
    if fewest > allowed:
        return Verdict.TOO_LONG
    if most <= allowed:
        return Verdict.FITS
    return Verdict.COUNT


def triage(
    text: str, allowed: int, bounds: ByteBounds | None, add_special_tokens: bool
) -> tuple[Verdict, int]:
    """The verdict for ``text`` from its UTF-8 length alone, and the fewest tokens it can be (0 where
    unknown). Without ``bounds`` only counting tells. The dropped bytes are counted only when the text is
    longer in bytes than ``allowed`` (a few milliseconds per megabyte, far less than tokenizing)."""
    if bounds is None:
        return verdict(0, allowed + 1, allowed), 0
    data = text.encode("utf-8", "surrogatepass")
    most = bounds.most(len(data), add_special_tokens)
    fewest = 0 if most <= allowed else bounds.fewest(data, add_special_tokens)
    return verdict(fewest, most, allowed), fewest


@dataclass(frozen=True, slots=True)
class ContextLimit:
    """The context of the requested model: ``max_model_len`` tokens; ``param``: what the prompt is called
    in errors (``messages`` or ``prompt``)."""

    max_model_len: int
    param: str

    @classmethod
    def of(cls, max_model_len: int | None, chat: bool) -> ContextLimit | None:
        """The limit of a chat or completion request (``None`` when the context length is unknown)."""
        if max_model_len is None:
            return None
        return cls(max_model_len, "messages" if chat else "prompt")

    @property
    def allowed(self) -> int:
        """The most prompt tokens that leave room for an output token."""
        return self.max_model_len - 1

    def check(self, prompt_tokens: int) -> None:
        """Raise :class:`ContextLengthExceeded` when ``prompt_tokens`` (known to be at least that many)
        exceed :attr:`allowed`."""
        if prompt_tokens > self.allowed:
            raise self.exceeded(prompt_tokens)

    def exceeded(self, at_least: int) -> ContextLengthExceeded:
        """The 400 for a prompt of at least ``at_least`` tokens, in vLLM's words."""
        why = (
            "which exceeds this limit even without any output tokens"
            if at_least > self.max_model_len
            else "which leaves no room for output tokens"
        )
        return ContextLengthExceeded(
            f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt"
            f" contains at least {at_least} input tokens, {why}. Please reduce the length of the input"
            " prompt.",
            param=self.param,
        )
