"""`kvgate up` as a user runs it, when things are not fresh: a reused work directory, a port in use, a
launcher killed with SIGKILL, engines that serve another model, a gateway config of the user's own.

Every launcher here is ``python -m kvgate.cli up`` in a subprocess, with ``KVGATE_STATE_DIR`` in a
temporary directory (its published stack.json never touches the user's). Readiness is the banner, which
ends with the line "Ctrl-C stops everything"; processes are found through ``/proc`` and ended by PID.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import httpx
import openai
import pytest

from kvgate import apikey
from kvgate.dev.procs import Child, admin_get
from kvgate.dev.up import Stack
from tests.e2e.conftest import FAST_SIM
from tests.polling import until

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"


class Up:
    """One ``kvgate up`` subprocess: its output so far, and its banner once up."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []

    @classmethod
    async def start(cls, args: Sequence[str], env: dict[str, str], timeout_s: float = 300) -> Up:
        """Start ``kvgate up ARGS`` and wait for its whole banner (fails with its output if it exits)."""
        up = cls(await _kvgate(["up", *args], env))
        try:
            await asyncio.wait_for(up._read_banner(), timeout_s)
        except BaseException:
            await up.aclose()
            raise
        return up

    async def _read_banner(self) -> None:
        assert self.proc.stdout is not None
        while not any("Ctrl-C stops everything" in line for line in self.lines):
            line = (await self.proc.stdout.readline()).decode()
            if not line:
                raise AssertionError("kvgate up exited before it was up:\n" + "".join(self.lines))
            self.lines.append(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def banner(self) -> str:
        """The line "kvgate is up: URL  (model M; engines ...)"."""
        (line,) = [line for line in self.lines if line.startswith("kvgate is up: ")]
        return line

    @property
    def base_url(self) -> str:
        return self.banner.split()[3]

    def field(self, label: str) -> str:
        """The banner's value for ``label`` (``"ext_proc metrics"``: the first word after the colon)."""
        (line,) = [line for line in self.lines if line.startswith(f"  {label}:")]
        return line.split(":", 1)[1].split()[0]

    async def stop(self) -> int:
        """Ctrl-C, as a user stops it; its exit status."""
        self.proc.send_signal(signal.SIGINT)
        return await asyncio.wait_for(self.proc.wait(), 60)

    async def aclose(self) -> None:
        if self.proc.returncode is None:
            try:
                await self.stop()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def _kvgate(argv: Sequence[str], env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvgate.cli",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        cwd=ROOT,
    )


async def kvgate(argv: Sequence[str], env: dict[str, str], timeout_s: float = 60) -> tuple[int, str]:
    """Run ``kvgate ARGV`` to its end: (exit status, stdout + stderr)."""
    proc = await _kvgate(argv, env)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The launcher's environment: its stack.json pointer goes under this test's tmp_path."""
    return {**os.environ, "KVGATE_STATE_DIR": str(tmp_path / "state")}


@pytest.fixture
async def launched() -> AsyncIterator[list[Up]]:
    """Launchers a test starts, stopped at the end whatever happened."""
    ups: list[Up] = []
    yield ups
    for up in ups:
        await up.aclose()


async def complete(base_url: str, model: str = MODEL) -> None:
    """One chat completion through the gateway (raises on any non-2xx)."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    assert reply.choices[0].message.content


def descendants(pid: int) -> set[int]:
    """Every process under ``pid``: its children, theirs, and so on (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def children(pid: int) -> set[int]:
    return {int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not reaped, does not)."""
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (ProcessLookupError, OSError):
        return False


def kill_all(pids: set[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


# -- a reused --workdir ---------------------------------------------------------------------------------


async def test_a_reused_workdir_serves_after_a_clean_stop(
    tmp_path: Path, env: dict[str, str], launched: list[Up]
) -> None:
    """The second run must not take the first run's ready files (dead ports) for its own."""
    args = ["--port", "0", "--replicas", "1", "--workdir", str(tmp_path / "w")]
    launched.append(first := await Up.start(args, env))
    await complete(first.base_url)
    assert await first.stop() == 0
    assert (tmp_path / "w" / "sim.ready.json").exists() and (tmp_path / "w" / "extproc.ready.json").exists()
    launched.append(second := await Up.start(args, env))
    for _ in range(3):
        await complete(second.base_url)


async def test_a_reused_workdir_serves_after_kill_9(
    tmp_path: Path, env: dict[str, str], launched: list[Up]
) -> None:
    """Everything of the first run killed with SIGKILL (no clean-up at all): the second run still serves."""
    args = ["--port", "0", "--replicas", "1", "--workdir", str(tmp_path / "w")]
    launched.append(first := await Up.start(args, env))
    tree = descendants(first.pid) | {first.pid}
    kill_all(tree)
    await until(lambda: not any(alive(p) for p in tree), 30)
    assert (tmp_path / "w" / "sim.ready.json").exists()
    launched.append(second := await Up.start(args, env))
    for _ in range(3):
        await complete(second.base_url)


# -- a port in use --------------------------------------------------------------------------------------


async def test_a_port_in_use_is_refused_before_anything_starts(
    stack: Stack, tmp_path: Path, env: dict[str, str], launched: list[Up]
) -> None:
    """The session stack's Envoy listens with SO_REUSEPORT: a second Envoy could share its port."""
    port = int(stack.url.rsplit(":", 1)[1])
    workdir = tmp_path / "w"
    proc = await _kvgate(["up", "--port", str(port), "--replicas", "1", "--workdir", str(workdir)], env)
    up = Up(proc)
    launched.append(up)
    assert proc.stdout is not None
    while line := (await asyncio.wait_for(proc.stdout.readline(), 120)).decode():
        up.lines.append(line)
        assert not line.startswith("kvgate is up: "), "a second kvgate up started on a port in use"
    assert await proc.wait() == 1
    assert up.lines == [
        f"kvgate up: 127.0.0.1:{port} is already in use (another kvgate up, or another server): "
        "choose another --port, or --port 0 for any free port\n"
    ]
    assert not list(workdir.glob("*.log"))  # nothing was started


# -- addresses ------------------------------------------------------------------------------------------


async def test_every_address_is_printed_and_published(
    tmp_path: Path, env: dict[str, str], launched: list[Up]
) -> None:
    workdir, pointer = tmp_path / "w", tmp_path / "state" / "stack.json"
    launched.append(up := await Up.start(["--port", "0", "--replicas", "1", "--workdir", str(workdir)], env))
    assert up.field("OpenAI base URL") == up.base_url
    async with httpx.AsyncClient(timeout=10) as http:
        metrics = await http.get(up.field("ext_proc metrics"))
        assert metrics.status_code == 200 and "kvgate_" in metrics.text
    admin = up.field("Envoy admin")  # unix:PATH, the private admin socket
    assert admin == f"unix:{workdir / 'envoy-admin.sock'}"
    ready = await asyncio.to_thread(admin_get, admin, "/ready")
    assert ready is not None and ready[0] == 200
    assert up.field("workdir") == str(workdir)
    published = json.loads((workdir / "stack.json").read_text())
    assert json.loads(pointer.read_text()) == published
    assert published["pid"] == up.pid and published["base_url"] == up.base_url
    assert published["metrics_url"] == up.field("ext_proc metrics") and published["etcd"] is None
    assert published["admin_url"] == up.field("Envoy admin") and published["workdir"] == str(workdir)
    assert set(published["logs"]) == {"sim", "extproc", "envoy", "access"}
    assert published["logs"]["access"] == up.field("access log") == str(workdir / "access.log")
    assert all(map(os.path.exists, published["logs"].values()))
    assert await up.stop() == 0
    assert not pointer.exists()  # a clean stop withdraws it


async def test_readme_policy_and_drain_commands_find_the_local_stack(
    tmp_path: Path, env: dict[str, str], launched: list[Up]
) -> None:
    """`kvgate policy list`, `kvgate policy set weights/prefix 5`, `kvgate drain sim-0` as the README
    writes them (no --etcd) against `kvgate up --agents 2`; an unknown id is refused."""
    args = ["--agents", "2", "--port", "0", "--workdir", str(tmp_path / "w")]
    launched.append(up := await Up.start(args, env))
    assert up.field("etcd").startswith("127.0.0.1:")
    status, out = await kvgate(["policy", "list"], env)
    assert status == 0 and "weights/prefix=3.0" in out.splitlines(), out
    status, out = await kvgate(["policy", "set", "weights/prefix", "5"], env)
    # stdout: the value written; stderr: its audit line (who, key, revision; never the value)
    assert status == 0 and out.splitlines()[-1] == "weights/prefix=5", out
    assert any(line.startswith("audit: by=") and "op=set revision=" in line for line in out.splitlines()), out
    assert await kvgate(["policy", "get", "weights/prefix"], env) == (0, "5.0\n")
    status, out = await kvgate(["drain", "sim-0"], env)
    assert status == 0 and "sim-0 draining" in out, out
    status, out = await kvgate(["drain", "sim-9"], env)
    assert status == 2 and "(registered: sim-0, sim-1); nothing written" in out, out
    assert await up.stop() == 0
    status, out = await kvgate(["policy", "list"], env)
    assert status == 2 and "pass --etcd HOST:PORT" in out, out


# -- orphans --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [["--replicas", "1"], ["--agents", "1"]], ids=["sims", "agents"])
async def test_kill_9_of_the_launcher_ends_every_process_it_started(
    mode: list[str], tmp_path: Path, env: dict[str, str], launched: list[Up]
) -> None:
    launched.append(up := await Up.start(["--port", "0", "--workdir", str(tmp_path / "w"), *mode], env))
    tree = descendants(up.pid)
    if mode[0] == "--agents":
        assert len(tree - children(up.pid)) >= 1, "the agent's engine is a grandchild"
    try:
        os.kill(up.pid, signal.SIGKILL)
        await up.proc.wait()
        await until(lambda: not any(alive(p) for p in tree), 60)
        status, out = await kvgate(["policy", "list"], env)  # the pointer it left is not taken for live
        assert status == 2 and f"the kvgate up that wrote it (pid {up.pid}) is not running" in out, out
    finally:
        kill_all(tree)  # only after a failure: orphans of this test


# -- engines that serve another model -------------------------------------------------------------------


async def test_an_endpoint_without_model_serves_the_models_the_engine_lists(
    model_dir: str, tmp_path: Path, env: dict[str, str], launched: list[Up]
) -> None:
    other = "org/Other-Model-1B"
    ready = tmp_path / "engine.ready.json"
    argv = [sys.executable, "-m", "load.sim.server", "--model", other, "--model-dir", model_dir]
    argv += ["--replicas", "1", "--port", "0", "--ready-file", str(ready), *FAST_SIM]
    engine = Child("engine", argv, tmp_path / "engine.log")
    try:
        (replica,) = engine.wait_for_json_file(ready, 120)
        args = ["--endpoint", f"http://{replica['address']}", "--port", "0", "--workdir", str(tmp_path / "w")]
        launched.append(up := await Up.start(args, env))
        assert f"(model {other}; engines engine-0={replica['address']})" in up.banner
        await complete(up.base_url, other)
        async with httpx.AsyncClient(timeout=10) as http:
            listed = (await http.get(f"{up.base_url}/models")).json()
        assert [m["id"] for m in listed["data"]] == [other]
    finally:
        engine.stop()


# -- --config -------------------------------------------------------------------------------------------


async def test_a_config_file_is_merged_over_the_generated_one(
    tmp_path: Path, env: dict[str, str], launched: list[Up]
) -> None:
    """[auth] + [[tenants]] (API keys) and an [extproc] limit of the user's, observable through Envoy."""
    keys = tmp_path / "api_keys.json"
    key, _ = apikey.create(keys, "acme", "ci", int(time.time()))
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[auth]\napi_keys_file = "{keys}"\n'
        '[[tenants]]\nid = "acme"\nmodels = ["*"]\n'
        "[extproc]\nmax_body_bytes = 1024\n"
    )
    args = ["--config", str(config), "--port", "0", "--replicas", "1", "--workdir", str(tmp_path / "w")]
    launched.append(up := await Up.start(args, env))
    url = f"{up.base_url}/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    bearer = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=30) as http:
        refused = await http.post(url, json=body)
        assert refused.status_code == 401, refused.text
        served = await http.post(url, json=body, headers=bearer)
        assert served.status_code == 200, served.text
        big = {**body, "messages": [{"role": "user", "content": "x" * 2000}]}
        too_big = await http.post(url, json=big, headers=bearer)
        assert too_big.status_code == 413, too_big.text


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[index]\nblock_size = 0\n", "index.block_size: must be >= 1, got 0"),
        ('[extproc]\nlisten = "0.0.0.0:9002"\n', "extproc.listen: set by kvgate up itself"),
        ("[scheduling\n", "not valid TOML"),
    ],
    ids=["bad-value", "launcher-key", "not-toml"],
)
async def test_a_bad_config_file_is_refused_before_anything_starts(
    text: str, reason: str, tmp_path: Path, env: dict[str, str]
) -> None:
    config, workdir = tmp_path / "gateway.toml", tmp_path / "w"
    config.write_text(text)
    status, out = await kvgate(["up", "--config", str(config), "--port", "0", "--workdir", str(workdir)], env)
    assert status == 2 and out.startswith("kvgate up: --config: ") and reason in out, out
    assert not workdir.exists() or not list(workdir.iterdir())  # nothing started, nothing written
