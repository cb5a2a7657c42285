"""The body fields vLLM hands to its chat template reach the gateway's render too (its token ids are the
engine's, so the block digests match the engine's prefix cache)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from engines import llama_cpp
from extproc.errors import BadRequest
from extproc.models.registry import ModelAssets
from extproc.routing.request import Kind, parse_body
from extproc.routing.router import LLAMA_CPP, Router
from tests.extproc.routing.test_router import MODEL, router


def test_continue_final_message_renders_the_final_message_open(model_dir: str) -> None:
    # What the migration proxy sends (extproc/migration/continuation.py): the text already streamed as a
    # final assistant message to continue, without a generation prompt.
    messages = [
        {"role": "user", "content": "Tell me a story about a lighthouse keeper and a storm at sea."},
        {"role": "assistant", "content": "Once upon a time, on a rocky island"},
    ]
    body = {
        "model": MODEL,
        "messages": messages,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    request = parse_body(Kind.CHAT, orjson.dumps(body))
    r = router(model_dir, max_blocks=64)
    tokens = r.tokens(request, exact_count=True)
    assets = ModelAssets.load(MODEL, Path(model_dir))
    text = assets.template.render(messages, continue_final_message=True)
    assert text.endswith("Once upon a time, on a rocky island")
    assert list(tokens.ids) == assets.tokenizer.encode(text, add_special_tokens=False)


def test_continue_final_message_with_the_default_generation_prompt_is_a_400(model_dir: str) -> None:
    # vLLM hands both to transformers, which refuses them together (add_generation_prompt defaults to true).
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    body = {"model": MODEL, "messages": messages, "continue_final_message": True}
    request = parse_body(Kind.CHAT, orjson.dumps(body))
    with pytest.raises(BadRequest) as caught:
        router(model_dir).tokens(request, exact_count=True)
    assert caught.value.status == 400


#: llama-server (build 11434, the SmolLM2 GGUF) renders a chat whose last message is the assistant's as a
#: prefill: the messages before it with the generation prompt, then that message's text, left open
#: (its /apply-template, recorded here); vLLM renders it closed like any other message.
LLAMA_PREFILL = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
)


def _llama_router(model_dir: str, engines: list[str]) -> Router:
    r = router(model_dir, max_blocks=64)
    for state, engine in zip(list(r.fleet), engines, strict=False):
        r.fleet.upsert(replace(state.endpoint, engine=engine))
    return r


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("Sure, here", LLAMA_PREFILL + "Sure, here"),
        ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], LLAMA_PREFILL + "a\n\nb"),
        ("", LLAMA_PREFILL.removesuffix("<|im_start|>assistant\n")),
        (None, LLAMA_PREFILL.removesuffix("<|im_start|>assistant\n")),
    ],
)
def test_a_final_assistant_message_is_a_prefill_for_llama_cpp(
    model_dir: str, content: object, expected: str
) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": content}]
    request = parse_body(Kind.CHAT, orjson.dumps({"model": MODEL, "messages": messages}))
    r = _llama_router(model_dir, ["llama_cpp"] * 3)
    assets = r.models[MODEL]
    assert list(r.tokens(request, exact_count=True).ids) == assets.tokenizer.encode(expected, False)
    # A fleet that is not all llama.cpp renders as vLLM does.
    vllm = _llama_router(model_dir, ["llama_cpp", "vllm", "llama_cpp"])
    closed = assets.template.render(messages, add_generation_prompt=True)
    assert list(vllm.tokens(request, exact_count=True).ids) == assets.tokenizer.encode(closed, False)


def test_the_llama_cpp_engine_name_is_its_kinds() -> None:
    assert llama_cpp.KIND.name == LLAMA_CPP


def test_a_developer_message_is_a_system_message_for_llama_cpp(model_dir: str) -> None:
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    request = parse_body(Kind.CHAT, orjson.dumps({"model": MODEL, "messages": messages}))
    r = _llama_router(model_dir, ["llama_cpp"] * 3)
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assets = r.models[MODEL]
    assert list(r.tokens(request, exact_count=True).ids) == assets.tokenizer.encode(expected, False)
    vllm = _llama_router(model_dir, ["vllm"] * 3)
    kept = assets.template.render(messages, add_generation_prompt=True)
    assert "<|im_start|>developer\n" in kept
    assert list(vllm.tokens(request, exact_count=True).ids) == assets.tokenizer.encode(kept, False)
