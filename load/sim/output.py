"""What each choice of a request will say, decided before the engine runs. No IO.

The engine only decides *when* tokens appear; this module decides *which*, deterministically (the same
request gives the same answer). A :class:`Plan` is a choice's token ids, the text each token adds, and
how the choice ends:

* plain text: words drawn from the output vocabulary, seeded by ``seed`` (else the prompt) and the
  choice index, ``max_tokens`` long (``finish_reason`` ``"length"``) unless a ``stop`` string or a
  ``stop_token_ids`` token ends it first (``"stop"``, ``stop_reason`` the string or id; as in vLLM the
  stop string is cut from the text, the token that completed it is counted);
* JSON (``response_format`` ``json_object``/``json_schema``): a JSON value (an instance of the schema:
  each property, strings from the vocabulary, ``1`` for numbers) tokenized, then EOS: ``"stop"`` when it
  fits in ``max_tokens``, else cut there with ``"length"`` (invalid JSON, as a real engine would give);
* a tool call: ``{"name": ..., "arguments": {...}}`` tokenized then EOS, the arguments an instance of the
  function's ``parameters`` schema; ``"tool_calls"`` (``"stop"`` for a named ``tool_choice``, as vLLM
  reports it), or a text answer cut at ``"length"`` when it does not fit.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from load.sim.protocol import Sampling, Tools


class Vocab(Protocol):
    """The tokenizer operations planning needs (:class:`load.sim.tokenizer.SimTokenizer` is one)."""

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence token, if the tokenizer has one."""
        ...

    def sample_output(
        self, n: int, prompt_ids: Sequence[int], seed: int | None = None, index: int = 0
    ) -> list[int]:
        """``n`` word tokens for choice ``index``, determined by ``seed`` (else the prompt)."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``."""
        ...

    def pieces(self, token_ids: Sequence[int]) -> list[str]:
        """The text each token adds when ``token_ids`` are decoded in order."""
        ...


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A planned tool call: OpenAI's ``id``, the function ``name`` and its ``arguments`` (JSON text)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Plan:
    """One choice: ``token_ids`` the engine emits (EOS or a stop token included), ``pieces`` the text
    each adds (``""`` for EOS, stop tokens and what a stop string cut), how it ends, and its tool call."""

    token_ids: tuple[int, ...]
    pieces: tuple[str, ...]
    finish_reason: str
    stop_reason: str | int | None = None
    tool_call: ToolCall | None = None

    @property
    def text(self) -> str:
        """The choice's whole text (a tool call's text is not content)."""
        return "" if self.tool_call is not None else "".join(self.pieces)


def plan_choice(
    vocab: Vocab,
    prompt: Sequence[int],
    max_tokens: int,
    sampling: Sampling,
    index: int,
    *,
    response_format: dict[str, Any] | None = None,
    tools: Tools | None = None,
    after_tool_result: bool = False,
    structured_max_tokens: int | None = None,
) -> Plan:
    """The plan of choice ``index`` of a request whose prompt is ``prompt``. ``after_tool_result``: the
    conversation ends with a tool's answer, so an ``"auto"`` tool choice answers in text.
    ``structured_max_tokens``: the limit of a tool call or JSON answer (default ``max_tokens``), which end
    with EOS as a model's would; a chat request without ``max_tokens`` gets the rest of the context there,
    as vLLM does, while free text keeps the documented default length (the simulator has no EOS model)."""
    structured = max_tokens if structured_max_tokens is None else structured_max_tokens
    words = vocab.sample_output(max_tokens, prompt, sampling.seed, index)
    function = tools.function() if tools is not None else None
    if tools is not None and function is not None and not (tools.mode == "auto" and after_tool_result):
        rng = random.Random(words[0] if words else 0)
        arguments = json.dumps(instance(function.get("parameters") or {}, vocab, words, rng))
        value = {"name": function["name"], "arguments": json.loads(arguments)}
        plan = _json_plan(vocab, value, structured)
        if plan.finish_reason == "length":
            return plan
        call = ToolCall(f"chatcmpl-tool-{uuid.uuid4().hex}", function["name"], arguments)
        finish = "stop" if tools.mode == "named" else "tool_calls"
        return Plan(plan.token_ids, plan.pieces, finish, None, call)
    if response_format is not None:
        rng = random.Random(words[0] if words else 0)
        schema = response_format.get("schema") if response_format["type"] == "json_schema" else None
        value = instance(schema, vocab, words, rng) if schema else {"answer": _phrase(vocab, words, rng)}
        return _json_plan(vocab, value, structured)
    return _text_plan(vocab, words, sampling)


def _text_plan(vocab: Vocab, words: list[int], sampling: Sampling) -> Plan:
    pieces = vocab.pieces(words)
    stop_ids = set(sampling.stop_token_ids)
    text = ""
    for i, (token, piece) in enumerate(zip(words, pieces, strict=True)):
        if token in stop_ids:
            kept = piece if sampling.include_stop_str else ""
            return Plan(tuple(words[: i + 1]), (*pieces[:i], kept), "stop", token)
        before = len(text)
        text += piece
        for stop in sampling.stop:
            at = text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0:
                end = at + len(stop) if sampling.include_stop_str else at
                return Plan(tuple(words[: i + 1]), _cut(pieces[: i + 1], end), "stop", stop)
    return Plan(tuple(words), tuple(pieces), "length")


def _cut(pieces: Sequence[str], end: int) -> tuple[str, ...]:
    """``pieces`` trimmed so that they join to the first ``end`` characters (one piece per token kept)."""
    out, used = [], 0
    for piece in pieces:
        keep = piece[: max(0, end - used)]
        out.append(keep)
        used += len(keep)
    return tuple(out)


def _json_plan(vocab: Vocab, value: object, max_tokens: int) -> Plan:
    ids = vocab.encode(json.dumps(value), add_special_tokens=False)
    if len(ids) >= max_tokens or vocab.eos_token_id is None:
        ids = ids[:max_tokens]
        return Plan(tuple(ids), tuple(vocab.pieces(ids)), "length" if len(ids) == max_tokens else "stop")
    return Plan((*ids, vocab.eos_token_id), (*vocab.pieces(ids), ""), "stop")


def _phrase(vocab: Vocab, words: Sequence[int], rng: random.Random, n: int = 3) -> str:
    pieces = vocab.pieces(words[:n]) if words else ["text"]
    return "".join(pieces).strip() or "text"


def instance(schema: Any, vocab: Vocab, words: Sequence[int], rng: random.Random, depth: int = 0) -> Any:
    """A JSON value satisfying the common parts of a JSON schema: ``const``, ``enum``, ``anyOf``/``oneOf``
    (first branch), objects (every property, recursively), arrays (one item), strings (a few words from
    ``words``), integers and numbers (``1``), booleans (``true``), ``null``. Anything else: ``{}``."""
    if not isinstance(schema, dict) or depth > 8:
        return {}
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return instance(schema[key][0], vocab, words, rng, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and "properties" in schema):
        props = schema.get("properties")
        if not isinstance(props, dict):
            return {}
        return {name: instance(sub, vocab, words, rng, depth + 1) for name, sub in props.items()}
    if kind == "array":
        return [instance(schema.get("items", {"type": "string"}), vocab, words, rng, depth + 1)]
    if kind == "string":
        start = rng.randrange(max(1, len(words) - 2)) if words else 0
        return _phrase(vocab, words[start:], rng, 2)
    if kind in ("integer", "number"):
        return 1
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return {}
