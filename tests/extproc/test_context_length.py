"""Over-length prompts in memory: refused with 400 ``context_length_exceeded`` by the StreamProcessor before
any routing (a prompt must leave room for one output token), tokenizing no more than it takes to know; and
the default body limit the gateway derives from its models' contexts.

SmolLM2-135M-Instruct's files give it 8192 tokens of context; ``"hello" + " hello" * k`` is exactly
``k + 1`` tokens with its tokenizer (checked below), which puts prompts on either side of the edge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from extproc.config import DEFAULT_MAX_BODY_BYTES, parse_config
from extproc.models.registry import ModelAssets
from extproc.models.tokenizer import CacheLimits, SegmentTokenizer
from extproc.routing.router import Router
from extproc.server import Gateway
from tests.extproc.test_processor import (
    ACME_KEY,
    ADDRESSES,
    MODEL,
    OTHER,
    error,
    make_gate,
    make_router,
    processor,
    reply,
    route,
)

CONTEXT = 8192
COMPLETIONS = "/v1/completions"
BIG = 16 * 1024 * 1024  # a body limit the 4 MiB prompt stays under


@pytest.fixture(scope="module")
def smol(model_dir: str) -> ModelAssets:
    return ModelAssets.load(MODEL, Path(model_dir))


@pytest.fixture
def router(smol: ModelAssets) -> Router:
    return make_router(smol)


@dataclasses.dataclass
class Calls:
    """The tokenizer calls a request made: ``encode_prefix`` limits, and whole-prompt ``encode`` calls."""

    prefix_limits: list[int] = dataclasses.field(default_factory=list)
    whole: int = 0


@pytest.fixture
def calls(smol: ModelAssets, monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    tokenizer: SegmentTokenizer = smol.tokenizer
    seen = Calls()
    encode_prefix, encode = tokenizer.encode_prefix, tokenizer.encode

    def spy_prefix(text: str, add_special_tokens: bool, limit: int) -> tuple[list[int], int]:
        seen.prefix_limits.append(limit)
        return encode_prefix(text, add_special_tokens, limit)

    def spy_encode(text: str, add_special_tokens: bool) -> list[int]:
        seen.whole += 1
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode_prefix", spy_prefix)
    monkeypatch.setattr(tokenizer, "encode", spy_encode)
    yield seen


def hellos(n: int) -> str:
    """A prompt of exactly ``n`` SmolLM2 tokens (as a completion prompt)."""
    return "hello" + " hello" * (n - 1)


def completion(prompt: object, **extra: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": prompt, **extra})


def user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def chat_of(content: str, model: str = MODEL, **extra: Any) -> bytes:
    return orjson.dumps({"model": model, "messages": [user(content)], **extra})


def refused(router: Router, payload: bytes, path: str = "/v1/chat/completions", **kw: Any) -> dict[str, Any]:
    """The OpenAI error of a request the gateway refused as too long; nothing was routed."""
    proc = processor(router, **kw)
    before = [s.in_flight for s in router.fleet]
    status, err, _ = error(route(proc, payload, path=path, extra=ACME_KEY if "gate" in kw else None))
    assert (status, err["type"], err["code"]) == (400, "invalid_request_error", "context_length_exceeded")
    assert proc.decision is None and proc.ticket is None and [s.in_flight for s in router.fleet] == before
    return err


def routed(router: Router, payload: bytes, path: str = "/v1/chat/completions") -> None:
    assert set(reply(route(processor(router), payload, path=path)).destination) <= set(ADDRESSES)


def test_hellos_count_exactly(smol: ModelAssets) -> None:
    for n in (1, 2, 500, CONTEXT):
        assert len(smol.tokenizer.encode_whole(hellos(n), add_special_tokens=True)) == n


def test_the_context_comes_from_smollm2s_files(smol: ModelAssets) -> None:
    assert smol.max_model_len == CONTEXT


@pytest.mark.parametrize("chat", [False, True])
def test_a_prompt_must_leave_room_for_one_output_token(router: Router, smol: ModelAssets, chat: bool) -> None:
    """Exactly at the edge, chat (rendered with the template) and completions alike."""
    if chat:

        def rendered(content: str) -> int:
            text = smol.template.render([user(content)], add_generation_prompt=True)
            return len(smol.tokenizer.encode_whole(text, add_special_tokens=False))

        overhead = rendered(hellos(100)) - 100  # the template's own tokens
        assert rendered(hellos(500)) == 500 + overhead
        payload, path = (lambda n: chat_of(hellos(n - overhead))), "/v1/chat/completions"
    else:
        payload, path = (lambda n: completion(hellos(n))), COMPLETIONS
    routed(router, payload(CONTEXT - 1), path)
    err = refused(router, payload(CONTEXT), path)
    assert err["param"] == ("messages" if chat else "prompt")
    assert err["message"] == (
        f"This model's maximum context length is {CONTEXT} tokens. However, your prompt contains at least"
        f" {CONTEXT} input tokens, which leaves no room for output tokens. Please reduce the length of the"
        " input prompt."
    )
    assert (
        "at least 8193 input tokens, which exceeds this limit even without any output tokens"
        in (refused(router, payload(CONTEXT + 1), path)["message"])
    )


def test_max_tokens_is_left_to_the_engine(router: Router) -> None:
    """vLLM clamps max_tokens to what the prompt leaves of the context: the gateway refuses no more."""
    routed(router, completion(hellos(8000), max_tokens=1000), COMPLETIONS)
    routed(router, chat_of(hellos(8000), max_completion_tokens=10_000))
    refused(router, chat_of(hellos(9000), max_tokens=1))


def test_token_id_prompts_are_counted_as_given(router: Router) -> None:
    routed(router, completion([1] * (CONTEXT - 1)), COMPLETIONS)
    assert "at least 8192 input tokens" in refused(router, completion([1] * CONTEXT), COMPLETIONS)["message"]


def test_a_huge_prompt_is_refused_without_tokenizing(router: Router, calls: Calls) -> None:
    """The 21 MB case: text longer than the allowance times the longest token (81 bytes) cannot fit."""
    content = "x" * (4 * 1024 * 1024)
    err = refused(router, chat_of(content), limit=BIG)
    assert calls == Calls()  # neither a prefix nor the whole prompt was tokenized
    at_least = int(err["message"].split("at least ")[1].split()[0])
    assert at_least >= len(content) // 81
    # The same with token budgets (exact counts): refused before admission, still untokenized.
    refused(router, chat_of(content), gate=make_gate(), limit=BIG)
    assert calls == Calls()


def test_tokenizes_only_as_far_as_it_must(router: Router, calls: Calls) -> None:
    routed(router, chat_of("What is kvgate?"))  # at most as many bytes as tokens allowed
    # Nothing to count: the router's lazy cursor tokenizes it only up to the first block nobody holds
    # (tests/extproc/routing/test_lazy_tokens.py), neither a counted prefix nor the whole prompt.
    assert calls == Calls()
    calls.prefix_limits.clear()
    # More bytes than tokens allowed, but fewer tokens: the leading allowance + 1 tokens are counted.
    routed(router, chat_of(hellos(3000)))
    assert calls.prefix_limits == [CONTEXT]
    calls.prefix_limits.clear()
    refused(router, chat_of(hellos(9000)))
    assert calls.prefix_limits == [CONTEXT] and calls.whole == 0


def test_with_budgets_the_check_comes_before_admission(
    router: Router, smol: ModelAssets, calls: Calls
) -> None:
    """ACME may spend 1000 tokens at once: a 9000-token prompt is a 400 for its length, never a 429. Budgets
    need exact counts, and counting the leading 8192 tokens gives them for every prompt that fits."""
    gate = make_gate()
    err = refused(router, chat_of(hellos(9000)), gate=gate)
    assert int(err["message"].split("at least ")[1].split()[0]) >= CONTEXT
    assert calls == Calls(prefix_limits=[CONTEXT])
    spaces = ("\n" + " " * 80) * 110  # more bytes than tokens allowed, few tokens
    proc = processor(router, gate)
    reply(route(proc, chat_of(spaces), extra=ACME_KEY))
    assert calls == Calls(prefix_limits=[CONTEXT, CONTEXT])
    text = smol.template.render([user(spaces)], add_generation_prompt=True)
    exact = len(smol.tokenizer.encode_whole(text, add_special_tokens=False))
    assert proc.ticket is not None and proc.ticket.reserved == exact + 100  # prompt + default max_tokens


def test_unknown_context_or_tokenizer_refuses_nothing(smol: ModelAssets) -> None:
    router = make_router(dataclasses.replace(smol, max_model_len=None))
    routed(router, chat_of(hellos(9000)))
    assert reply(route(processor(router), chat_of("x" * 100_000, model=OTHER))).destination  # bytes routing


# --- the default body limit ------------------------------------------------------------------------------


def gateway_config(model_dir: str, **extproc: Any) -> dict[str, Any]:
    return {
        "extproc": {"metrics_listen": "", **extproc},
        "models": [{"name": MODEL, "model_dir": model_dir}],
        "endpoints": [{"id": "e0", "address": ADDRESSES[0], "models": [MODEL]}],
    }


def test_body_limit_follows_the_models_context(model_dir: str) -> None:
    derived = 8192 * 81 * 6 + 1024 * 1024
    assert Gateway(parse_config(gateway_config(model_dir))).max_body_bytes == derived == 5_029_888
    explicit = gateway_config(model_dir, max_body_bytes=64 * 1024 * 1024)
    assert Gateway(parse_config(explicit)).max_body_bytes == 64 * 1024 * 1024  # kept as given
    bytes_routed = gateway_config(model_dir)
    bytes_routed["endpoints"].append({"id": "e1", "address": ADDRESSES[1], "models": [OTHER]})
    assert Gateway(parse_config(bytes_routed)).max_body_bytes == DEFAULT_MAX_BODY_BYTES
    no_models = {"endpoints": [{"id": "e0", "address": ADDRESSES[0], "models": [OTHER]}]}
    assert Gateway(parse_config(no_models)).max_body_bytes == DEFAULT_MAX_BODY_BYTES


def test_gateway_applies_the_configured_cache_bounds(model_dir: str) -> None:
    """``[tokenizer]`` and ``[index] chain_memo_entries`` reach the caches they bound."""
    raw = gateway_config(model_dir)
    raw["index"] = {"chain_memo_entries": 1024}
    raw["tokenizer"] = {"segment_cache_entries": 256, "segment_cache_tokens": 4096}
    gw = Gateway(parse_config(raw))
    assert gw.models[MODEL].tokenizer.limits == CacheLimits(max_entries=256, max_tokens=4096)
    assert gw.router._chains.max_entries == 1024
    default = Gateway(parse_config(gateway_config(model_dir)))
    assert default.models[MODEL].tokenizer.limits == CacheLimits()
    assert default.router._chains.max_entries == 200_000
