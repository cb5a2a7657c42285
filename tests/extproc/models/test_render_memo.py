"""The render memo (extproc/models/render_memo.py): a follow-up turn rendered from the previous turn's
render equals the whole render byte for byte, and templates outside the separable class are never
split."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.errors import ConfigError
from extproc.errors import BadRequest
from extproc.models import template as template_module
from extproc.models.render_memo import RenderMemo, render_parts
from extproc.models.template import ChatTemplate
from load.bench.render import ATTRIBUTE_STYLE

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
QWEN_STYLE = ATTRIBUTE_STYLE  # the render bench's Qwen2.5-style template: messages read as attributes
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)
PARTS_AND_TOOLS = (  # content as parts ("openai"), a nested loop with its own loop.last, tools in pre
    "{% if tools %}[{{ tools | tojson }}]{% endif %}{% set sep = '|' %}"
    "{% if messages[1] is defined %}{{ messages[1].role }}{% endif %}"
    "{% for m in messages %}{{ loop.index }}:{{ m.role | upper }}"
    "{% for p in m.content %}{{ p.text }}{% if not loop.last %}{{ sep }}{% endif %}{% endfor %}"
    "{% set note = m.role ~ '!' %}{{ note if m.role == 'system' else '' }}\n{% endfor %}"
    "{{ messages[0].content | length }}{% if add_generation_prompt %}>{% endif %}"
)

SEPARABLE = {
    "smollm2": SMOLLM2,
    "qwen style": QWEN_STYLE,
    "llama3": LLAMA3,
    "mistral": MISTRAL,
    "parts and tools": PARTS_AND_TOOLS,
}

NOT_SEPARABLE = {
    "loop.last": "{% for m in messages %}{{ m.content }}{% if loop.last %}!{% endif %}{% endfor %}",
    "loop.length": "{% for m in messages %}{{ loop.length }}{% endfor %}",
    "negative index": "{% for m in messages %}{{ m.content }}{% endfor %}{{ messages[-1].role }}",
    "computed index": "{% for m in messages %}{{ messages[loop.index0 - 1].role }}{% endfor %}",
    "length": "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "slice alias": "{% set ms = messages[1:] %}{% for m in ms %}{{ m.content }}{% endfor %}",
    "namespace": (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ ns.n }}{% endfor %}"
    ),
    "break": (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    ),
    "clock": "{% for m in messages %}{{ strftime_now('%Y') }}{{ m.content }}{% endfor %}",
    "random": "{% for m in messages %}{{ [1, 2] | random }}{{ m.content }}{% endfor %}",
    "loop else": "{% for m in messages %}{{ m.content }}{% else %}none{% endfor %}",
    "filtered loop": "{% for m in messages if m.role != 'system' %}{{ loop.index }}{% endfor %}",
    "no loop": "{{ messages[0].content }}",
    "loop in pre": "{% for m in messages %}{{ m.content }}{% endfor %}{% for m in messages %}{% endfor %}",
    "macro": "{% macro f(x) %}{{ x }}{% endmacro %}{% for m in messages %}{{ f(m.content) }}{% endfor %}",
    "nested iter reads loop": (
        "{% for m in messages %}{% for i in range(loop.index0) %}.{% endfor %}{{ m.content }}{% endfor %}"
    ),
    "cycle": "{% for m in messages %}{{ loop.cycle('a', 'b') }}{% endfor %}",
    "whole messages": "{% for m in messages %}{{ m.content }}{% endfor %}{{ messages | tojson }}",
    "loop object": "{% for m in messages %}{{ loop }}{% endfor %}",
    "alias of an alias": (
        "{% set a = messages %}{% set b = a %}{% for m in a %}{{ b | length }}{{ m.content }}{% endfor %}"
    ),
    "identity": "{% for m in messages %}{{ m is sameas messages[0] }}{% endfor %}",
}


@pytest.fixture(autouse=True, scope="module")
def _small_chats_too() -> Iterator[None]:
    """Small chats use the memo here too (by default they render whole: test_small_chats_render_whole)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(template_module, "SMALL_CHAT_CHARS", 0)
        yield


def test_small_chats_render_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(template_module, "SMALL_CHAT_CHARS", 4096)
    template = ChatTemplate(SMOLLM2, special_tokens=SPECIAL)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * 4000}]
    template.render(chat)
    assert len(template.memo) == 0  # 4 messages or fewer, under 4096 characters: not remembered
    chat = [*chat, {"role": "user", "content": "y" * 100}]
    template.render(chat)
    assert len(template.memo) == 1  # over 4096 characters


def test_separable_templates_are_recognised() -> None:
    for name, source in SEPARABLE.items():
        assert ChatTemplate(source, special_tokens=SPECIAL).separable, name


@pytest.mark.parametrize("name", sorted(NOT_SEPARABLE))
def test_templates_outside_the_class_are_rendered_whole(name: str) -> None:
    template = ChatTemplate(NOT_SEPARABLE[name], special_tokens=SPECIAL)
    assert not template.separable
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    for turn in (chat, [*chat, {"role": "user", "content": "c"}]):
        with contextlib.suppress(BadRequest):
            template.render(turn)
    assert len(template.memo) == 0


@pytest.mark.parametrize(
    "source",
    [
        "{% for m in messages %}{% set loop = 1 %}{{ loop.first }}{% endfor %}",
        "{% for m in messages %}{% for loop in [1] %}{% endfor %}{{ loop.index }}{% endfor %}",
    ],
)
def test_jinja2_itself_refuses_to_rebind_loop(source: str) -> None:
    """The rewrite of ``loop.first`` / ``loop.index0`` relies on ``loop`` naming the loop object."""
    with pytest.raises(ConfigError):
        ChatTemplate(source)


def test_the_repository_templates(smollm2_dir: Path, tools_template_path: Path) -> None:
    """SmolLM2's own template is split; the tools fixture (messages[1:] in pre) is not."""
    assert ChatTemplate.from_model_dir(smollm2_dir).separable
    assert not ChatTemplate.from_model_dir(smollm2_dir, override=tools_template_path).separable


_TEXT = st.lists(
    st.sampled_from(["a", "b", " ", "\n", "  ", "<|im_end|>", "é", "🎉", "{{", "%}", "x" * 5]), max_size=12
).map("".join)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool"]), "content": _TEXT}
)
_TOOLS = st.one_of(
    st.none(),
    st.lists(
        st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]), "n": st.sampled_from([1, 1.0, True])}),
        min_size=1,
        max_size=2,
    ),
)


def _outcome(template: ChatTemplate, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    try:
        return template.render(messages, **kwargs)
    except BadRequest as exc:  # the same refusal, with the same words
        return f"refused: {type(exc).__name__}: {exc}"


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(SEPARABLE)),
    turns=st.lists(st.lists(_MESSAGE, min_size=1, max_size=3), min_size=1, max_size=6),
    tools=_TOOLS,
    add_generation_prompt=st.booleans(),
    replay=st.integers(min_value=0, max_value=5),
)
def test_follow_ups_render_as_the_whole_template(
    name: str,
    turns: list[list[dict[str, str]]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    replay: int,
) -> None:
    """A conversation growing turn by turn (and an earlier turn replayed, a branch off it) renders exactly
    as the whole template does: text, and refusals."""
    memoized = ChatTemplate(SEPARABLE[name], special_tokens=SPECIAL)
    whole = ChatTemplate(SEPARABLE[name], special_tokens=SPECIAL, memo=False)
    assert memoized.separable and not whole.separable
    kwargs = {"tools": tools, "add_generation_prompt": add_generation_prompt}
    chat: list[dict[str, str]] = []
    seen = []
    for turn in turns:
        chat = [*chat, *turn]
        seen.append(chat)
        assert _outcome(memoized, chat, **kwargs) == _outcome(whole, chat, **kwargs)
    branch = [*seen[replay % len(seen)], {"role": "user", "content": "branch"}]
    assert _outcome(memoized, branch, **kwargs) == _outcome(whole, branch, **kwargs)
    other = {**kwargs, "add_generation_prompt": not add_generation_prompt, "tools": None}
    assert _outcome(memoized, chat, **other) == _outcome(whole, chat, **other)


@pytest.mark.parametrize("name", sorted(SEPARABLE))
def test_follow_ups_use_the_memo(name: str) -> None:
    template = ChatTemplate(SEPARABLE[name], special_tokens=SPECIAL)
    whole = ChatTemplate(SEPARABLE[name], special_tokens=SPECIAL, memo=False)
    chat = [{"role": "user", "content": "hello"}]
    for i in range(6):
        assert template.render(chat, add_generation_prompt=True) == whole.render(
            chat, add_generation_prompt=True
        )
        chat = [*chat, {"role": "assistant" if i % 2 == 0 else "user", "content": f"turn {i}"}]
    assert template.memo.hits >= 4


def test_other_requests_are_rendered_whole() -> None:
    """Tools, template kwargs, documents, continue_final_message and messages other than {role, content}
    strings never use the memo."""
    template = ChatTemplate(QWEN_STYLE, special_tokens=SPECIAL)
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    template.render(chat)
    follow = [*chat, {"role": "user", "content": "c"}]
    template.render(follow, extra={"x": 1})
    template.render(follow, [{"name": "f"}])
    template.render(follow, documents=[{"text": "d"}])
    template.render(follow, continue_final_message=True)
    template.render([*chat, {"role": "user", "content": [{"type": "text", "text": "c"}]}])
    template.render([*chat, {"role": "user", "content": "c", "name": "n"}])
    assert template.memo.hits == 0


def test_the_memo_is_bounded() -> None:
    memo = RenderMemo(entries=3, chars=100)
    for i in range(10):
        memo.remember((0,), (("user", str(i)),), "x" * 10, 5)
    assert len(memo) == 3
    memo.remember((0,), (("user", "big"),), "x" * 95, 5)
    assert len(memo) == 1
    memo.remember((0,), (("user", "huge"),), "x" * 101, 5)  # never kept
    assert len(memo) == 1


def test_a_router_tokenizes_follow_ups_as_the_whole_render(model_dir: str) -> None:
    """Through the router (SmolLM2's own template, its real tokenizer): every turn of a conversation,
    each parsed afresh, tokenizes to the ids of the whole render."""
    from extproc.index.approximate import ApproximateIndex
    from tests.extproc.routing.test_lazy_tokens import MODEL, chat, make_router, request_of

    router = make_router(model_dir, ApproximateIndex())
    assets = router.models.find(MODEL)
    assert assets is not None and assets.template.separable
    whole = ChatTemplate(assets.template.source, special_tokens=assets.template.special_tokens, memo=False)
    conversation = chat(random.Random(7), 9)
    for turn in range(1, len(conversation) + 1, 2):
        request = request_of(conversation[:turn])
        text = whole.render(request.messages, add_generation_prompt=True)
        expected = assets.tokenizer.encode(text, add_special_tokens=False)
        assert list(router.tokens(request, exact_count=True).ids) == expected
    assert assets.template.memo.hits == 4


def test_render_parts_with_the_globals_copied_once_gives_the_same_parts() -> None:
    """:func:`render_parts` with :attr:`Split.globals` (one context dict, shared) and without (jinja2's own
    merge of the globals) give the same text and mark, for each separable template."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for name, source in SEPARABLE.items():
        split = ChatTemplate(source, special_tokens=SPECIAL)._default.split
        assert split is not None, name
        variables = {**SPECIAL, "messages": messages, "tools": None, "documents": None}
        variables["add_generation_prompt"] = True
        want = render_parts(split.marked, dict(variables))
        assert want is not None, name
        assert render_parts(split.marked, dict(variables), split.globals) == want, name
