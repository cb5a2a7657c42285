"""The body fields vLLM hands to its chat template reach the gateway's render too (its token ids are the
engine's, so the block digests match the engine's prefix cache)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from extproc.errors import BadRequest
from extproc.models.registry import ModelAssets
from extproc.routing.request import Kind, parse_body
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
