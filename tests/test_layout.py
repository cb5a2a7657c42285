"""The rooms and the direction of imports: docs/ARCHITECTURE.md's room map is the rule the code follows.

The map (the fenced block after ``<!-- rooms -->`` in docs/ARCHITECTURE.md) names each room and the rooms
it may import (a name there also admits the rooms under it: ``extproc`` admits ``extproc.routing``). A
module belongs to the longest room name that prefixes its dotted path. Every import of
kvgate's own modules is read from the source with :mod:`ast` (imports inside functions and under
``TYPE_CHECKING`` included); one that crosses into a room its room may not import fails, as does a
module no room claims, a map that is not a DAG, and any import circle between modules.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("contracts", "certs", "engines", "runtime", "extproc", "agent", "kvcached", "kvgate", "load")


def room_map() -> dict[str, frozenset[str]]:
    """Room -> rooms it may import, from docs/ARCHITECTURE.md."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    match = re.search(r"<!-- rooms -->\s*```text\n(.*?)```", text, re.S)
    assert match, "docs/ARCHITECTURE.md has no room map (a ```text block after <!-- rooms -->)"
    rooms: dict[str, frozenset[str]] = {}
    for line in match.group(1).splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        room, _, allowed = line.partition(" ")
        assert room not in rooms, f"room {room} is listed twice"
        rooms[room] = frozenset(a for a in allowed.split() if a != "-")
    return rooms


def modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            yield dotted.removesuffix(".__init__"), path


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every absolute import of kvgate's own packages in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # ``from pkg import module`` imports the module when there is one by that name
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES:
                yield node.lineno, name


def room_of(module: str, rooms: Mapping[str, object]) -> str | None:
    parts = module.split(".")
    for cut in range(len(parts), 0, -1):
        candidate = ".".join(parts[:cut])
        if candidate in rooms:
            return candidate
    return None


def admitted(room: str, allowed: frozenset[str]) -> bool:
    """Whether ``allowed`` names ``room`` or a room above it."""
    return any(room == a or room.startswith(a + ".") for a in allowed)


def resolve(name: str, known: set[str]) -> str | None:
    """The module ``name`` refers to (a symbol's module when ``name`` ends in a symbol)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def test_every_module_has_a_room() -> None:
    rooms = room_map()
    homeless = [module for module, _ in modules() if room_of(module, rooms) is None]
    assert not homeless, f"modules no room in docs/ARCHITECTURE.md claims: {homeless}"


def test_the_room_map_has_no_circle() -> None:
    rooms = room_map()
    for room, allowed in rooms.items():
        assert allowed <= rooms.keys(), f"{room} may import unknown rooms {sorted(allowed - rooms.keys())}"
    done: set[str] = set()

    def visit(room: str, path: tuple[str, ...]) -> None:
        assert room not in path, f"the room map has a circle: {' -> '.join((*path, room))}"
        if room not in done:
            for nxt in (r for r in rooms if r != room and admitted(r, rooms[room])):
                visit(nxt, (*path, room))
            done.add(room)

    for room in rooms:
        visit(room, ())


def test_imports_follow_the_room_map() -> None:
    rooms = room_map()
    known = {module for module, _ in modules()}
    wrong = []
    for module, path in modules():
        mine = room_of(module, rooms)
        assert mine is not None
        for line, name in imports(path):
            target = resolve(name, known)
            theirs = room_of(target, rooms) if target else None
            if theirs is None or theirs == mine or admitted(theirs, rooms[mine]):
                continue
            wrong.append(f"{path.relative_to(ROOT)}:{line}: {mine} imports {target} ({theirs})")
    wrong = sorted(set(wrong))
    assert not wrong, "imports against docs/ARCHITECTURE.md's room map:\n" + "\n".join(wrong)


def test_no_import_circle_between_modules() -> None:
    known = {module for module, _ in modules()}
    graph: dict[str, set[str]] = {module: set() for module in known}
    for module, path in modules():
        for _, name in imports(path):
            target = resolve(name, known)
            if target is not None and target != module and not module.startswith(target + "."):
                graph[module].add(target)  # a package's own __init__ is not an edge back up
    # Tarjan's strongly connected components
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    assert not circles, f"import circles: {circles}"


@pytest.mark.parametrize(
    ("module", "room"),
    [("extproc.index.precise", "extproc.index"), ("contracts.etcd", "contracts"), ("kvgate.cli", "kvgate")],
)
def test_room_of_takes_the_longest_prefix(module: str, room: str) -> None:
    assert room_of(module, room_map()) == room
