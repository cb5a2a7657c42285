"""Every fenced block of README.md is run or validated against the real code, so the user's guide stays true.

The harness reads README.md's fenced blocks in order. A block's convention is its language plus, at most,
one ``<!-- readme: ... -->`` HTML comment on the last non-blank line before its opening fence (GitHub does
not render it):

=====================================  =====================================================================
block                                  what the test does
=====================================  =====================================================================
the opening block                      nothing: it must be the first thing after the title and hold exactly
                                       ``./dev up`` and ``./dev test`` (one runs until Ctrl-C, the other is
                                       the suite running this test)
``<!-- readme: not run: REASON -->``   nothing, but the reason must be given and the list of such blocks
                                       is pinned in :data:`NOT_RUN` (a new skip is a visible decision)
```sh``                                every command runs, in order, in one ``bash`` (so ``export`` holds)
                                       and must exit 0, or N when its trailing comment says ``exit N``
                                       (``kvgate policy set weights/prefix -1   # refused (exit 2) ...``)
```console``                           each ``$ `` command (``\\`` continues it) runs on its own and its
                                       output (stdout and stderr) must match the lines below it, where
                                       ``...`` stands for any text; exit status as for ``sh``
```python``                            runs with this interpreter and must exit 0
``<!-- readme: starts -->`` + ``sh``   each command is a daemon (``kvgate extproc|agent|kvcached``): started
                                       with ``--ready-file`` appended, ready within 120 s, then stopped with
                                       SIGTERM to its PID, which must exit 0
``<!-- readme: LOADER config -->``     a ``toml`` block parsed by the loader the daemon itself uses
  + ``toml``                           (``gateway``: extproc.config, ``agent``: agent.config, ``kvcached``:
                                       kvcached.config, ``policy``: the policy store); ``, saved as NAME``
                                       also writes it into the scratch directory for later blocks
```text``                              an illustration (output, diagram): nothing
=====================================  =====================================================================

Commands run in a scratch directory (the README's relative paths land there) with the virtualenv's bin
first on ``PATH``, against one stack started for this module: ``kvgate up --agents 2`` on free ports
(:class:`kvgate.dev.up.Stack`, as tests/e2e/ do). The README is written for a user's machine, so the
text of every block that runs, and of every config it saves, is rewritten first, by :func:`rewrites` and
nothing else:

- ``http://127.0.0.1:8080`` (Envoy's OpenAI listener) -> the stack's URL;
- ``http://127.0.0.1:9090`` (the ext_proc's metrics) -> the stack's ext_proc metrics URL;
- ``127.0.0.1:2379`` (etcd) -> the stack's etcd, which commands without ``--etcd`` find through the stack's
  ``stack.json``, published in a state directory of the test's own (``KVGATE_STATE_DIR``);
- ``/etc/kvgate``, ``/var/lib/kvgate``, ``/run/kvgate`` -> the same paths under the scratch directory;
- in saved configs only, every ``*listen* = "host:port"`` gets port 0 (daemons bind free ports).

A block whose commands start with ``curl`` is skipped, visibly, on a machine without curl (kvgate does not
install it).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.config import parse_node_config
from contracts.etcd import encode_value
from extproc.config import parse_config
from extproc.control.policy import PolicyStore, flatten_policy
from kvcached.config import parse_kvcached_config
from kvgate.cli import COMMANDS
from kvgate.dev import stackfile
from kvgate.dev.procs import Child
from kvgate.dev.up import Stack, StackOptions

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BIN = Path(sys.executable).parent
#: Simulated replicas 20x faster than the H100 timing model (as tests/e2e/conftest.py).
FAST_SIM = ("--time-scale", "0.05")

OPENING = (
    "./dev up      # set up, then run the gateway: Envoy + kvgate + 4 simulated vLLM replicas at "
    "http://127.0.0.1:8080/v1\n"
    "./dev test    # set up, then run the whole test suite (ruff, mypy --strict, pytest: unit, integration, "
    "end-to-end)\n"
)
#: The first line of every block marked ``not run``, in README order: adding one is a decision.
NOT_RUN = (
    "./dev up --endpoint http://10.0.0.5:8000 --endpoint http://10.0.0.6:8000 \\",
    "./dev up --agents 2                                        "
    "# two agents, each supervising a simulated vLLM",
    "./dev up --secure                 # https://127.0.0.1:8080/v1; prints the CA file clients must trust",
    "import ssl",
    "kvgate certs issue --dir /etc/kvgate/certs --name etcd --san DNS:etcd.internal",
)
LOADERS = ("gateway", "agent", "kvcached", "policy")
LANGUAGES = ("sh", "console", "python", "toml", "text")

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!-- readme: (.*) -->$")
_CONFIG = re.compile(rf"^({'|'.join(LOADERS)}) config(?:, saved as ([\w.-]+))?$")
#: ``exit N`` in a command's trailing comment (a ``#`` with no quote after it).
_EXIT = re.compile(r"#[^'\"]*\bexit (\d+)\b[^'\"]*$")
_LISTEN = re.compile(r'^(\s*\w*listen\w*\s*=\s*")([^"]*):\d+"', re.M)


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced block: its language, body, the line of its opening fence, and its readme comment."""

    lang: str
    text: str
    line: int
    marker: str | None

    @property
    def first_line(self) -> str:
        return self.text.splitlines()[0] if self.text else ""

    @property
    def not_run(self) -> str | None:
        """The reason given by ``not run: REASON`` (``""`` when empty), ``None`` for other blocks."""
        if self.marker is None or not self.marker.startswith("not run:"):
            return None
        return self.marker.removeprefix("not run:").strip()

    @property
    def config(self) -> tuple[str, str | None] | None:
        """``(loader, saved-as file or None)`` for a config block."""
        match = _CONFIG.match(self.marker or "")
        return None if match is None else (match.group(1), match.group(2))


def parse_blocks(markdown: str) -> list[Block]:
    """The fenced blocks of ``markdown`` in order; a readme comment not right before a fence fails."""
    lines = markdown.splitlines()
    blocks: list[Block] = []
    pending: tuple[int, str] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = _MARKER.match(line)
        if marker:
            assert pending is None, f"README line {pending[0]}: a readme comment with no block after it"
            pending = (i + 1, marker.group(1))
        elif (fence := _FENCE.match(line)) is not None:
            end = next((j for j in range(i + 1, len(lines)) if lines[j] == "```"), None)
            assert end is not None, f"README line {i + 1}: unclosed fence"
            body = "".join(f"{x}\n" for x in lines[i + 1 : end])
            blocks.append(Block(fence.group(1), body, i + 1, pending[1] if pending else None))
            pending, i = None, end
        elif line.strip():
            assert pending is None, f"README line {pending[0]}: a readme comment must precede a fence"
        i += 1
    assert pending is None, f"README line {pending[0]}: a readme comment with no block after it"
    return blocks


BLOCKS = parse_blocks(README.read_text())
NOT_RUN_BLOCKS = [b for b in BLOCKS[1:] if b.not_run is not None]
CONFIG_BLOCKS = [b for b in BLOCKS if b.config is not None]
RUN_BLOCKS = [
    b for b in BLOCKS[1:] if b.not_run is None and b.config is None and b.lang in ("sh", "console", "python")
]


def block_id(block: Block) -> str:
    return f"L{block.line}-{block.lang}"


# -- conventions -------------------------------------------------------------------------------------------


def test_opening_block_is_the_two_commands() -> None:
    """The README starts with the title and then exactly ``./dev up`` and ``./dev test``."""
    text = README.read_text()
    assert text.startswith("# kvgate\n\n```sh\n" + OPENING + "```\n"), (
        "README.md must open with the two commands"
    )
    assert BLOCKS[0].text == OPENING and BLOCKS[0].marker is None


def test_every_block_has_a_convention() -> None:
    """Each block's language and readme comment is one the harness knows (see the module docstring)."""
    for block in BLOCKS[1:]:
        where = f"README line {block.line}"
        assert block.lang in LANGUAGES, f"{where}: no convention for ```{block.lang} (known: {LANGUAGES})"
        if block.not_run is not None:
            continue
        if block.lang == "toml":
            assert block.config is not None, f"{where}: a toml block needs <!-- readme: LOADER config -->"
        elif block.lang == "text":
            assert block.marker is None, f"{where}: a text block is never run; drop its readme comment"
        elif block.marker == "starts":
            assert block.lang == "sh", f"{where}: only sh blocks can start daemons"
        else:
            assert block.marker is None, f"{where}: unknown readme comment {block.marker!r}"


def test_skipped_blocks_are_few_and_explained() -> None:
    """Every ``not run`` block gives its reason, and the list of them changes only on purpose."""
    for block in NOT_RUN_BLOCKS:
        assert block.not_run, f"README line {block.line}: `not run:` needs a reason"
    assert tuple(b.first_line for b in NOT_RUN_BLOCKS) == NOT_RUN


def test_links_resolve() -> None:
    """Relative links name files that exist, and ``#anchors`` name headings of the README."""
    text = README.read_text()
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", prose, re.M)}
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if target.startswith(("http://", "https://")):
            continue
        if target.startswith("#"):
            assert target[1:] in anchors, f"README link {target}: no such heading"
        else:
            assert (ROOT / target.split("#")[0]).exists(), f"README link {target}: no such file"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_kvgate_up_flags_are_all_documented() -> None:
    """The `kvgate up` flags table lists every flag `kvgate up --help` has."""
    text = README.read_text()
    section = text[text.index("### `kvgate up` flags") :]
    table = section[: section.index("\n\n", section.index("|"))]
    documented = set(re.findall(r"--[a-z][a-z-]*", table))
    helped = set(re.findall(r"^ +(?:-\w, )?(--[a-z][a-z-]*)", _help(("up",)), re.M)) - {"--help"}
    assert helped <= documented, (
        f"kvgate up flags missing from the README table: {sorted(helped - documented)}"
    )


_SUBCOMMANDS = {"policy", "certs", "apikey", "bench", "model", "etcd"}


def test_flags_named_in_the_readme_exist() -> None:
    """Every ``--flag`` of a ``kvgate ...`` or ``./dev up ...`` command in the README, in code spans and
    in blocks, is one that command's ``--help`` lists."""
    named = re.findall(r"`((?:kvgate|\./dev up) [^`\n]+)`", README.read_text())
    for block in BLOCKS[1:]:
        if block.lang == "sh":
            named += [command for command, _ in commands(block.text)]
        elif block.lang == "console":
            named += [command for command, _, _ in console_steps(block.text)]
    wanted: dict[tuple[str, ...], set[str]] = {}
    for command in named:
        words = command.replace("\\\n", " ").split(" #")[0].replace("./dev up", "kvgate up").split()
        if len(words) < 2 or words[0] != "kvgate" or not re.fullmatch(r"[a-z-]+", words[1]):
            continue  # not a command (an error message quoted in prose)
        assert words[1] in COMMANDS, f"the README names `kvgate {words[1]}`, which does not exist"
        sub = words[1] in _SUBCOMMANDS and len(words) > 2 and words[2].isalpha()
        key = tuple(words[1:3] if sub else words[1:2])
        flags = {
            w.split("=")[0] for w in words[len(key) + 1 :] if re.fullmatch(r"--[a-z][a-z0-9-]*(=.*)?", w)
        }
        wanted.setdefault(key, set()).update(flags)
    for key, flags in sorted(wanted.items()):
        known = set(re.findall(r"--[a-z][a-z0-9-]*", _help(key)))
        assert flags <= known, (
            f"kvgate {' '.join(key)}: the README names {sorted(flags - known)}, not in --help"
        )


def _help(key: tuple[str, ...]) -> str:
    """What ``kvgate KEY... --help`` prints (run in this process: the same code as the script)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), contextlib.suppress(SystemExit):
        COMMANDS[key[0]]([*key[1:], "--help"])
    return out.getvalue()


# -- config blocks -----------------------------------------------------------------------------------------


def _validate_policy(raw: object) -> None:
    items = {path: encode_value(value) for path, value in flatten_policy(raw, "README").items()}
    PolicyStore().load(items)


VALIDATORS: dict[str, Callable[[object], object]] = {
    "gateway": parse_config,
    "agent": parse_node_config,
    "kvcached": parse_kvcached_config,
    "policy": _validate_policy,
}


@pytest.mark.parametrize("block", CONFIG_BLOCKS, ids=block_id)
def test_config_block_parses(block: Block) -> None:
    """A config example is valid for the loader of the daemon that reads it (unknown keys are errors)."""
    assert block.config is not None and block.lang == "toml"
    VALIDATORS[block.config[0]](tomllib.loads(block.text))


# -- the stack and the scratch directory -------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """``kvgate up --agents 2`` on free ports: Envoy, the ext_proc, a local etcd, two agents with one
    simulated vLLM each (``sim-0``, ``sim-1``), as the README's commands expect."""
    options = StackOptions(
        agents=2,
        port=0,
        workdir=tmp_path_factory.mktemp("readme-stack"),
        agent_args=FAST_SIM,  # the agents' simulators (sim_args apply only without agents)
    )
    with Stack(options) as running:
        yield running


def rewrites(stack: Stack, scratch: Path) -> list[tuple[str, str]]:
    """What the README assumes -> what this test's stack and scratch directory have, applied in order."""
    assert stack.etcd is not None
    return [
        ("http://127.0.0.1:8080", stack.url),
        ("http://127.0.0.1:9090", f"http://127.0.0.1:{stack.extproc_ports['metrics']}"),
        ("127.0.0.1:2379", stack.etcd.address),
        ("/etc/kvgate", f"{scratch}/etc/kvgate"),
        ("/var/lib/kvgate", f"{scratch}/var/lib/kvgate"),
        ("/run/kvgate", f"{scratch}/run/kvgate"),
    ]


@dataclass(frozen=True, slots=True)
class Scratch:
    """Where blocks run, and how their text is adapted to this machine."""

    path: Path
    table: list[tuple[str, str]]
    env: dict[str, str]

    def adapt(self, text: str) -> str:
        for old, new in self.table:
            text = text.replace(old, new)
        return text


@pytest.fixture(scope="module")
def scratch(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Scratch:
    """The scratch directory, with every ``saved as`` config written (adapted, listen ports 0)."""
    path = tmp_path_factory.mktemp("readme")
    for sub in ("etc/kvgate", "var/lib", "run/kvgate"):
        (path / sub).mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("KVGATE_ETCD", "KVGATE_API_KEYS")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    # Published as `kvgate up` publishes itself: `kvgate policy` and `kvgate drain` find its etcd there.
    assert stack.info is not None
    env[stackfile.STATE_DIR_ENV] = str(path / "state")
    stackfile.write(path / "state" / stackfile.FILE_NAME, stack.info)
    made = Scratch(path, rewrites(stack, path), env)
    for block in CONFIG_BLOCKS:
        assert block.config is not None
        if block.config[1] is not None:
            text = _LISTEN.sub(r'\g<1>\g<2>:0"', made.adapt(block.text))
            (path / block.config[1]).write_text(text)
    return made


# -- blocks that run ---------------------------------------------------------------------------------------


def commands(text: str) -> list[tuple[str, int]]:
    """The commands of an ``sh`` block (``\\`` continues a line; blank and comment lines skipped), each
    with the exit status its trailing comment expects (0 unless ``exit N``)."""
    out: list[tuple[str, int]] = []
    current: list[str] = []
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current.append(line)
        if not line.endswith("\\"):
            command = "\n".join(current)
            status = _EXIT.search(current[-1])
            out.append((command, int(status.group(1)) if status else 0))
            current = []
    assert not current, "a command ends with a line continuation"
    return out


def console_steps(text: str) -> list[tuple[str, int, str]]:
    """The ``$ `` commands of a ``console`` block with their expected exit status and output."""
    steps: list[tuple[list[str], list[str]]] = []
    continued = False
    for line in text.splitlines():
        if line.startswith("$ "):
            steps.append(([line[2:]], []))
        elif continued:
            steps[-1][0].append(line)
        else:
            assert steps, "a console block starts with a `$ ` command"
            steps[-1][1].append(line)
        continued = line.endswith("\\") and not steps[-1][1]
    out = []
    for cmd, expected in steps:
        status = _EXIT.search(cmd[-1])
        out.append(("\n".join(cmd), int(status.group(1)) if status else 0, "\n".join(expected)))
    return out


def matches(expected: str, actual: str) -> bool:
    """``actual`` equals ``expected`` where each ``...`` stands for any text (newlines included)."""
    pattern = ".*".join(re.escape(part) for part in expected.split("..."))
    return re.fullmatch(pattern, actual.rstrip("\n"), re.S) is not None


def run_sh(block: Block, scratch: Scratch) -> None:
    """Every command of the block in one bash, each checked for its expected exit status."""
    script = ["set -o pipefail"]
    cmds = commands(scratch.adapt(block.text))
    for n, (command, status) in enumerate(cmds):
        script.append(
            f'{{ {command}\n}}; s=$?; [ $s -eq {status} ] || {{ echo "@@readme {n} $s" >&2; exit 97; }}'
        )
    done = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=scratch.path,
        env=scratch.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    failed = re.search(r"@@readme (\d+) (\d+)", done.stderr)
    where = f"README line {block.line}"
    if failed:
        command, status = cmds[int(failed.group(1))]
        pytest.fail(
            f"{where}: `{command}` exited {failed.group(2)}, expected {status}:\n{done.stdout}{done.stderr}"
        )
    assert done.returncode == 0, f"{where}: {done.stdout}{done.stderr}"


def run_console(block: Block, scratch: Scratch) -> None:
    for command, status, expected in console_steps(scratch.adapt(block.text)):
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=scratch.path,
            env=scratch.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=60,
            check=False,
        )
        where = f"README line {block.line}: `{command}`"
        assert done.returncode == status, (
            f"{where} exited {done.returncode}, expected {status}:\n{done.stdout}"
        )
        assert matches(scratch.adapt(expected), done.stdout), (
            f"{where} printed\n{done.stdout}\nnot\n{expected}"
        )


def run_python(block: Block, scratch: Scratch) -> None:
    path = scratch.path / f"readme_line_{block.line}.py"
    path.write_text(scratch.adapt(block.text))
    done = subprocess.run(
        [sys.executable, str(path)],
        cwd=scratch.path,
        env=scratch.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"README line {block.line}: {done.stdout}{done.stderr}"


def run_daemons(block: Block, scratch: Scratch) -> None:
    """Start each command with ``--ready-file``, wait for it, then SIGTERM each by PID: exit 0."""
    started: list[Child] = []
    try:
        for n, (command, _) in enumerate(commands(scratch.adapt(block.text))):
            ready = scratch.path / f"readme_line_{block.line}_{n}.ready.json"
            ready.unlink(missing_ok=True)
            line = f"cd {shlex.quote(str(scratch.path))} && exec {command} --ready-file {ready}"
            argv = ["bash", "-c", line]
            child = Child(f"readme-{block.line}-{n}", argv, scratch.path / f"{ready.stem}.log", scratch.env)
            started.append(child)
            child.wait_for_json_file(ready, 120)
    finally:
        statuses = [(child, child.stop(grace_s=30)) for child in reversed(started)]
    for child, status in statuses:
        assert status == 0, f"README line {block.line}: {child.name} exited {status}:\n{child.tail()}"


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=block_id)
def test_block_runs(block: Block, scratch: Scratch) -> None:
    """The block does what the README says, against the module's stack (see the module docstring)."""
    if (
        re.search(r"^(\$ )?curl ", block.text, re.M)
        and shutil.which("curl", path=scratch.env["PATH"]) is None
    ):
        pytest.skip("curl is not installed (kvgate does not install it): install curl to run it")
    if block.marker == "starts":
        run_daemons(block, scratch)
    elif block.lang == "sh":
        run_sh(block, scratch)
    elif block.lang == "console":
        run_console(block, scratch)
    else:
        run_python(block, scratch)
