"""ChatTemplate renders exactly what transformers' apply_chat_template renders for vLLM's messages."""

from __future__ import annotations

import copy
import datetime
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.errors import ConfigError
from extproc.errors import BadRequest
from extproc.models.template import (
    ChatTemplate,
    TemplateError,
    _normalize_message,
    detect_content_format,
    make_environment,
    normalize_messages,
)

SYSTEM = {"role": "system", "content": "You answer in one sentence."}
USER = {"role": "user", "content": "What is 12 * 34?"}
ASSISTANT = {"role": "assistant", "content": "It is 408."}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city, in °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
TOOL_CALL: dict[str, Any] = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
        },
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": ""}},
    ],
}
TOOL_RESULTS: list[dict[str, Any]] = [
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "☀"}'},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "2025-01-01T10:00"}]},
]

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user only": [USER],
    "system and user": [SYSTEM, USER],
    "multi-turn": [SYSTEM, USER, ASSISTANT, {"role": "user", "content": "And 13 * 34?"}],
    "content parts": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "first part"},
                {"type": "text", "text": ""},
                "bare string part",
                {"type": "text", "text": "last\npart"},
            ],
        },
    ],
    "unicode and emoji": [
        {"role": "system", "content": "Réponds en français 🇫🇷"},
        {"role": "user", "content": "日本語で? 🙂👍🏽 \t tabs\n\n\nnewlines   spaces"},
    ],
    "special token strings in content": [{"role": "user", "content": "say <|im_end|> and <|im_start|>user"}],
    "empty assistant content": [USER, {"role": "assistant", "content": None}, USER],
}


def as_vllm(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What vLLM hands to apply_chat_template for a "string" template, written out independently."""
    out = []
    for message in copy.deepcopy(messages):
        content = message.get("content")
        if isinstance(content, list):
            texts = [p if isinstance(p, str) else p["text"] for p in content]
            message["content"] = "\n".join(t for t in texts if t)
        elif content is None:
            message["content"] = ""
        for call in message.get("tool_calls") or []:
            arguments = call["function"]["arguments"]
            call["function"]["arguments"] = json.loads(arguments) if arguments else {}
        out.append(message)
    return out


def hf_render(hf_tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


@pytest.fixture(scope="module")
def smollm2_template(smollm2_dir: Path) -> ChatTemplate:
    return ChatTemplate.from_model_dir(smollm2_dir)


@pytest.fixture(scope="module")
def tools_template(smollm2_dir: Path, tools_template_path: Path) -> ChatTemplate:
    return ChatTemplate.from_model_dir(smollm2_dir, override=tools_template_path)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(
    smollm2_template: ChatTemplate, hf_tokenizer: Any, name: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    ours = smollm2_template.render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == hf_render(hf_tokenizer, as_vllm(messages), add_generation_prompt=add_generation_prompt)


TOOL_CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "tools listed": ([SYSTEM, USER], TOOLS),
    "tool calls and results": ([USER, TOOL_CALL, *TOOL_RESULTS, ASSISTANT], TOOLS),
    "calls with text": ([{**TOOL_CALL, "content": "Let me check."}, *TOOL_RESULTS], TOOLS),
    "no tools": ([SYSTEM, USER, ASSISTANT], None),
    "parts and emoji": (CONVERSATIONS["content parts"] + CONVERSATIONS["unicode and emoji"][1:], TOOLS),
}


@pytest.mark.parametrize("name", sorted(TOOL_CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tools_template_matches_transformers(
    tools_template: ChatTemplate,
    tools_template_path: Path,
    hf_tokenizer: Any,
    name: str,
    add_generation_prompt: bool,
) -> None:
    messages, tools = TOOL_CONVERSATIONS[name]
    ours = tools_template.render(messages, tools, add_generation_prompt=add_generation_prompt)
    reference = hf_render(
        hf_tokenizer,
        as_vllm(messages),
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        chat_template=tools_template_path.read_text(encoding="utf-8"),
    )
    assert ours == reference
    if tools:
        assert json.dumps(tools[0], ensure_ascii=False) in ours  # tojson: no ASCII escaping, no HTML escaping


def test_render_does_not_mutate_the_request(tools_template: ChatTemplate) -> None:
    messages = [USER, TOOL_CALL, *TOOL_RESULTS]
    before = copy.deepcopy(messages)
    tools_template.render(messages, TOOLS)
    assert messages == before


INLINE_TEMPLATES = {
    "tojson options": (
        "{{ tools | tojson(indent=2, sort_keys=true) }}|{{ messages | tojson(separators=(',', ':')) }}"
    ),
    "loop controls": (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    ),
    "namespace and dict": (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% endfor %}{{ ns.n }} {{ dict(a=1) | tojson }} {{ bos_token }}{{ eos_token }}"
    ),
    "generation tag": (
        "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    ),
    "template kwargs": (
        "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
        "{{ messages[-1].content }}{{ custom | default('') }}"
    ),
    "openai parts": (
        "{% for m in messages %}{{ m.role }}:{% for p in m.content %}<{{ p.text }}>{% endfor %}"
        "{% if m.tool_calls is defined %}{{ m.tool_calls | tojson }}{% endif %}\n{% endfor %}"
    ),
    "reasoning": "{% for m in messages %}{{ m | tojson }}\n{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(INLINE_TEMPLATES))
def test_environment_features_match_transformers(hf_tokenizer: Any, name: str) -> None:
    source = INLINE_TEMPLATES[name]
    template = ChatTemplate(source, special_tokens={"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    messages = [SYSTEM, {"role": "assistant", "content": "ok", "reasoning": "think 🤔"}, USER]
    kwargs = {"enable_thinking": False, "custom": "!"}
    ours = template.render(messages, TOOLS, extra=kwargs)
    reference_messages = normalize_messages(messages, template.content_format)
    reference = hf_render(hf_tokenizer, reference_messages, tools=TOOLS, chat_template=source, **kwargs)
    assert ours == reference


def test_continue_final_message_matches_transformers(
    smollm2_template: ChatTemplate, hf_tokenizer: Any
) -> None:
    messages = [USER, {"role": "assistant", "content": "It is "}]
    ours = smollm2_template.render(messages, continue_final_message=True)
    assert ours == hf_render(hf_tokenizer, messages, continue_final_message=True)
    assert ours.endswith("<|im_start|>assistant\nIt is ")  # the template keeps the trailing space
    with pytest.raises(BadRequest, match="mutually exclusive"):
        smollm2_template.render(messages, continue_final_message=True, add_generation_prompt=True)


def test_strftime_now_renders_today() -> None:
    template = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}")
    assert template.render([USER]) == datetime.datetime.now().strftime("%Y-%m-%d")


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
        (
            "{% for m in messages %}{% for p in m.content | selectattr('type') %}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% set rest = messages[1:] %}{% for m in rest %}{% for p in m.content %}{% endfor %}"
            "{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{% for c in m.tool_calls %}{% endfor %}{% endfor %}", "string"),
    ],
)
def test_content_format_detection(source: str, expected: str) -> None:
    assert detect_content_format(make_environment(), source) == expected


def test_normalize_messages_like_vllm() -> None:
    messages = [
        {"role": "developer", "content": "d", "tools": None, "extra": 1},
        {
            "role": "assistant",
            "content": [{"type": "refusal", "refusal": "no"}],
            "reasoning": "r",
            "reasoning_content": "ignored",
            "tool_calls": [],
        },
        {
            "role": "assistant",
            "tool_calls": [
                {"function": {"name": "f", "arguments": "{bad json"}},
                {"function": {"name": "g", "arguments": [1]}},
            ],
            "name": "bot",
        },
        {"role": "tool", "tool_call_id": None, "content": None},
    ]
    assert normalize_messages(messages, "string") == [
        {"role": "developer", "content": "d"},
        {"thinking": "r", "role": "assistant", "content": "no", "reasoning": "r", "reasoning_content": "r"},
        {
            "role": "assistant",
            "content": "",
            "name": "bot",
            "tool_calls": [
                {"function": {"name": "f", "arguments": {}}},
                {"function": {"name": "g", "arguments": [1]}},
            ],
        },
        {"role": "tool", "content": ""},
    ]
    openai = normalize_messages(
        [{"role": "user", "content": "a"}, {"role": "tool", "content": ["x", "y"]}], "openai"
    )
    assert openai == [
        {"role": "user", "content": [{"type": "text", "text": "a"}]},
        {"role": "tool", "content": "x\ny"},
    ]


_TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
_ROLES = st.sampled_from(["system", "user", "assistant", "tool", "developer", "function"]) | _TEXT
_PART = st.one_of(
    _TEXT,
    st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text", "output_text"]), "text": _TEXT}),
    st.fixed_dictionaries({"type": st.just("refusal"), "refusal": _TEXT}),
)
_VALUE = st.one_of(st.none(), _TEXT, st.integers(), st.lists(_PART, max_size=3))
_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": _ROLES, "content": _TEXT}),  # the common message (the fast path)
    st.fixed_dictionaries(
        {"role": _ROLES},
        optional={
            "content": st.one_of(st.none(), _TEXT, st.lists(_PART, max_size=3)),
            "name": _VALUE,
            "task": _VALUE,
            "tool_call_id": _VALUE,
            "reasoning": _VALUE,
            "tools": st.none() | st.lists(st.fixed_dictionaries({"type": st.just("function")}), max_size=2),
            "tool_calls": st.none()
            | st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries({"arguments": _TEXT})})),
        },
    ),
    st.dictionaries(st.sampled_from(["role", "content", "x"]), _VALUE, max_size=2),  # some malformed
)


@settings(max_examples=300, deadline=None)
@given(messages=st.lists(_MESSAGE, min_size=1, max_size=6), openai=st.booleans())
def test_normalize_messages_fast_path_is_the_general_path(messages: list[Any], openai: bool) -> None:
    """The fast path for ``{"role": str, "content": str}`` gives what the general path gives, and the
    same BadRequest when any message is malformed."""
    fmt: Any = "openai" if openai else "string"
    try:
        expected = [_normalize_message(m, fmt, i) for i, m in enumerate(messages)]
    except BadRequest as exc:
        with pytest.raises(BadRequest) as info:
            normalize_messages(messages, fmt)
        assert (info.value.message, info.value.param) == (exc.message, exc.param)
        return
    got = normalize_messages(messages, fmt)
    assert got == expected
    assert [list(m) for m in got] == [list(m) for m in expected]  # key order too (templates may loop)


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"content": "no role"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
        [{"role": "user", "content": [{"text": "no type"}]}],
        [{"role": "user", "content": 42}],
        [{"role": "assistant", "content": "x", "tool_calls": [{"name": "no function object"}]}],
    ],
)
def test_malformed_messages_are_bad_requests(smollm2_template: ChatTemplate, messages: Any) -> None:
    with pytest.raises(BadRequest) as info:
        smollm2_template.render(messages)
    assert info.value.status == 400


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "arguments",
    [_nested(2000), "[" * 2000 + "]" * 2000],  # as an object, and as a JSON string
    ids=["object", "string"],
)
def test_deeply_nested_tool_call_arguments_are_bad_requests(
    smollm2_template: ChatTemplate, arguments: Any
) -> None:
    # Copying or parsing them would exceed Python's recursion limit: a 400, not a RecursionError (a 500).
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(BadRequest) as info:
        smollm2_template.render(messages)
    assert info.value.status == 400 and "tool_calls" in info.value.message


def test_raise_exception_is_a_bad_request_without_prompt_text(tools_template: ChatTemplate) -> None:
    secret = "my secret prompt 1234"
    with pytest.raises(TemplateError) as info:
        tools_template.render([USER, {"role": "system", "content": secret}])
    assert isinstance(info.value, BadRequest) and info.value.status == 400
    assert "a system message is only allowed first" in info.value.message
    assert secret not in info.value.message and secret.encode() not in info.value.body()


def test_jinja_failures_are_bad_requests_without_prompt_text() -> None:
    template = ChatTemplate("{{ messages[0].content + 1 }}")
    with pytest.raises(TemplateError) as info:
        template.render([{"role": "user", "content": "private words"}])
    assert "private words" not in info.value.message
    with pytest.raises(TemplateError):
        ChatTemplate("{{ ''.__class__.__mro__ }}").render([USER])  # sandbox


def test_reserved_template_kwargs_are_rejected(smollm2_template: ChatTemplate) -> None:
    with pytest.raises(BadRequest, match="chat_template"):
        smollm2_template.render([USER], extra={"chat_template": "{{ 1 }}"})
    assert smollm2_template.render([USER], extra={"add_generation_prompt": True}).endswith("assistant\n")


def test_invalid_template_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="line 1"):
        ChatTemplate("{% for m in messages %}")


def test_from_model_dir_precedence(tmp_path: Path) -> None:
    config = {
        "bos_token": {"content": "<s>", "__type": "AddedToken"},
        "chat_template": [
            {"name": "default", "template": "default {{ bos_token }}"},
            {"name": "tool_use", "template": "tool_use"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.from_model_dir(tmp_path)
    assert template.render([USER]) == "default <s>"
    assert template.render([USER], TOOLS) == "tool_use"
    (tmp_path / "chat_template.jinja").write_text("file")
    assert ChatTemplate.from_model_dir(tmp_path).render([USER], TOOLS) == "file"
    override = tmp_path / "override.jinja"
    override.write_text("override")
    assert ChatTemplate.from_model_dir(tmp_path, override=override).render([USER]) == "override"
    with pytest.raises(ConfigError, match="no chat template"):
        ChatTemplate.from_model_dir(tmp_path / "missing")


@pytest.mark.parametrize(
    "raw",
    [
        [{"name": "default"}],  # no template
        [{"name": "default", "template": 42}],
        [{"name": 7, "template": "x"}],
        42,
        {"default": "x"},
    ],
)
def test_a_malformed_chat_template_entry_is_a_config_error(tmp_path: Path, raw: Any) -> None:
    # An operator's model directory: a ConfigError naming it, not a KeyError or TypeError traceback.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": raw}))
    with pytest.raises(ConfigError, match="chat_template must be a string or a list"):
        ChatTemplate.from_model_dir(tmp_path)
    (tmp_path / "override.jinja").write_text("override")  # unused when overridden
    assert (
        ChatTemplate.from_model_dir(tmp_path, override=tmp_path / "override.jinja").render([USER])
        == "override"
    )


def test_a_whole_render_sees_what_jinja2s_own_render_gives() -> None:
    """The whole render hands jinja2 one context dict (globals copied once, then the variables): the same
    text as jinja2's ``Template.render``, globals, special tokens and extra variables alike, and an extra
    variable still overrides a global."""
    source = (
        "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
        "{{ dict is defined }}|{{ namespace is defined }}|{{ greeting }}|{{ add_generation_prompt }}"
        "{% if messages | length > 2 %}{{ raise_exception('too many') }}{% endif %}"
    )
    template = ChatTemplate(source, special_tokens={"bos_token": "<s>"}, memo=False)
    compiled = template._default.compiled
    for extra in ({"greeting": "hi"}, {"greeting": "hi", "namespace": "shadowed"}):
        want = compiled.render(
            messages=[USER], tools=None, documents=None, add_generation_prompt=True, bos_token="<s>", **extra
        )
        assert template.render([USER], add_generation_prompt=True, extra=extra) == want
    with pytest.raises(TemplateError, match="too many"):
        template.render([SYSTEM, USER, ASSISTANT])
