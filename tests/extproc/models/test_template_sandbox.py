"""The chat template sandbox: its remembered attribute verdicts are jinja2's own, and templates still cannot
reach Python internals or mutate what they are given."""

from __future__ import annotations

import collections
import collections.abc
import copy
from collections.abc import Iterator
from typing import Any

import jinja2.runtime
import jinja2.utils
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from extproc.models import template as template_module
from extproc.models.template import ChatTemplate, TemplateError, make_environment


class _Plain:
    def append(self, item: object) -> None:
        pass


def _generator() -> Iterator[int]:
    yield 1


def _loop() -> jinja2.runtime.LoopContext:
    return jinja2.runtime.LoopContext(iter([1, 2]), jinja2.runtime.Undefined)


OBJECTS: list[Any] = [
    "text",
    {"role": "user"},
    [1, 2],
    (1, 2),
    3,
    2.5,
    True,
    None,
    _loop(),
    jinja2.utils.Namespace(a=1),
    template_module._TemplateNamespace(a=1),
    # judged by jinja2 every time (not of a remembered type):
    template_module._TemplateDict(),
    template_module._TemplateNamespace,
    str,
    _generator(),
    _generator,
    "x".upper,
    _Plain().append,
    {1, 2},
    collections.deque([1]),
    collections.OrderedDict(a=1),
    _Plain(),
    type("StrSub", (str,), {})("s"),
]
NAMES = [
    "upper",
    "format",
    "format_map",
    "strip",
    "append",
    "pop",
    "clear",
    "update",
    "setdefault",
    "extend",
    "sort",
    "add",
    "keys",
    "items",
    "get",
    "index",
    "first",
    "last",
    "length",
    "cycle",
    "fromkeys",
    "mro",
    "gi_frame",
    "gi_code",
    "__class__",
    "__mro__",
    "__globals__",
    "__init__",
    "_private",
    "_Namespace__attrs",
    "a",
]


def test_remembered_verdicts_are_jinja2s() -> None:
    ours, theirs = make_environment(), ImmutableSandboxedEnvironment()
    refused = 0
    for _round in range(2):  # the second round answers from the memo
        for obj in OBJECTS:
            for name in NAMES:
                expected = theirs.is_safe_attribute(obj, name, None)
                assert ours.is_safe_attribute(obj, name, None) is expected, (type(obj), name)
                refused += not expected
    assert refused > 100  # the set does hold unsafe accesses (underscores, mutators, internals)
    assert ours._verdicts  # type: ignore[attr-defined]
    # a name that is not an exact str is judged by jinja2 every time
    odd_name = type("Name", (str,), {})("append")
    assert ours.is_safe_attribute([], odd_name, None) is False


def test_an_abc_registration_is_never_answered_from_the_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = type("Fresh", (_Plain,), {})
    monkeypatch.setattr(template_module, "_VERDICT_TYPES", template_module._VERDICT_TYPES | {fresh})
    env = make_environment()
    assert env.is_safe_attribute(fresh(), "append", None) is True
    assert env.is_safe_attribute(fresh(), "append", None) is True  # remembered
    collections.abc.MutableSequence.register(fresh)  # now jinja2 counts it a mutable sequence
    assert ImmutableSandboxedEnvironment().is_safe_attribute(fresh(), "append", None) is False
    assert env.is_safe_attribute(fresh(), "append", None) is False


def test_the_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(template_module, "_MAX_VERDICTS", 8)
    env = make_environment()
    for i in range(50):
        assert env.is_safe_attribute("s", f"name{i}", None) is True
        assert len(env._verdicts) <= 8  # type: ignore[attr-defined]


USER = {"role": "user", "content": "hello"}


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages[0].content.__class__.__name__ }}",
        "{% for m in messages %}{{ loop.__class__.__name__ }}{% endfor %}",
        "{{ messages.append(1) }}",
        "{{ messages.pop() }}",
        "{{ messages[0].update({'role': 'system'}) }}",
        "{{ messages[0].clear() }}",
        "{{ messages[0].setdefault('x', 1) }}",
        "{% for m in messages %}{{ m.pop('content') }}{% endfor %}",
        "{{ raise_exception.__globals__['os'] }}",
        "{{ namespace.mro() }}",
        "{% set ns = namespace(a=1) %}{{ ns._Namespace__attrs.keys() }}",
        "{% set ns = namespace(a=1) %}{{ ns.__class__.__name__ }}",
        "{{ dict.__call__() }}",
        "{{ '{0.__class__.__mro__}'.format(messages) }}",
    ],
)
def test_templates_cannot_reach_internals_or_mutate(source: str) -> None:
    """Each access is refused (jinja2 hands back an undefined that raises SecurityError once used)."""
    template = ChatTemplate(source)
    messages = [dict(USER), dict(USER)]
    before = copy.deepcopy(messages)
    for _ in range(2):  # the second render is judged from the memo
        with pytest.raises(TemplateError):
            template.render(messages)
    assert messages == before


def test_safe_attributes_still_render() -> None:
    template = ChatTemplate(
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ loop.index }}:{{ m.content.strip().upper() }}:{{ m.items() | list | length }}"
        "{% if loop.last %}|{{ ns.n }}|{{ dict(a=1).keys() | list }}{% endif %}{% endfor %}"
    )
    messages = [{"role": "user", "content": " a "}, {"role": "assistant", "content": "b"}]
    for _ in range(2):
        assert template.render(messages) == "1:A:22:B:2|2|['a']"


def test_dict_attribute_access_is_jinja2s() -> None:
    """``message.role`` on a dict: the item when the name is no dict attribute, else what jinja2 gives."""
    ours, theirs = make_environment(), ImmutableSandboxedEnvironment()
    message = {"role": "user", "content": "c", "items": "shadowed", "_x": 1, "__class__": 2, "": 3}
    names = ["role", "content", "missing", "items", "keys", "get", "pop", "update", "_x", "__class__", ""]
    for obj in (message, {}, collections.OrderedDict(message)):
        for name in names:
            got, expected = ours.getattr(obj, name), theirs.getattr(obj, name)
            assert type(got) is type(expected), (obj, name)
            if isinstance(expected, jinja2.runtime.Undefined):
                assert (got._undefined_name, got._undefined_hint) == (  # type: ignore[attr-defined]
                    expected._undefined_name,  # type: ignore[attr-defined]
                    expected._undefined_hint,  # type: ignore[attr-defined]
                )
            elif callable(expected):
                assert got == expected
            else:
                assert got is expected


def test_attribute_style_templates_render_like_jinja2() -> None:
    source = (
        "{%- for message in messages %}{%- if message.role == 'user' or not loop.first %}"
        "{{- '<|' + message.role + '|>' + message.content.strip() + (message.name or '') + '\\n' }}"
        "{%- else %}{{- message.content + message.missing | default('-') }}{%- endif %}{%- endfor %}"
    )
    messages = [
        {"role": "system", "content": " s "},
        {"role": "user", "content": " u ", "name": "n"},
        {"role": "assistant", "content": "a"},
    ]
    template = ChatTemplate(source)
    expected = ImmutableSandboxedEnvironment().from_string(source).render(messages=messages)
    assert template.render(messages) == expected == " s -<|user|>un\n<|assistant|>a\n"
