"""A model's tokens per byte of prompt text: what a prompt's length in tokens is estimated from without
tokenizing it (the ``prefix`` and ``kv-tier`` scorers' denominator, :mod:`extproc.routing.router`).

The ratio is measured once, when the model loads, by tokenizing :data:`SAMPLE` (a chat turn of English
prose, a code block and JSON, the mix a chat prompt carries) with the model's own tokenizer:
``tokens / UTF-8 bytes``. It is a constant of the model, so an estimate made from it is a pure function
of the prompt: the same whether the router tokenized all of the prompt or stopped at its first block
nobody holds. Its error is the prompt's departure from the sample's mix (README.md, "Estimated length").
"""

from __future__ import annotations

from extproc.models.tokenizer import SegmentTokenizer

SAMPLE = (
    "The cache keeps the prompt's key and value tensors, block by block, so a request that repeats a"
    " long prefix (a system prompt, the earlier turns of a conversation, a shared document) skips most"
    " of its prefill. Routing a request to the replica that already holds its prefix is therefore worth"
    " far more than a slightly shorter queue, unless that replica is overloaded: then the prefix is"
    " computed again elsewhere, and the two copies compete for memory until one is evicted.\n\n"
    "Could you check why the test below fails on the second run, and suggest a fix?\n\n"
    "```python\n"
    "def load(path: str) -> dict[str, int]:\n"
    "    counts: dict[str, int] = {}\n"
    "    with open(path, encoding='utf-8') as f:\n"
    "        for line in f:\n"
    "            word = line.strip().lower()\n"
    "            if word:\n"
    "                counts[word] = counts.get(word, 0) + 1\n"
    "    return counts\n"
    "```\n\n"
    '{"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "Summarise the report."}],'
    ' "max_tokens": 256, "temperature": 0.7, "stream": true}\n'
)
"""The calibration text: about 1 kB of prose, code and JSON."""


def tokens_per_byte(tokenizer: SegmentTokenizer) -> float:
    """``tokens / bytes`` of :data:`SAMPLE` with ``tokenizer`` (no special tokens), in ``(0, 1]``."""
    data = SAMPLE.encode("utf-8")
    tokens = len(tokenizer.encode_whole(SAMPLE, add_special_tokens=False))
    return min(1.0, max(tokens, 1) / len(data))
