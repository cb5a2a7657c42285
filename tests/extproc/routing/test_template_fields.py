"""The body fields vLLM hands to its chat template reach the gateway's render too (its token ids are the
engine's, so the block digests match the engine's prefix cache)."""

from __future__ import annotations

import json
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


#: A RAG template (documents before the chat) for a tokenizer whose post-processor adds a BOS.
RAG_TEMPLATE = (
    "{% for d in documents or [] %}<doc>{{ d.title }}: {{ d.text }}</doc>\n{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def rag_dir(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("rag")
    spec = json.loads((Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    bos = {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": bos},
    }
    (out / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": RAG_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(out)


def test_documents_and_add_special_tokens_reach_the_render_as_in_vllm(rag_dir: str) -> None:
    # vLLM's chat request: `documents` go to the template, `add_special_tokens` (false by default) adds the
    # post-processor's tokens (here a BOS) to the rendered prompt.
    messages = [{"role": "user", "content": "What does the manual say?"}]
    documents = [{"title": "manual", "text": "Press the red button twice."}]
    body = {"model": MODEL, "messages": messages, "documents": documents, "add_special_tokens": True}
    r = router(rag_dir, max_blocks=64)
    assets = r.models[MODEL]
    text = assets.template.render(messages, documents=documents, add_generation_prompt=True)
    assert text.startswith("<doc>manual: Press the red button twice.</doc>\n")
    expected = assets.tokenizer.encode(text, add_special_tokens=True)
    assert expected[0] == 1 and expected[1] != 1  # the BOS
    got = r.tokens(parse_body(Kind.CHAT, orjson.dumps(body)), exact_count=True)
    assert list(got.ids) == expected
    plain = r.tokens(
        parse_body(Kind.CHAT, orjson.dumps({"model": MODEL, "messages": messages})), exact_count=True
    )
    assert list(plain.ids) == assets.tokenizer.encode(
        assets.template.render(messages, add_generation_prompt=True), False
    )


@pytest.mark.parametrize(("field", "value"), [("documents", "a manual"), ("add_special_tokens", "yes")])
def test_documents_and_add_special_tokens_of_the_wrong_type_are_400s(field: str, value: object) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], field: value}
    with pytest.raises(BadRequest) as caught:
        parse_body(Kind.CHAT, orjson.dumps(body))
    assert caught.value.status == 400 and caught.value.param == field


def test_add_special_tokens_is_not_resumed_from_a_chat_without_them(rag_dir: str) -> None:
    # The history memo remembers a chat's state by its pieces: a turn with add_special_tokens (a BOS first)
    # must not resume from the same chat's state without it, nor leave one for a turn without it.
    messages = [{"role": "user", "content": " ".join(f"word{i}" for i in range(300))}]
    for first, second in ((False, True), (True, False)):
        r = router(rag_dir, max_blocks=64)
        assets = r.models[MODEL]
        bodies = [{"model": MODEL, "messages": messages, "add_special_tokens": s} for s in (first, second)]
        before = parse_body(Kind.CHAT, orjson.dumps(bodies[0]))
        r.commit(r.decide(before, request_id="a", now=0.0), 0.0)
        got = r.tokens(parse_body(Kind.CHAT, orjson.dumps(bodies[1])))
        text = assets.template.render(messages, add_generation_prompt=True)
        whole = assets.tokenizer.encode(text, add_special_tokens=second)
        assert len(got.ids) >= 16 and list(got.ids) == whole[: len(got.ids)]
