"""Render OpenAI chat ``messages`` into prompt text exactly as vLLM does through ``transformers``.

vLLM's chat path has two steps, both reproduced here without importing either project:

1. It parses the OpenAI messages into "conversation messages" (``vllm/entrypoints/chat_utils.py``):
   content parts are reduced to text, and for a template whose content format is ``"string"`` (it never
   loops over ``message.content``) the text parts are joined with ``"\\n"`` into one string; for an
   ``"openai"`` template (it does loop over the parts) they stay ``[{"type": "text", "text": ...}]``. Only
   ``role``, ``content``, ``tool_calls`` / ``reasoning`` (assistant), ``tool_call_id`` (tool), ``name``,
   ``task`` and ``tools`` (developer) survive; tool call ``arguments`` strings are parsed as JSON (``{}``
   when invalid) and empty ``tool_calls`` lists are dropped.
2. ``transformers``' ``apply_chat_template(tokenize=False)`` drops ``None``-valued message keys, aliases
   reasoning as ``thinking``/``reasoning_content``, and renders with a sandboxed jinja2 environment
   (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a ``generation`` block tag, ``tojson`` without
   HTML escaping, ``raise_exception``, ``strftime_now``, ``dict``, ``namespace``) given ``messages``,
   ``tools``, ``documents``, ``add_generation_prompt``, the named special tokens and extra kwargs.

Only text content is supported: image, audio and other media parts are a BadRequest here.

Cost (a long chat is rendered on every request): the common message ``{"role": str, "content": str}``
is normalized on a fast path that gives exactly the general path's dict; the sandbox (:class:`_Sandbox`)
remembers jinja2's verdict on an attribute per ``(type, name)`` for the types where that verdict depends on
nothing else, and reads ``message.role`` on a dict as the item without raising AttributeError first.
A follow-up turn of a *message-separable* template (SmolLM2's, Llama 3.0's, Mistral's: decided from the
compiled template, :mod:`extproc.models.render_memo`) renders only its new messages after the previous
turn's remembered render, byte for byte the whole render (``tests/extproc/models/test_render_memo.py``).
Rendered text and the sandbox's refusals are jinja2's own (``tests/extproc/models/test_template*.py``);
``python -m load.bench.render`` times each stage.
"""

from __future__ import annotations

import abc
import copy
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, NamedTuple

import jinja2
import jinja2.ext
import jinja2.runtime
import jinja2.utils
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from contracts.errors import ConfigError
from extproc.errors import BadRequest
from extproc.models.render_memo import OFFSET, TAIL, RenderMemo, Split, analyse, plain, render_parts

logger = logging.getLogger(__name__)

ContentFormat = Literal["string", "openai"]

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The tokenizer_config.json keys that transformers passes to every template as variables."""

_TEXT_FIELD = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
"""Content part type -> the key holding its text (vLLM's text-like part types)."""

_REJECTED = frozenset({"messages", "conversation", "chat_template", "tokenize", "sanitize_control_tokens"})
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_MAX_TEMPLATE_MESSAGE = 200


class TemplateError(BadRequest):
    """The chat template rejected or failed on the conversation (400); the message never quotes content."""


class _RaisedByTemplate(jinja2.TemplateError):
    """``raise_exception(msg)`` called by the template itself."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-span marker): renders the body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's declared class attribute type

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    """``dict(...)`` for templates without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's ``namespace`` refusing underscore-prefixed attributes (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError("namespace attributes may not start with '_'")


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_VERDICT_TYPES: frozenset[type] = frozenset(
    {
        str,
        dict,
        list,
        tuple,
        int,
        float,
        bool,
        type(None),
        jinja2.runtime.LoopContext,
        jinja2.utils.Namespace,
        _TemplateNamespace,
    }
)
"""Exact types whose sandbox verdict on an attribute is a function of (type, name, ``abc`` registry): none
is a function, method, class, code, frame, traceback, generator or coroutine (the only instances
``is_internal_attribute`` looks past the name for), and none can make ``obj.__class__`` differ from
``type(obj)`` (builtins cannot; ``Namespace.__getattribute__`` hands ``__class__`` to ``object``), so
every ``isinstance`` jinja2 asks (its ABC checks included) answers by the type alone."""
_MAX_VERDICTS = 4096
_DICT_ATTRIBUTES = frozenset(dir({}))
"""The names ``getattr`` finds on an exact ``dict`` (its type's and ``object``'s: a dict has no instance
``__dict__`` and no ``__getattr__``); any other name raises AttributeError."""


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, its attribute verdicts remembered per ``(type, name)``.

    jinja2 judges each attribute access a template makes (``loop.first``, ``message.content.strip``) with
    ``is_safe_attribute``: underscore names, internal attributes of functions/classes/frames, and methods
    that mutate a list, dict, set or deque are refused; the attribute's ``value`` is not looked at. That
    takes ~1 us (four ABC ``isinstance`` checks) and a chat template makes one or more per message. For
    objects of :data:`_VERDICT_TYPES` the verdict depends only on the type, the name and the ABC registry,
    so it is asked once and remembered under ``abc.get_cache_token()`` (which changes whenever a class is
    registered with any ABC, so a registration can never leave a stale verdict); any other object, or a
    name that is not an exact ``str``, is judged by jinja2 every time. The memo holds at most
    :data:`_MAX_VERDICTS` verdicts (names come from template source, rarely from data; it is emptied when
    full). ``message.role`` on a dict goes straight to the item (:meth:`getattr`), as jinja2 ends up doing.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._verdicts: dict[tuple[object, type, str], bool] = {}

    def getattr(self, obj: Any, attribute: str) -> Any:
        """``obj.attribute`` in a template; for an exact dict and a name that is not a dict attribute
        (``message.role``) the item, without first raising and catching AttributeError as jinja2 does."""
        if type(obj) is dict and type(attribute) is str and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        kind = type(obj)
        if kind not in _VERDICT_TYPES or type(attr) is not str:
            return super().is_safe_attribute(obj, attr, value)
        key = (abc.get_cache_token(), kind, attr)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = super().is_safe_attribute(obj, attr, value)
            if len(self._verdicts) >= _MAX_VERDICTS:
                self._verdicts.clear()
            self._verdicts[key] = verdict
        return verdict


def make_environment() -> ImmutableSandboxedEnvironment:
    """A jinja2 environment configured like transformers' chat template environment (its sandbox's
    attribute verdicts remembered per type and name: :class:`_Sandbox`)."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def detect_content_format(env: jinja2.Environment, source: str) -> ContentFormat:
    """``"openai"`` when the template loops over a message's ``content``, else ``"string"`` (vLLM's rule)."""
    try:
        ast = env.parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    lists, before = {"messages"}, 0
    while len(lists) > before:  # add names assigned from messages (or a slice / filter of it)
        before = len(lists)
        lists |= {
            a.target.name
            for a in ast.find_all(nodes.Assign)
            if isinstance(a.target, nodes.Name) and _refers_to(a.node, lists)
        }
    items = {
        loop.target.name
        for loop in ast.find_all(nodes.For)
        if isinstance(loop.target, nodes.Name) and _refers_to(loop.iter, lists)
    }
    for loop in ast.find_all(nodes.For):
        if _refers_to(loop.iter, items, key="content"):
            return "openai"
    return "string"


def _refers_to(node: nodes.Node, names: set[str], key: str | None = None) -> bool:
    """Whether ``node`` is one of ``names`` (or its ``key`` item), possibly filtered, tested or sliced."""
    while True:
        wrapped = isinstance(node, nodes.Filter | nodes.Test) and node.node is not None
        sliced = isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
        if not (wrapped or sliced):
            break
        node = node.node  # type: ignore[attr-defined]
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == key and _refers_to(node.node, names)
    if isinstance(node, nodes.Getattr):
        return node.attr == key and _refers_to(node.node, names)
    return False


def normalize_messages(messages: Any, content_format: ContentFormat) -> list[dict[str, Any]]:
    """OpenAI request messages -> the dicts vLLM hands to ``apply_chat_template``, minus ``None`` values.

    Raises BadRequest for malformed messages and for non-text content parts.
    """
    if not isinstance(messages, list) or not messages:
        raise BadRequest("`messages` must be a non-empty array", param="messages")
    openai = content_format == "openai"
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        # The common message, exactly {"role": str, "content": str} (as JSON decodes it), comes out as
        # the general path below makes it: its content as is, or one text part ("openai"; a tool
        # message's parts are joined back into the string).
        if type(message) is dict and len(message) == 2:
            role, content = message.get("role"), message.get("content")
            if type(role) is str and type(content) is str:
                text: Any = [{"type": "text", "text": content}] if openai and role != "tool" else content
                out.append({"role": role, "content": text})
                continue
        out.append(_normalize_message(message, content_format, i))
    return out


def _normalize_message(message: Any, content_format: ContentFormat, i: int) -> dict[str, Any]:
    """One message of :func:`normalize_messages`, whatever its keys and content."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRequest(f"messages[{i}] must be an object with a string `role`", param="messages")
    role: str = message["role"]
    content = _content(message.get("content"), content_format, i)
    result: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            result["tool_calls"] = _tool_calls(message["tool_calls"], i)
        if message.get("reasoning") is not None:
            result["reasoning"] = result["reasoning_content"] = message["reasoning"]
    elif role == "tool":
        if "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        if isinstance(content, list) and all(p.get("type") == "text" for p in content):
            result["content"] = "\n".join(p["text"] for p in content)
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            result[key] = message[key]
    if role == "developer":
        result["tools"] = message.get("tools")
    if result.get("tool_calls") == []:
        del result["tool_calls"]
    result = {k: v for k, v in result.items() if v is not None}  # transformers drops None values
    reasoning = next((result[k] for k in _REASONING_FIELDS if k in result), None)
    if reasoning is not None:
        result = {"thinking": reasoning, **result, "reasoning_content": reasoning}
    return result


def _content(content: Any, content_format: ContentFormat, index: int) -> str | list[dict[str, str]]:
    parts: Any = [] if content is None else [content] if isinstance(content, str) else content
    if not isinstance(parts, list):
        raise BadRequest(f"messages[{index}].content must be a string or an array of parts", param="messages")
    texts: list[str] = []
    for part in parts:
        if isinstance(part, dict):
            kind = part.get("type")
            if not isinstance(kind, str) or kind not in _TEXT_FIELD:
                shown = repr(kind)[:40] if isinstance(kind, str) else "missing"
                raise BadRequest(
                    f"messages[{index}]: content part type {shown} is not supported (text only)",
                    param="messages",
                )
            part = part.get(_TEXT_FIELD[kind])
            if part is None:
                continue
        if not isinstance(part, str):
            raise BadRequest(f"messages[{index}]: content part text must be a string", param="messages")
        if content_format == "openai" or part:  # vLLM drops empty strings when joining
            texts.append(part)
    if content_format == "string":
        return "\n".join(texts)
    return [{"type": "text", "text": t} for t in texts]


def _tool_calls(tool_calls: Any, index: int) -> list[Any]:
    if not isinstance(tool_calls, list):
        raise BadRequest(f"messages[{index}].tool_calls must be an array", param="messages")
    try:
        calls = copy.deepcopy(tool_calls)
    except RecursionError:  # nested deeper than Python copies: the client's, not a 500
        raise BadRequest(f"messages[{index}].tool_calls are nested too deeply", param="messages") from None
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise BadRequest(f"messages[{index}].tool_calls[] needs a `function` object", param="messages")
        function = call["function"]
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except ValueError:
                function["arguments"] = {}
            except RecursionError:
                raise BadRequest(
                    f"messages[{index}].tool_calls[].function.arguments are nested too deeply",
                    param="messages",
                ) from None
        elif not isinstance(arguments, dict | list):
            function["arguments"] = {}
    return calls


class _Variant(NamedTuple):
    source: str
    compiled: jinja2.Template
    content_format: ContentFormat
    split: Split | None  # message-separable (:mod:`extproc.models.render_memo`), else ``None``
    which: int  # 0: the default template, 1: ``tool_use``
    #: The template's globals (the environment's), copied once: jinja2's ``render`` copies them out of
    #: a ChainMap on every call, half of a small chat's render.
    globals: dict[str, Any]

    def render(self, variables: dict[str, Any]) -> str:
        """``compiled.render(**variables)``: the same context (the globals, then ``variables``), built as
        one dict and handed over shared instead of merged again."""
        template = self.compiled
        context = template.new_context({**self.globals, **variables}, shared=True)
        try:
            return template.environment.concat(template.root_render_func(context))
        except Exception:
            template.environment.handle_exception()


class ChatTemplate:
    """A compiled chat template (plus an optional ``tool_use`` variant) and its special-token variables.
    ``render`` does no IO: it depends only on its arguments (and the clock, via ``strftime_now``)."""

    def __init__(
        self,
        source: str,
        *,
        special_tokens: Mapping[str, str] | None = None,
        tool_use: str | None = None,
        content_format: ContentFormat | None = None,
        memo: bool = True,
    ) -> None:
        """Compile ``source`` (ConfigError if it is not jinja2); ``content_format`` overrides detection
        (vLLM's ``--chat-template-content-format``); ``memo=False``: every render is whole (the reference
        the render memo is tested against)."""
        self._memoize = memo
        self._env = make_environment()
        self.special_tokens = dict(special_tokens or {})
        self._default = self._compile(source, content_format, 0)
        self._tool_use = None if tool_use is None else self._compile(tool_use, content_format, 1)
        self.source, self.content_format = source, self._default.content_format
        #: Renders up to the end of the messages loop, for follow-up turns (separable templates only).
        self.memo = RenderMemo()

    def _compile(self, source: str, content_format: ContentFormat | None, index: int) -> _Variant:
        try:
            compiled = self._env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"chat template is not jinja2 (line {exc.lineno}: {exc.message})") from exc
        fmt = content_format or detect_content_format(self._env, source)
        split = analyse(self._env, source) if self._memoize else None
        return _Variant(source, compiled, fmt, split, index, dict(compiled.globals))

    @property
    def separable(self) -> bool:
        """Whether follow-up turns render only their new messages (:mod:`extproc.models.render_memo`)."""
        return self._default.split is not None

    @classmethod
    def from_model_dir(cls, path: Path, override: str | Path | None = None) -> ChatTemplate:
        """Load the template the way transformers does from a model directory.

        Precedence: ``override`` (a template file, like vLLM's ``--chat-template``), then
        ``chat_template.jinja``, then ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
        ``{name, template}`` with ``default`` and optional ``tool_use``). Special tokens come from
        ``tokenizer_config.json``. Raises ConfigError when no template is found.
        """
        config = _read_config(path / "tokenizer_config.json")
        special = {name: tok for name in SPECIAL_TOKEN_NAMES if (tok := _token_text(config.get(name)))}
        templates: dict[str, str] = {}
        raw = config.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in raw
        ):
            templates.update({t["name"]: t["template"] for t in raw})
        elif raw is not None:
            templates["malformed"] = ""
        if (path / "chat_template.jinja").is_file():
            templates = {"default": (path / "chat_template.jinja").read_text(encoding="utf-8")}
        if override is not None:
            templates = {"default": Path(override).read_text(encoding="utf-8")}
        if "malformed" in templates:  # and neither the file nor an override stands in for it
            raise ConfigError(
                f"{path / 'tokenizer_config.json'}: chat_template must be a string or a list of"
                " {name, template} strings"
            )
        if "default" not in templates:
            raise ConfigError(f"{path}: no chat template (give one with a chat template override)")
        return cls(templates["default"], special_tokens=special, tool_use=templates.get("tool_use"))

    def render(
        self,
        messages: Any,
        tools: Sequence[Any] | None = None,
        *,
        documents: Sequence[Any] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for an OpenAI ``messages`` array (and ``tools``), as vLLM renders it.

        ``extra`` is the request's ``chat_template_kwargs``: extra template variables, which
        (as in vLLM) may also override ``tools``, ``documents``, ``add_generation_prompt`` and
        ``continue_final_message``. Raises BadRequest (TemplateError for template failures).
        """
        variables = dict(extra or {})
        if rejected := sorted(_REJECTED & variables.keys()):
            raise BadRequest(
                f"chat_template_kwargs may not set {', '.join(rejected)}", param="chat_template_kwargs"
            )
        tools = variables.pop("tools", tools)
        if tools is not None:
            if not isinstance(tools, Sequence) or not all(isinstance(t, dict) for t in tools):
                raise BadRequest("`tools` must be an array of objects", param="tools")
            tools = list(tools)
        documents = variables.pop("documents", documents)
        add_generation_prompt = bool(variables.pop("add_generation_prompt", add_generation_prompt))
        continue_final_message = bool(variables.pop("continue_final_message", continue_final_message))
        variant = self._tool_use if tools is not None and self._tool_use is not None else self._default
        split = variant.split
        if (
            split is not None
            and not continue_final_message
            and not variables
            and documents is None
            and tools is None
            and type(messages) is list
            and messages
            and not _small(messages)
        ):
            context = (variant.which, add_generation_prompt)
            text = self._render_split(variant, split, context, messages, add_generation_prompt)
            if text is not None:
                return text
        chat = normalize_messages(messages, variant.content_format)
        final = ""
        if continue_final_message:
            final = _tag_final_message(chat, variant.source, add_generation_prompt)
        variables = {**self.special_tokens, **variables}
        try:
            text = variant.render(
                {
                    "messages": chat,
                    "tools": tools,
                    "documents": documents,
                    "add_generation_prompt": add_generation_prompt,
                    **variables,
                }
            )
        except _RaisedByTemplate as exc:
            raise TemplateError(f"chat template error: {str(exc)[:_MAX_TEMPLATE_MESSAGE]}") from exc
        except Exception as exc:  # any failure inside the template is the request's fault, never ours
            raise TemplateError(f"chat template failed on these messages ({type(exc).__name__})") from exc
        if continue_final_message:
            if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
                raise TemplateError("continue_final_message: the template dropped part of the final message")
            cut = text.rindex(_CONTINUE_TAG.strip())
            text = (
                text[:cut] if text[cut : cut + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:cut].rstrip()
            )
        return text

    def _render_split(
        self,
        variant: _Variant,
        split: Split,
        context: tuple[Any, ...],
        messages: list[Any],
        add_generation_prompt: bool,
    ) -> str | None:
        """:meth:`render` of a separable template (``messages`` all ``{role, content}`` strings, no
        extra variables): from the remembered render of an earlier turn when there is one, else whole;
        the render up to the loop's end is remembered for the next turn. ``None`` when some message is
        not exactly ``{"role": str, "content": str}`` (the caller renders it whole)."""
        fmt = variant.content_format
        variables: dict[str, Any] = {
            **self.special_tokens,
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        found = self.memo.find(context, messages, split.reach)
        done = 0 if found is None else found[0]
        new = plain(messages, done, variant.content_format == "openai")
        if new is None:
            return None  # not all {role, content} strings: rendered whole
        try:
            if found is None:
                variables["messages"] = new[1]
                whole = render_parts(split.marked, variables, split.globals)
                if whole is None:
                    return None
                text, cut = whole
                pairs = new[0]
            else:
                entry = found[1]
                reach = split.reach
                variables["messages"] = normalize_messages(messages[:reach], fmt) if reach else []
                variables[TAIL] = new[1]
                variables[OFFSET] = done
                tail = render_parts(split.tail, variables, split.globals)
                if tail is None:
                    return None
                self.memo.hits += 1
                text = entry.text[: entry.cut]
                text += tail[0]
                cut, pairs = entry.cut + tail[1], entry.pairs + new[0]
        except _RaisedByTemplate as exc:
            raise TemplateError(f"chat template error: {str(exc)[:_MAX_TEMPLATE_MESSAGE]}") from exc
        except Exception as exc:  # any failure inside the template is the request's fault, never ours
            raise TemplateError(f"chat template failed on these messages ({type(exc).__name__})") from exc
        if len(pairs) >= split.reach:
            self.memo.remember(context, pairs, text, cut)
        return text


SMALL_CHAT_CHARS = 4096
"""A chat of at most 4 messages and fewer content characters than this (about 1k tokens) renders whole
and is not remembered: the memo's fixed cost (~3 us) would match what a follow-up of it saves."""


def _small(messages: list[Any]) -> bool:
    """Whether ``messages`` is a small chat (:data:`SMALL_CHAT_CHARS`): at most 4 messages, their string
    contents shorter than that together."""
    if len(messages) > 4:
        return False
    total = 0
    for message in messages:
        content = message.get("content") if type(message) is dict else None
        if type(content) is str:
            total += len(content)
    return total < SMALL_CHAT_CHARS


def _tag_final_message(chat: list[dict[str, Any]], source: str, add_generation_prompt: bool) -> str:
    """Append transformers' continuation tag to the final message's text; return that text."""
    if add_generation_prompt:
        raise BadRequest("continue_final_message and add_generation_prompt are mutually exclusive")
    content = chat[-1].get("content")
    if "content" not in source or content is None:
        raise BadRequest("continue_final_message: the final message has no content to continue")
    if isinstance(content, list):
        for part in reversed(content):
            if "text" in part:
                final: str = part["text"]
                part["text"] = final + _CONTINUE_TAG
                return final
        raise BadRequest("continue_final_message: the final message has no text to continue")
    chat[-1]["content"] = content + _CONTINUE_TAG
    return str(content)


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return config


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None
