"""The engine supervisor against a stand-in engine (a tiny Python HTTP server), a remote endpoint, and
one real llama-server running the SmolLM2 GGUF."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import stat
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from aiohttp import web

from agent.config import AgentSection
from agent.errors import EngineNotReady, EngineStartError
from agent.launch import EngineLaunch
from agent.supervisor import (
    TRANSITIONS,
    EnginePorts,
    EngineState,
    EngineSupervisor,
    Renderer,
    RestartBackoff,
    free_ports,
    make_private_dir,
    pick_ports,
)
from engines.config import EngineConfig, RestartPolicy
from runtime import lifecycle
from tests.polling import until

ROOT = Path(__file__).resolve().parents[2]
Make = Callable[..., EngineSupervisor]

#: The stand-in engine: 503 on /health until --ready-after seconds, then 200; --crash-once-file makes the
#: first run (the file does not exist yet) exit 3 shortly after it turned ready; --exit-at-once exits 3
#: at start; --sick-after makes /health answer 500 from then on; --ignore-term ignores SIGTERM;
#: --worker-pids FILE forks a worker (its pid appended to FILE) that ignores SIGTERM; --crash-after exits 3
#: that many seconds after start, every run.
FAKE_ENGINE = r"""
import argparse, os, signal, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--port", type=int, required=True)
p.add_argument("--ready-after", type=float, default=0.0)
p.add_argument("--crash-once-file")
p.add_argument("--exit-at-once", action="store_true")
p.add_argument("--sick-after", type=float)
p.add_argument("--ignore-term", action="store_true")
p.add_argument("--worker-pids")
p.add_argument("--crash-after", type=float)
a, _ = p.parse_known_args()
if a.worker_pids:  # a worker in the engine's process group that ignores SIGTERM (appends its pid)
    import subprocess, sys
    worker = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    with open(a.worker_pids, "a") as f:
        f.write(f"{subprocess.Popen([sys.executable, '-c', worker]).pid}\n")
if a.exit_at_once:
    os._exit(3)
if a.crash_after is not None:
    threading.Timer(a.crash_after, os._exit, (3,)).start()
if a.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
start = time.monotonic()
if a.crash_once_file and not os.path.exists(a.crash_once_file):
    open(a.crash_once_file, "w").close()
    threading.Timer(a.ready_after + 0.3, os._exit, (3,)).start()

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        up = time.monotonic() - start
        code = 503 if up < a.ready_after else 500 if a.sick_after is not None and up >= a.sick_after else 200
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", a.port), Health).serve_forever()
"""


@pytest.fixture
def fake_engine(tmp_path: Path) -> Path:
    path = tmp_path / "fake_engine.py"
    path.write_text(FAKE_ENGINE)
    return path


def fake(script: Path, *flags: str) -> Renderer:
    """A renderer that runs the stand-in engine on the picked port."""

    def render(engine: EngineConfig, agent: AgentSection, ports: EnginePorts) -> EngineLaunch:
        argv = (sys.executable, str(script), "--port", str(ports.port), *flags)
        url = f"http://127.0.0.1:{ports.port}"
        return EngineLaunch(argv, (), url, f"127.0.0.1:{ports.port}", "/health", None)

    return render


def stand_in(**keys: object) -> EngineConfig:
    fields: dict[str, object] = {"restart": RestartPolicy(0.1, 1.0, 60.0), "ready_timeout_s": 20.0} | keys
    return EngineConfig(id="fake-0", kind="sim", model="m", model_path="/unused", **fields)  # type: ignore[arg-type]


class Recorder:
    """on_change that keeps (monotonic time, new state)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, EngineState]] = []

    def __call__(self, sup: EngineSupervisor, old: EngineState, new: EngineState) -> None:
        assert new in TRANSITIONS[old]
        self.events.append((time.monotonic(), new))

    @property
    def states(self) -> list[EngineState]:
        return [s for _, s in self.events]


@pytest.fixture
async def supervisors() -> AsyncIterator[list[EngineSupervisor]]:
    """Supervisors to close at teardown (which stops their engines by pid)."""
    made: list[EngineSupervisor] = []
    yield made
    for sup in made:
        await sup.aclose()


@pytest.fixture
def make(tmp_path: Path, supervisors: list[EngineSupervisor]) -> Callable[..., EngineSupervisor]:
    agent = AgentSection(id="n", state_dir=str(tmp_path / "state"))

    def build(engine: EngineConfig, renderer: Renderer | None = None, **options: object) -> EngineSupervisor:
        kwargs: dict[str, object] = {"stop_grace_s": 3.0, "liveness_interval_s": 0.05} | options
        if renderer is not None:
            kwargs["renderer"] = renderer
        sup = EngineSupervisor(engine, agent, **kwargs)  # type: ignore[arg-type]
        supervisors.append(sup)
        return sup

    return build


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_restart_backoff_doubles_caps_and_resets() -> None:
    backoff = RestartBackoff(RestartPolicy(backoff_initial_s=0.5, backoff_max_s=3.0, stable_after_s=60.0))
    assert [backoff.delay_after(1.0) for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert backoff.delay_after(60.0) == 0.5
    assert backoff.delay_after(0.0) == 1.0


def test_state_machine_ends_in_stopped() -> None:
    assert TRANSITIONS[EngineState.DRAINING] == {EngineState.STOPPED}
    for state, targets in TRANSITIONS.items():
        if state is not EngineState.STOPPED:
            assert EngineState.STOPPED in targets or state is EngineState.DRAINING


def test_pick_ports_distinct_and_fixed() -> None:
    vllm = EngineConfig(
        id="v", kind="vllm", model="m", model_path="p", role="prefill", kv_offload="nixl", kv_events=True
    )
    ports = pick_ports(vllm)
    picked = [ports.port, ports.side]
    assert all(picked) and len(set(picked)) == 2
    fixed = pick_ports(EngineConfig(id="l", kind="llama_cpp", model="m", model_path="x.gguf", port=8123))
    assert fixed == EnginePorts(8123)
    assert len(set(free_ports("127.0.0.1", 3))) == 3


def test_make_private_dir_makes_or_fixes_0700_and_refuses_what_is_not_its_own(tmp_path: Path) -> None:
    """The KV event sockets' directory (prompt token ids pass there): made 0700, a loose existing one
    tightened, a symlink or a file refused."""
    fresh = tmp_path / "a" / "kv"
    make_private_dir(str(fresh))
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700 and fresh.stat().st_uid == os.geteuid()
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o777)
    make_private_dir(str(loose))
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    (tmp_path / "link").symlink_to(loose)
    with pytest.raises(OSError, match="not a directory"):
        make_private_dir(str(tmp_path / "link"))
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match="not a directory"):
        make_private_dir(str(tmp_path / "file"))


@pytest.mark.skipif(
    os.geteuid() != 0,
    reason="giving a directory to another user (chown) needs root: runs as root, as here and in CI",
)
def test_make_private_dir_refuses_another_users_directory(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 4242, 4242)
    with pytest.raises(OSError, match="belongs to uid 4242"):
        make_private_dir(str(theirs))


async def test_private_dirs_are_made_0700_before_each_start(
    make: Make, fake_engine: Path, tmp_path: Path
) -> None:
    private = tmp_path / "state" / "kv"
    private.mkdir(parents=True, mode=0o755)
    private.chmod(0o755)
    base = fake(fake_engine, "--crash-once-file", str(tmp_path / "crashed"))

    def render(engine: EngineConfig, agent: AgentSection, ports: EnginePorts) -> EngineLaunch:
        return dataclasses.replace(base(engine, agent, ports), private_dirs=(str(private),))

    sup = make(stand_in(), render)
    await sup.start()
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    private.rmdir()  # gone while the engine runs (a /tmp cleaner, say): made again for the restart
    await sup.wait_ready(timeout_s=10)
    await sup.wait_for(EngineState.RESTARTING, timeout_s=10)
    await sup.wait_for(EngineState.READY, timeout_s=10)
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    await sup.aclose()
    private.rmdir()
    private.symlink_to(tmp_path)
    with pytest.raises(EngineStartError, match="not a directory"):
        await make(stand_in(), render).start()


async def test_ready_after_health_turns_200(make: Make, fake_engine: Path) -> None:
    rec = Recorder()
    sup = make(stand_in(), fake(fake_engine, "--ready-after", "0.3", "--api-key", "s3cret"), on_change=rec)
    began = time.monotonic()
    await sup.start()
    assert sup.state is EngineState.STARTING and sup.pid is not None
    await sup.wait_ready(timeout_s=10)
    assert time.monotonic() - began >= 0.3
    assert rec.states == [EngineState.STARTING, EngineState.READY]
    header = sup.log_path.read_text().splitlines()[0]
    assert header.startswith("--- kvgate agent") and header.endswith("--api-key '***'")
    pid = sup.pid
    assert pid is not None
    await sup.aclose()
    assert sup.state in (EngineState.STOPPED,) and not alive(pid)
    assert sup.last_exit_code == -signal.SIGTERM


async def test_engine_log_is_private(make: Make, fake_engine: Path) -> None:
    """The engine's log is 0600, even where an earlier run left it readable by every local user: it may
    hold what the engine's debug level prints, credentials among them."""
    sup = make(stand_in(), fake(fake_engine))
    sup.log_path.parent.mkdir(parents=True)
    sup.log_path.write_text("an earlier run\n")
    sup.log_path.chmod(0o644)
    await sup.start()
    await sup.wait_ready(timeout_s=10)
    assert sup.log_path.read_text().startswith("an earlier run\n--- kvgate agent")
    assert sup.log_path.stat().st_mode & 0o777 == 0o600


async def test_crash_restarts_after_backoff(make: Make, fake_engine: Path, tmp_path: Path) -> None:
    rec = Recorder()
    sup = make(stand_in(), fake(fake_engine, "--crash-once-file", str(tmp_path / "crashed")), on_change=rec)
    await sup.start()
    await sup.wait_ready(timeout_s=10)
    first = sup.pid
    await sup.wait_for(EngineState.RESTARTING, timeout_s=10)
    await sup.wait_for(EngineState.READY, timeout_s=10)
    S = EngineState
    assert rec.states == [S.STARTING, S.READY, S.RESTARTING, S.STARTING, S.READY]
    times = dict((s, t) for t, s in rec.events[2:4])
    assert times[EngineState.STARTING] - times[EngineState.RESTARTING] >= 0.1  # backoff_initial_s
    assert (sup.restarts, sup.last_exit_code) == (1, 3) and sup.pid != first


async def test_crash_loop_backs_off_exponentially(make: Make, fake_engine: Path) -> None:
    rec = Recorder()
    sup = make(stand_in(), fake(fake_engine, "--exit-at-once"), on_change=rec)
    await sup.start()
    while sup.restarts < 3:
        await sup.wait_for(EngineState.STARTING, timeout_s=10)
        await sup.wait_for(EngineState.RESTARTING, timeout_s=10)
    await sup.aclose()
    pairs = zip(rec.events, rec.events[1:], strict=False)
    waits = [t1 - t0 for (t0, s0), (t1, _) in pairs if s0 is EngineState.RESTARTING]
    assert len(waits) >= 2 and waits[0] >= 0.1 and waits[1] >= 0.2 and sup.last_exit_code == 3


async def test_backoff_counts_the_time_ready_not_the_time_loading(make: Make, fake_engine: Path) -> None:
    """An engine that loads longer than ``stable_after_s`` and crashes soon after it turned ready keeps
    backing off (the loading time is no stable run)."""
    rec = Recorder()
    policy = RestartPolicy(0.1, 1.0, 0.3)
    sup = make(stand_in(restart=policy), fake(fake_engine, "--ready-after", "0.4", "--crash-after", "0.5"),
               on_change=rec)  # fmt: skip
    await sup.start()
    while sup.restarts < 3:
        await sup.wait_for(EngineState.STARTING, timeout_s=10)
        await sup.wait_for(EngineState.RESTARTING, timeout_s=10)
    await sup.aclose()
    pairs = zip(rec.events, rec.events[1:], strict=False)
    waits = [t1 - t0 for (t0, s0), (t1, _) in pairs if s0 is EngineState.RESTARTING]
    assert len(waits) >= 2 and waits[0] >= 0.1 and waits[1] >= 0.2


async def test_ports_are_picked_anew_until_the_engine_has_been_ready(make: Make, fake_engine: Path) -> None:
    """A picked port is free only when picked: an engine that fails before it was ever ready (its port
    taken meanwhile, say) starts again on newly picked ports; once ready, its address stays."""
    rendered: list[EnginePorts] = []
    crashing = fake(fake_engine, "--exit-at-once")

    def render(engine: EngineConfig, agent: AgentSection, ports: EnginePorts) -> EngineLaunch:
        rendered.append(ports)
        return crashing(engine, agent, ports)

    sup = make(stand_in(), render)
    await sup.start()
    while sup.restarts < 2:
        await sup.wait_for(EngineState.STARTING, timeout_s=10)
        await sup.wait_for(EngineState.RESTARTING, timeout_s=10)
    await sup.aclose()
    assert len(rendered) >= 2  # the start, then again for the restart after it

    kept: list[EnginePorts] = []
    once = fake(fake_engine, "--crash-once-file", str(fake_engine.parent / "crashed"))

    def render_kept(engine: EngineConfig, agent: AgentSection, ports: EnginePorts) -> EngineLaunch:
        kept.append(ports)
        return once(engine, agent, ports)

    ready = make(stand_in(), render_kept)
    await ready.start()
    await ready.wait_ready(timeout_s=10)
    await ready.wait_for(EngineState.RESTARTING, timeout_s=10)
    await ready.wait_for(EngineState.READY, timeout_s=10)
    assert kept == [kept[0]]  # rendered once: the restart after being ready keeps its address


async def test_workers_are_stopped_after_a_crash_and_at_close(
    make: Make, fake_engine: Path, tmp_path: Path
) -> None:
    """An engine's workers (its process group) are stopped whenever the engine ended: after a crash, before
    the restart, and at close (the engine itself exits at once on SIGTERM); SIGKILL after the grace
    period for one that ignores SIGTERM."""
    pids = tmp_path / "workers"
    flags = ("--crash-once-file", str(tmp_path / "crashed"), "--worker-pids", str(pids))
    sup = make(stand_in(), fake(fake_engine, *flags), stop_grace_s=0.3)
    await sup.start()
    await sup.wait_ready(timeout_s=10)
    await sup.wait_for(EngineState.RESTARTING, timeout_s=10)
    await sup.wait_for(EngineState.READY, timeout_s=10)
    first, second = (int(p) for p in pids.read_text().split())
    assert not alive(first) and alive(second)
    await sup.aclose()
    assert not alive(second)


async def test_not_ready_in_time_counts_as_a_crash(make: Make, fake_engine: Path) -> None:
    sup = make(stand_in(ready_timeout_s=0.3), fake(fake_engine, "--ready-after", "60"))
    await sup.start()
    await sup.wait_for(EngineState.RESTARTING, timeout_s=10)
    assert sup.last_exit_code == -signal.SIGTERM
    with pytest.raises(EngineNotReady, match=r"not ready after 0\.01s"):
        await sup.wait_ready(timeout_s=0.01)


async def test_unhealthy_then_restarted(make: Make, fake_engine: Path) -> None:
    rec = Recorder()
    sup = make(stand_in(), fake(fake_engine, "--sick-after", "0.2"), on_change=rec, liveness_failures=2,
               unhealthy_restart_s=0.3)  # fmt: skip
    await sup.start()
    await sup.wait_for(EngineState.RESTARTING, timeout_s=10)
    assert rec.states[:4] == [
        EngineState.STARTING, EngineState.READY, EngineState.UNHEALTHY, EngineState.RESTARTING,
    ]  # fmt: skip


async def test_drain_waits_for_in_flight_then_stops(make: Make, fake_engine: Path) -> None:
    rec = Recorder()
    sup = make(stand_in(), fake(fake_engine), on_change=rec, drain_poll_s=0.05)
    await sup.start()
    await sup.wait_ready(timeout_s=10)
    pid = sup.pid
    assert pid is not None
    counts, seen = iter([2, 1, 0]), []

    async def in_flight() -> int:
        assert alive(pid)  # the engine keeps serving while the count drops
        seen.append(next(counts))
        return seen[-1]

    assert await sup.drain(in_flight, timeout_s=10) == 0
    assert seen == [2, 1, 0] and not alive(pid)
    assert rec.states == [
        EngineState.STARTING, EngineState.READY, EngineState.DRAINING, EngineState.STOPPED,
    ]  # fmt: skip
    assert sup.restarts == 0


async def test_drain_timeout_then_sigkill(make: Make, fake_engine: Path) -> None:
    sup = make(stand_in(), fake(fake_engine, "--ignore-term"), stop_grace_s=0.2, drain_poll_s=0.05)
    await sup.start()
    await sup.wait_ready(timeout_s=10)

    async def busy() -> int:
        return 1

    began = time.monotonic()
    assert await sup.drain(busy, timeout_s=0.3) == 1
    assert 0.5 <= time.monotonic() - began < 5
    assert sup.state is EngineState.STOPPED and sup.last_exit_code == -signal.SIGKILL


async def test_unexecutable_engine_fails_start(make: Make, tmp_path: Path) -> None:
    def missing(engine: EngineConfig, agent: AgentSection, ports: EnginePorts) -> EngineLaunch:
        argv = (str(tmp_path / "no-such-engine"),)
        return EngineLaunch(argv, (), "http://127.0.0.1:1", "127.0.0.1:1", "/health", None)

    sup = make(stand_in(), missing)
    with pytest.raises(EngineStartError, match="cannot execute"):
        await sup.start()
    assert sup.state is EngineState.STOPPED


PARENT = """
import asyncio, sys
from pathlib import Path
from agent.config import AgentSection
from agent.launch import EngineLaunch
from agent.supervisor import EngineSupervisor
from engines.config import EngineConfig

script, state, pid_file = sys.argv[1:4]

def render(engine, agent, ports):
    url = f"http://127.0.0.1:{ports.port}"
    argv = (sys.executable, script, "--port", str(ports.port))
    return EngineLaunch(argv, (), url, url[7:], "/health", None)

async def main():
    engine = EngineConfig(id="orphan", kind="sim", model="m", model_path="/unused")
    sup = EngineSupervisor(engine, AgentSection(id="n", state_dir=state), renderer=render)
    await sup.start()
    await sup.wait_ready(20)
    Path(pid_file).write_text(str(sup.pid))
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_engine_dies_with_a_sigkilled_agent(fake_engine: Path, tmp_path: Path) -> None:
    pid_file = tmp_path / "engine.pid"
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PARENT, str(fake_engine), str(tmp_path / "state"), str(pid_file), cwd=ROOT
    )
    engine_pid = None
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert parent.returncode is None, "the agent stand-in exited"
            assert time.monotonic() < deadline, "engine not ready"
            await asyncio.sleep(0.05)
        engine_pid = int(pid_file.read_text())
        assert alive(engine_pid)
        parent.send_signal(signal.SIGKILL)
        assert await parent.wait() == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while alive(engine_pid):
            assert time.monotonic() < deadline, "engine outlived its agent"
            await asyncio.sleep(0.05)
    finally:
        if parent.returncode is None:
            parent.kill()
            await parent.wait()
        if engine_pid is not None and alive(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)


async def test_engine_starts_without_the_agents_at_fork_handlers(fake_engine: Path, tmp_path: Path) -> None:
    """No ``fork()`` for an engine (``setpriv --pdeathsig``, no ``preexec_fn``): the agent's at-fork
    handlers (gRPC's, with its channels busy, aborted such children now and then) do not run for it."""
    if lifecycle._setpriv() is None:
        pytest.skip(
            "no setpriv with --pdeathsig (engines are forked with a preexec_fn): install util-linux >= 2.33"
            " to run it"
        )
    marker, pid_file = tmp_path / "forked", tmp_path / "engine.pid"
    hook = f"import os\nos.register_at_fork(after_in_child=lambda: open({str(marker)!r}, 'w').close())\n"
    argv = (hook + PARENT, str(fake_engine), str(tmp_path / "state"), str(pid_file))
    parent = await asyncio.create_subprocess_exec(sys.executable, "-c", *argv, cwd=ROOT)

    def started() -> bool:
        return parent.returncode is not None or bool(pid_file.exists() and pid_file.read_text())

    try:
        await until(started, 30)
        assert parent.returncode is None, "the agent stand-in exited"
        assert not marker.exists()
    finally:
        parent.kill()
        await parent.wait()
        engine_pid = int(pid_file.read_text()) if pid_file.exists() and pid_file.read_text() else None
        if engine_pid is not None:
            with contextlib.suppress(AssertionError):
                await until(lambda: not alive(engine_pid), 10)
            if alive(engine_pid):
                os.kill(engine_pid, signal.SIGKILL)


async def test_remote_engine_ready_when_models_answers(make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_TEST_REMOTE_KEY", "sekret")
    calls: list[str | None] = []

    async def models(request: web.Request) -> web.Response:
        calls.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != "Bearer sekret":
            return web.json_response({"error": "no key"}, status=401)
        return web.json_response({"data": []}, status=200 if len(calls) > 3 else 503)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        remote = EngineConfig(
            id="remote-0", kind="openai_compat", model="m", address=f"127.0.0.1:{port}", metrics=False,
            api_key_env="KVGATE_TEST_REMOTE_KEY",
        )  # fmt: skip
        rec = Recorder()
        sup = make(remote, on_change=rec)
        await sup.start()
        await sup.wait_ready(timeout_s=10)
        assert len(calls) == 4 and set(calls) == {"Bearer sekret"} and sup.pid is None
        await sup.aclose()
        assert rec.states == [EngineState.STARTING, EngineState.READY, EngineState.STOPPED]
        monkeypatch.delenv("KVGATE_TEST_REMOTE_KEY")
        with pytest.raises(EngineStartError, match="KVGATE_TEST_REMOTE_KEY is not set"):
            await make(remote).start()
    finally:
        await runner.cleanup()


async def test_real_llama_server_gets_ready(make: Make) -> None:
    llama = EngineConfig(
        id="llama-0", kind="llama_cpp", model="SmolLM2-135M-Instruct", model_path="smollm2",
        context=256, parallel=1, threads=1, ready_timeout_s=120,
    )  # fmt: skip
    sup = make(llama)
    await sup.start()
    await sup.wait_ready(timeout_s=120)
    assert sup.launch is not None and sup.pid is not None
    url = sup.launch.base_url + "/v1/models"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
    assert b"SmolLM2-135M-Instruct" in body
    pid = sup.pid
    await sup.aclose()
    assert not alive(pid) and sup.state is EngineState.STOPPED
