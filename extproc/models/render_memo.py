"""A follow-up turn's chat template render, from the previous turn's: only the new messages are rendered.

A chat is re-rendered whole on every turn, so a long conversation's render grows with all of it. For
templates that are *message-separable* by construction (decided once, from the compiled template's
syntax tree, :func:`analyse`), the rendered text of messages ``M = P + N`` is

    pre(C, M[:reach]) + body(C, M[:reach], m_0, 0) + ... + body(C, M[:reach], m_n, n) + post(C, M[:reach])

where ``C`` is everything else the template sees (special tokens, ``add_generation_prompt``, ``tools``)
and ``reach`` is one past the largest constant index the template reads ``messages`` at. So once
``pre + body(m_0..)`` of ``P`` is known (remembered after ``P`` was rendered, :class:`RenderMemo`) and
``len(P) >= reach``, the text of ``M`` is that remembered text, then the loop body over ``N`` alone
(``loop.index0`` offset by ``len(P)``), then ``post``: byte for byte what the whole render gives.

What makes a template separable (anything else: every render is whole, as before):

* its top level is ``pre``, one ``{% for message in messages %}`` (or over an alias set in ``pre`` by
  ``{% set x = messages %}``: no filter, no ``else``, not recursive), then ``post``;
* ``messages`` (and the alias) are read only as ``messages[k]`` with a constant ``k >= 0`` (no length,
  slices, negative or computed indices, iteration elsewhere), so ``pre``/``post`` and each body see
  the same values for any ``M`` that extends ``P``;
* in the loop body, ``loop`` is read only as ``loop.first``, ``loop.index`` and ``loop.index0`` (not
  ``last``, ``length``, ``revindex``, ``previtem``/``nextitem``, ``cycle``, ``changed``), and there is no
  ``break`` of it: an iteration does not depend on the messages after it;
* no state crosses iterations: no ``namespace`` (nor ``{% set ns.x %}``), no ``cycler``/``joiner``, no
  macros, call blocks, includes, imports, blocks, ``with`` or ``{% set %}`` blocks; a plain
  ``{% set %}`` inside the loop is local to its iteration in jinja2 (the next one starts from the outer
  value);
* nothing impure: no ``strftime_now``, no ``random`` filter; filters and tests are jinja2's built-ins
  and ``tojson``; calls are methods of values (immutable in the sandbox) or ``raise_exception``.

A small chat (at most 4 messages and 4096 content characters, ``SMALL_CHAT_CHARS`` in
:mod:`extproc.models.template`) is rendered whole and not remembered: there the memo's fixed cost
(a look-up, a remembered entry: ~3 us) is what a follow-up of it would save.

The memo is consulted only when every message is the common ``{"role": str, "content": str}`` (so
comparing ``role`` and ``content`` of each is comparing the messages the template sees), without
``tools``, ``chat_template_kwargs``, ``documents`` or ``continue_final_message`` (what else the template
sees is then fixed: the template's special tokens and ``add_generation_prompt``, part of the key; tools
would need a type-exact comparison of arbitrary values: a tuple and a list, or ``1`` and ``True``, render
apart but compare or encode alike, so requests with tools render whole). Each remembered ``P`` is
checked message by message against the request's before it is used. The memo is bounded (entries and
characters, least recently used first out: at most 512 entries and 16M characters of text, plus the
message strings they keep alive).

Outside the class, so rendered whole on every turn: Qwen2.5's template (it reads the previous message at
the computed index ``messages[loop.index0 - 1]``, which wraps to the last message at index 0), Qwen3's
(a ``namespace`` carried across a reversed walk of the messages), Llama 3.1+'s (``messages[1:]``), and
any template with ``loop.last`` or a look at ``messages[-1]``. Each could be admitted only with a proof
of its own (that the wrap-around is never read, say); none is attempted here.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import jinja2
import jinja2.filters
import jinja2.tests
from jinja2 import nodes

#: Context variables the split templates are given (no template may name them).
TAIL = "kvgate_tail__"
OFFSET = "kvgate_offset__"
MARK = "kvgate_mark__"
_RESERVED = frozenset({TAIL, OFFSET, MARK})
#: Names no assignment or loop target may take (``loop``: its reads are rewritten as the loop object's).
_SHADOWED = _RESERVED | {"loop"}
_SENTINEL = "".join(["\x00kvgate", " mark\x00"])  # built at run time: an object of its own
#: Globals whose value carries state between calls or reads the clock.
_IMPURE_NAMES = frozenset({"strftime_now", "namespace", "cycler", "joiner", "lipsum", "self", "caller"})
_PURE_FILTERS = frozenset(jinja2.filters.FILTERS) - {"random"} | {"tojson"}
_PURE_TESTS = frozenset(jinja2.tests.TESTS) - {"sameas"}  # identity: of objects each path makes
_LOOP_ATTRIBUTES = frozenset({"first", "index", "index0"})
#: Expression node types whose value depends only on their children (and the sandbox's fixed rules).
_PLAIN_EXPRESSIONS: tuple[type[nodes.Node], ...] = (
    nodes.Const,
    nodes.TemplateData,
    nodes.Tuple,
    nodes.List,
    nodes.Dict,
    nodes.Pair,
    nodes.Keyword,
    nodes.CondExpr,
    nodes.BinExpr,
    nodes.UnaryExpr,
    nodes.Concat,
    nodes.Compare,
    nodes.Operand,
    nodes.Getattr,
    nodes.Getitem,
    nodes.Slice,
)
MAX_LOOKBACK = 2
"""Prefix lengths tried for a request of ``n`` messages: ``n - 1`` and ``n - 2`` (a follow-up adds the
engine's reply and a user message; each try costs a first turn about 0.3 us)."""


class NotSeparable(Exception):
    """The template is outside the separable class (the reason is for tests and logs)."""


class Split(NamedTuple):
    """A separable template's two renderers. ``marked``: the template itself plus an empty mark right
    after the messages loop; ``tail``: ``pre``'s assignments, the loop body over :data:`TAIL` (with
    ``loop.index0`` offset by :data:`OFFSET`), the mark, then ``post``. ``reach``: one past the largest
    constant index the template reads ``messages`` at (0: none)."""

    marked: jinja2.Template
    tail: jinja2.Template
    reach: int
    #: The templates' globals (the environment's), copied once (:func:`render_parts`).
    globals: dict[str, Any]


class _Checker:
    """Walks a template's syntax tree; raises :class:`NotSeparable` on anything outside the class."""

    def __init__(self, lists: set[str]) -> None:
        self.lists = lists  # ``messages`` and its aliases
        self.reach = 0

    def statements(self, body: Sequence[nodes.Node], outer_loop: bool, loop_bound: bool) -> None:
        """``outer_loop``: inside the messages loop's body, not in a nested loop (``loop`` is the
        messages loop); ``loop_bound``: inside some loop (``loop`` names one)."""
        for node in body:
            self.statement(node, outer_loop, loop_bound)

    def statement(self, node: nodes.Node, outer_loop: bool, loop_bound: bool) -> None:
        if isinstance(node, nodes.Output):
            for child in node.nodes:
                self.expression(child, outer_loop, loop_bound)
        elif isinstance(node, nodes.If):
            self.expression(node.test, outer_loop, loop_bound)
            self.statements(node.body, outer_loop, loop_bound)
            self.statements(node.elif_, outer_loop, loop_bound)
            self.statements(node.else_, outer_loop, loop_bound)
        elif isinstance(node, nodes.Assign):
            if not isinstance(node.target, nodes.Name) or node.target.name in self.lists | _SHADOWED:
                raise NotSeparable("an assignment to something other than a plain new name")
            self.expression(node.node, outer_loop, loop_bound)
        elif isinstance(node, nodes.For):  # a loop nested in the body, or in pre/post
            if node.recursive or node.test is not None:
                raise NotSeparable("a recursive or filtered loop")
            self.target(node.target)
            if outer_loop and any(_reads_loop(part) for part in [node.iter, *node.else_]):
                raise NotSeparable("the messages loop's loop read by a nested loop's iterable or else")
            self.expression(node.iter, outer_loop, loop_bound)
            self.statements(node.body, False, True)
            self.statements(node.else_, False, False)
        elif isinstance(node, nodes.Continue):
            if not loop_bound:
                raise NotSeparable("continue outside a loop")
        elif isinstance(node, nodes.Break):
            if outer_loop or not loop_bound:
                raise NotSeparable("a break of the messages loop")
        else:
            raise NotSeparable(f"a {type(node).__name__} statement")

    def target(self, node: nodes.Node) -> None:
        names = [node] if isinstance(node, nodes.Name) else getattr(node, "items", None)
        if not names or not all(isinstance(n, nodes.Name) for n in names):
            raise NotSeparable("a loop target that is not names")
        if any(n.name in self.lists | _SHADOWED for n in names):
            raise NotSeparable("a loop target shadowing messages")

    def expression(self, node: nodes.Node, outer_loop: bool, loop_bound: bool) -> None:
        if (
            isinstance(node, nodes.Getitem)
            and isinstance(node.node, nodes.Name)
            and node.node.name in self.lists
        ):
            arg = node.arg
            if not (isinstance(arg, nodes.Const) and type(arg.value) is int and arg.value >= 0):
                raise NotSeparable("messages read at a computed, negative or sliced index")
            self.reach = max(self.reach, arg.value + 1)
            return
        if isinstance(node, nodes.Getattr) and _is_name(node.node, {"loop"}):
            if not loop_bound or (outer_loop and node.attr not in _LOOP_ATTRIBUTES):
                raise NotSeparable(f"loop.{node.attr} of the messages loop")
            return
        if isinstance(node, nodes.Name):
            if node.name in self.lists or node.name in _IMPURE_NAMES or node.name in _RESERVED:
                raise NotSeparable(f"the name {node.name} used whole")
            if node.name == "loop" and (outer_loop or not loop_bound):
                raise NotSeparable("the messages loop's loop object used whole")
            return
        if isinstance(node, nodes.Filter | nodes.Test):
            known = _PURE_FILTERS if isinstance(node, nodes.Filter) else _PURE_TESTS
            if node.name not in known or node.node is None:
                raise NotSeparable(f"the filter or test {node.name}")
        elif isinstance(node, nodes.Call):
            callee = node.node
            if not (
                isinstance(callee, nodes.Getattr)
                or (isinstance(callee, nodes.Name) and callee.name in ("raise_exception", "dict", "range"))
            ):
                raise NotSeparable("a call of something other than a method or raise_exception")
        elif not isinstance(node, _PLAIN_EXPRESSIONS):
            raise NotSeparable(f"a {type(node).__name__} expression")
        for child in node.iter_child_nodes():
            self.expression(child, outer_loop, loop_bound)


def _is_name(node: nodes.Node, names: set[str] | frozenset[str]) -> bool:
    return isinstance(node, nodes.Name) and node.name in names


def _reads_loop(node: nodes.Node) -> bool:
    """Whether ``node`` reads the name ``loop`` anywhere."""
    names = [node] if isinstance(node, nodes.Name) else []
    return any(n.name == "loop" for n in [*names, *node.find_all(nodes.Name)])


def analyse(env: jinja2.Environment, source: str) -> Split | None:
    """The split renderers of ``source`` when it is message-separable (module docstring), else ``None``."""
    try:
        return _split(env, env.parse(source))
    except NotSeparable:
        return None


def _split(env: jinja2.Environment, tree: nodes.Template) -> Split:
    body = list(tree.body)
    lists = {"messages"}
    loops = [
        i
        for i, node in enumerate(body)
        if isinstance(node, nodes.For)
        and isinstance(node.iter, nodes.Name)
        and node.iter.name
        in lists
        | {
            a.target.name
            for a in body[:i]
            if isinstance(a, nodes.Assign)
            and isinstance(a.target, nodes.Name)
            and isinstance(a.node, nodes.Name)
            and a.node.name == "messages"
        }
    ]
    if not loops:
        raise NotSeparable("no top-level loop over messages")
    at = loops[0]
    pre, loop, post = body[:at], body[at], body[at + 1 :]
    assert isinstance(loop, nodes.For)
    # ``{% set x = messages %}`` at pre's top level makes x an alias (reassigning it anywhere is refused).
    for node in pre:
        if not isinstance(node, nodes.Assign):
            continue
        if isinstance(node.target, nodes.Name) and _is_name(node.node, {"messages"}):
            lists.add(node.target.name)
    checker = _Checker(lists)
    for node in pre:
        if isinstance(node, nodes.Assign) and _is_name(node.node, {"messages"}):
            continue  # an alias itself (its target is a plain name: the alias scan above)
        checker.statement(node, False, False)
    if loop.recursive or loop.test is not None or loop.else_:
        raise NotSeparable("the messages loop is recursive, filtered or has an else")
    if not isinstance(loop.target, nodes.Name):
        raise NotSeparable("the messages loop's target is not one name")
    checker.target(loop.target)
    checker.statements(loop.body, True, True)
    checker.statements(post, False, False)
    for found in tree.find_all(nodes.Name):
        if found.name in _RESERVED:
            raise NotSeparable("the template names a reserved variable")
    mark = nodes.Output([nodes.Name(MARK, "load")])
    marked = nodes.Template([*pre, loop, mark, *post])
    tail_loop = nodes.For(
        nodes.Name(loop.target.name, "store"),
        nodes.Name(TAIL, "load"),
        [_offset(node, True) for node in loop.body],
        [],
        None,
        False,
    )
    tail = nodes.Template([*_assignments(pre), tail_loop, mark, *post])
    for tree_ in (marked, tail):
        tree_.set_environment(env)
        tree_.set_lineno(1, override=False)
    compiled = env.from_string(marked)
    return Split(compiled, env.from_string(tail), checker.reach, dict(compiled.globals))


def _assignments(statements: Sequence[nodes.Node]) -> list[nodes.Node]:
    """``statements`` without their output (nor loops, which only output): what sets variables."""
    kept: list[nodes.Node] = []
    for node in statements:
        if isinstance(node, nodes.Assign):
            kept.append(node)
        elif isinstance(node, nodes.If):
            kept.append(
                nodes.If(
                    node.test,
                    _assignments(node.body),
                    [e for e in _assignments(node.elif_) if isinstance(e, nodes.If)],
                    _assignments(node.else_),
                )
            )
    return kept


def _offset(node: nodes.Node, outer: bool) -> nodes.Node:
    """A copy of a loop body node for the tail loop: the messages loop's ``loop.first`` is false (the tail
    never starts at 0), ``loop.index0`` / ``loop.index`` are offset by :data:`OFFSET`; a nested loop's
    own ``loop`` is left alone."""
    if (
        outer
        and isinstance(node, nodes.Getattr)
        and isinstance(node.node, nodes.Name)
        and node.node.name == "loop"
    ):
        if node.attr == "first":
            return nodes.Const(False)
        return nodes.Add(
            nodes.Getattr(nodes.Name("loop", "load"), node.attr, "load"), nodes.Name(OFFSET, "load")
        )
    fields: dict[str, Any] = {}
    for name, value in node.iter_fields():
        inner = outer and not (isinstance(node, nodes.For) and name in ("body",))
        if isinstance(value, nodes.Node):
            fields[name] = _offset(value, inner)
        elif isinstance(value, list):
            fields[name] = [_offset(v, inner) if isinstance(v, nodes.Node) else v for v in value]
        else:
            fields[name] = value
    copy = object.__new__(type(node))
    for name, value in fields.items():
        setattr(copy, name, value)
    for attribute in node.attributes:
        setattr(copy, attribute, getattr(node, attribute))
    return copy


def render_parts(
    template: jinja2.Template, variables: dict[str, Any], globals_: dict[str, Any] | None = None
) -> tuple[str, int] | None:
    """Render a :class:`Split` template: its text and where the mark was in it (the characters before);
    ``None`` if the mark did not come out as its own piece (the caller then renders whole).
    The mark is :data:`_SENTINEL` itself (jinja2 outputs a variable as ``str(value)``, which is the same
    object for an exact ``str``), found by identity: no text a template makes can be it. ``globals_``: the
    template's globals copied once (:attr:`Split.globals`), so the context is built as one dict rather
    than merged out of jinja2's ChainMap on every call (the same context either way)."""
    variables[MARK] = _SENTINEL
    if globals_ is None:
        context = template.new_context(variables)
    else:
        context = template.new_context({**globals_, **variables}, shared=True)
    try:
        parts = list(template.root_render_func(context))
    except Exception:
        template.environment.handle_exception()
    for at in range(len(parts) - 1, -1, -1):
        if parts[at] is _SENTINEL:
            after = sum(map(len, parts[at + 1 :]))
            del parts[at]
            text = "".join(parts)
            return text, len(text) - after
    return None  # pragma: no cover - the mark is a top-level output of its own; never relied upon


Pairs = tuple[tuple[str, str], ...]


class _Entry(NamedTuple):
    pairs: Pairs
    text: str  # the whole render of ``pairs``
    cut: int  # where its mark was: pre and the loop over ``pairs`` end there


Key = tuple[Any, ...]
TAIL_KEY = 32
"""Characters of the last message's end in a memo key (the whole message is compared before use)."""


def _key(context: Key, count: int, role: object, content: str) -> Key:
    return (context, count, role, len(content), content[-TAIL_KEY:])


class RenderMemo:
    """Remembered renders up to the mark, per (variant, context key, message count, last message), at
    most ``entries`` of them and ``chars`` characters of text, least recently used first out."""

    def __init__(self, entries: int = 512, chars: int = 16_000_000) -> None:
        self.max_entries, self.max_chars = entries, chars
        self._entries: dict[Key, _Entry] = {}  # least recently used first
        self._chars = 0
        self._lock = threading.Lock()
        #: Renders made from a remembered one (counted by the caller, once it used it).
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, context: Key, messages: Sequence[Any], reach: int) -> tuple[int, _Entry] | None:
        """The longest remembered prefix ``P`` of ``messages`` (``len(P) >= max(reach, 1)``, shorter than
        ``messages``, at most :data:`MAX_LOOKBACK` back) equal to them message by message, each of them
        exactly ``{"role": str, "content": str}``: its length and entry."""
        n = len(messages)
        lowest = max(reach, 1, n - MAX_LOOKBACK)
        entries = self._entries
        for j in range(n - 1, lowest - 1, -1):
            last = messages[j - 1]
            if type(last) is not dict or type(last.get("content")) is not str:
                continue
            content = last["content"]
            key = (context, j, last.get("role"), len(content), content[-TAIL_KEY:])
            entry = entries.get(key)
            if entry is None:
                continue
            for (role, content), message in zip(entry.pairs, messages, strict=False):
                if type(message) is not dict or len(message) != 2:
                    break
                got, said = message.get("content"), message.get("role")
                if type(got) is not str or type(said) is not str or got != content or said != role:
                    break
            else:
                with self._lock:  # now the most recently used
                    if entries.pop(key, None) is not None:
                        entries[key] = entry
                return j, entry
        return None

    def remember(self, context: Key, pairs: Pairs, text: str, cut: int) -> None:
        """Remember ``text``, the render of the messages ``pairs`` (role, content), its mark at ``cut``."""
        size = len(text)
        if size > self.max_chars or not pairs:
            return
        key = _key(context, len(pairs), *pairs[-1])
        with self._lock:
            entries = self._entries
            old = entries.pop(key, None)
            if old is not None:
                self._chars -= len(old.text)
            entries[key] = _Entry(pairs, text, cut)
            self._chars += size
            while len(entries) > self.max_entries or self._chars > self.max_chars:
                dropped = entries.pop(next(iter(entries)))
                self._chars -= len(dropped.text)


def plain(messages: Sequence[Any], start: int, openai: bool) -> tuple[Pairs, list[dict[str, Any]]] | None:
    """For the messages from ``start``: their ``(role, content)`` and what
    :func:`~extproc.models.template.normalize_messages` makes of them (its fast path, written out here
    to walk them once); ``None`` unless each is exactly ``{"role": str, "content": str}``."""
    pairs = []
    chat: list[dict[str, Any]] = []
    for i in range(start, len(messages)):
        message = messages[i]
        if type(message) is not dict or len(message) != 2:
            return None
        role, content = message.get("role"), message.get("content")
        if type(role) is not str or type(content) is not str:
            return None
        pairs.append((role, content))
        text: Any = [{"type": "text", "text": content}] if openai and role != "tool" else content
        chat.append({"role": role, "content": text})
    return tuple(pairs), chat
