"""The OpenAI/vLLM response side: bodies, stream chunks, usage and logprobs, shaped as vLLM 0.33's. No IO.

Logprobs are made up but fixed per token and position: the sampled token has the highest, its
alternatives (other output-vocabulary tokens) come after it, half a nat apart. How sure the model is
follows the prompt (:func:`confidence`): the sampled token's logprob lies in [-0.10, -0.01] for an easy
prompt, [-3.0, -1.0] for a hard one, [-0.55, -0.05] otherwise, so a cascade's logprob gate (kvgate's
``extproc/cascade``) can be driven deterministically.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from load.sim.output import Plan


class Vocab(Protocol):
    """The tokenizer operations logprobs need (:class:`load.sim.tokenizer.SimTokenizer` is one)."""

    def token_text(self, token_id: int) -> str:
        """The text of one token alone."""
        ...

    def alternatives(self, token_id: int, k: int) -> list[int]:
        """``k`` tokens shown as the alternatives of ``token_id``."""
        ...


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The ``usage`` object; ``cached_tokens`` are prompt tokens served from the prefix cache (vLLM
    reports them with ``--enable-prompt-tokens-details``, which the sim always behaves as set)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


#: Prompt markers: a prompt (a chat's last user message, a completion's prompt) holding ``[hard]`` gets
#: unsure answers, one holding ``[easy]`` (and not ``[hard]``) sure ones; any other: the default.
HARD_MARKER = "[hard]"
EASY_MARKER = "[easy]"
#: Confidence -> (highest, span) of the sampled token's logprob: it lies in [highest - span, highest].
_CONFIDENCE = {"easy": (-0.01, 0.09), "hard": (-1.0, 2.0), "default": (-0.05, 0.5)}


def confidence(prompt: str) -> str:
    """``easy``, ``hard`` or ``default``: how sure the simulated model is of its answer to ``prompt``."""
    if HARD_MARKER in prompt:
        return "hard"
    return "easy" if EASY_MARKER in prompt else "default"


def _logprob(token: int, position: int, rank: int, sure: str = "default") -> float:
    base = ((token * 2654435761 + position * 40503) % 10007) / 10007
    highest, span = _CONFIDENCE[sure]
    return round(highest - span * base - 0.5 * rank, 4)


def chat_logprobs(
    vocab: Vocab, token_ids: Sequence[int], k: int, start: int = 0, sure: str = "default"
) -> dict[str, Any]:
    """``choices[].logprobs`` of a chat choice: one entry per token (positions from ``start``), each with
    ``k`` ``top_logprobs`` (the sampled token first); ``sure``: :func:`confidence` of the prompt."""

    def entry(token: int, position: int, rank: int) -> dict[str, Any]:
        text = vocab.token_text(token)
        return {"token": text, "logprob": _logprob(token, position, rank, sure), "bytes": list(text.encode())}

    content = []
    for position, token in enumerate(token_ids, start):
        top = [token, *vocab.alternatives(token, k - 1)] if k > 0 else []
        item = entry(token, position, 0)
        item["top_logprobs"] = [entry(t, position, rank) for rank, t in enumerate(top)]
        content.append(item)
    return {"content": content}


def completion_logprobs(
    vocab: Vocab,
    token_ids: Sequence[int],
    pieces: Sequence[str],
    k: int,
    start: int = 0,
    offset: int = 0,
    sure: str = "default",
) -> dict[str, Any]:
    """``choices[].logprobs`` of a completion choice: parallel lists over the tokens; ``offset`` is the
    text already sent before these tokens (``text_offset`` counts from it)."""
    text_offset, token_logprobs, tokens, top_logprobs = [], [], [], []
    for position, (token, piece) in enumerate(zip(token_ids, pieces, strict=True), start):
        text = vocab.token_text(token)
        text_offset.append(offset)
        offset += len(piece)
        token_logprobs.append(_logprob(token, position, 0, sure))
        tokens.append(text)
        top = [token, *vocab.alternatives(token, k - 1)] if k > 0 else []
        top_logprobs.append({vocab.token_text(t): _logprob(t, position, r, sure) for r, t in enumerate(top)})
    return {
        "text_offset": text_offset,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }


def tool_calls(plan: Plan) -> list[dict[str, Any]]:
    """``message.tool_calls`` of a choice (empty without a call)."""
    call = plan.tool_call
    if call is None:
        return []
    return [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]


def chat_message(plan: Plan, role: str, forced_tool: bool, echo: str = "") -> dict[str, Any]:
    """``choices[].message``: vLLM's ``ChatMessage`` dump (``tool_calls`` only when there are some;
    ``content`` ``""`` beside a forced call, ``null`` beside an automatic one)."""
    calls = tool_calls(plan)
    content: str | None = echo + plan.text
    if calls and not forced_tool:
        content = echo or None
    message: dict[str, Any] = {
        "role": role,
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    if calls:
        message["tool_calls"] = calls
    return message


def chat_response(
    rid: str, created: int, model: str, choices: list[dict[str, Any]], use: dict[str, Any]
) -> dict[str, Any]:
    """A non-streamed ``chat.completion``."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": use,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "kv_transfer_params": None,
    }


def completion_response(
    rid: str, created: int, model: str, choices: list[dict[str, Any]], use: dict[str, Any]
) -> dict[str, Any]:
    """A non-streamed ``text_completion``."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": use,
        "kv_transfer_params": None,
    }


def chunk(
    rid: str, obj: str, created: int, model: str, choice: dict[str, Any], use: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One streamed chunk carrying one choice (vLLM sends each choice index in chunks of its own);
    ``use`` with ``continuous_usage_stats``."""
    body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if use is not None:
        body["usage"] = use
    return body


def usage_chunk(rid: str, obj: str, created: int, model: str, use: dict[str, Any]) -> dict[str, Any]:
    """The final chunk of a stream with ``include_usage``."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def models_response(
    model: str, root: str, max_model_len: int, created: int, adapters: Sequence[str] = ()
) -> dict[str, Any]:
    """``GET /v1/models``: vLLM's ``ModelCard`` with one default ``ModelPermission``, then one card per
    LoRA adapter (``root`` its name here, ``parent`` the base model, as vLLM lists ``--lora-modules``)."""
    permission = {
        "id": f"modelperm-{model}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    card = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [permission],
    }
    cards = [card]
    for name in adapters:
        cards.append({**card, "id": name, "root": name, "parent": model, "permission": [permission]})
    return {"object": "list", "data": cards}
