"""Fuzzing the chat template rendering path (issue 24 part 3): SmolLM2's own template and a ChatML
template with tools (tests/data/tools_template.jinja), rendered by :class:`ChatTemplate` as vLLM renders
them. Property: any ``messages``, ``tools``, ``chat_template_kwargs`` and flags give the prompt text or a
:class:`BadRequest` (a template failure is a ``TemplateError``, one of them), never another exception.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from extproc.errors import BadRequest
from extproc.models.template import ChatTemplate
from tests.fuzz.strategies import FUZZ, json_values, messages_values


@pytest.fixture(scope="module")
def templates(smollm2_dir: Path, tools_template_path: Path) -> list[ChatTemplate]:
    smol = ChatTemplate.from_model_dir(smollm2_dir)
    tools = ChatTemplate(tools_template_path.read_text(), special_tokens=smol.special_tokens)
    return [smol, tools]


tools_values = (
    st.none()
    | st.lists(
        st.fixed_dictionaries(
            {"type": st.just("function") | json_values(2)},
            optional={
                "function": st.fixed_dictionaries(
                    {"name": st.text(max_size=10) | json_values(2)},
                    optional={"description": json_values(2), "parameters": json_values(6)},
                )
                | json_values(4)
            },
        )
        | json_values(4),
        max_size=3,
    )
    | json_values(4)
)

kwargs_values = st.none() | st.dictionaries(
    st.sampled_from(
        [
            "tools",
            "documents",
            "add_generation_prompt",
            "continue_final_message",
            "messages",
            "bos_token",
            "enable_thinking",
            "custom_tools",
            "date_string",
        ]
    )
    | st.text(max_size=8),
    json_values(6),
    max_size=3,
)


@FUZZ
@given(
    which=st.integers(0, 1),
    messages=messages_values | json_values(8),
    tools=tools_values,
    extra=kwargs_values,
    add_generation_prompt=st.booleans(),
    continue_final_message=st.booleans(),
)
@example(
    which=1,
    messages=[{"role": "assistant", "content": "x", "tool_calls": [{"function": {"arguments": "[1"}}]}],
    tools=None,
    extra=None,
    add_generation_prompt=False,
    continue_final_message=True,
)
def test_render_gives_text_or_bad_request(
    templates: list[ChatTemplate],
    which: int,
    messages: Any,
    tools: Any,
    extra: Any,
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> None:
    try:
        text = templates[which].render(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            extra=extra,
        )
    except BadRequest as exc:
        assert exc.status == 400 and exc.message
        return
    assert isinstance(text, str)
