"""Engine supervision: run one engine, watch its health, restart it with backoff, drain and stop it.

The core is plain data: :class:`EngineState` and its allowed :data:`TRANSITIONS`, and
:class:`RestartBackoff` (delays from run lengths passed in, no clock reads). :class:`EngineSupervisor` is
the asyncio shell around them:

- ports: ``port = 0`` (and the side-channel port the rendering needs) are picked at
  :meth:`EngineSupervisor.start` and kept across restarts once the engine has been ready (the registered
  address must not move); until then each restart picks them anew (a picked port is free only when
  picked: another process may bind it before the engine does, and the same port would fail forever);
  KV events use no port: they go over Unix sockets in a directory made mode 0700 and checked to be this
  user's own before each start and restart (:func:`make_private_dir`, :func:`agent.launch.kv_socket_paths`);
- the engine is spawned with :func:`asyncio.create_subprocess_exec`, stdout+stderr appended to
  ``<state_dir>/logs/<id>.log`` (mode 0600), in its own session and process group: whenever the engine
  has ended (crashed, or stopped), what is left of its group (its workers) gets SIGTERM, then SIGKILL
  after ``stop_grace_s``, before the next start;
- engines die with the agent, even on SIGKILL of the agent: the child sets
  ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` (util-linux's ``setpriv --pdeathsig`` exec'd before the engine, so
  Python spawns with ``vfork`` and the agent's at-fork handlers, gRPC's among them, never run in the
  child; a ``preexec_fn`` without ``setpriv``: :func:`runtime.lifecycle.spawn_dying_with_parent`), so the
  kernel sends it SIGTERM when the thread that started it exits. Spawns happen on the event loop's
  thread: run the agent's loop on a thread that lives as long as the agent (the main thread);
- ready = ``GET <health_path>`` answers 200 (polled every ``probe_interval_s``; llama-server answers 503
  while loading); not ready within ``ready_timeout_s`` counts as a crash;
- while running, liveness probes every ``liveness_interval_s``; ``liveness_failures`` misses in a row make
  it ``unhealthy``, ``unhealthy_restart_s`` of that restarts it; an exit means ``restarting``, then a new
  start after the backoff delay;
- :meth:`~EngineSupervisor.drain` waits for the caller's in-flight count to reach 0 (or a timeout), then
  SIGTERM, then SIGKILL after ``stop_grace_s``; :meth:`~EngineSupervisor.aclose` stops without waiting.

Remote engines (``openai_compat``) are never started: readiness and liveness probe ``GET /v1/models`` on
the remote address, and there is nothing to restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shlex
import signal
import socket
import stat
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import BinaryIO

import aiohttp

from agent.config import AgentSection
from agent.errors import EngineNotReady, EngineStartError
from agent.launch import EngineLaunch, needs_side_port, render
from engines.config import EngineConfig, RestartPolicy
from runtime.lifecycle import spawn_dying_with_parent

log = logging.getLogger(__name__)


class EngineState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    RESTARTING = "restarting"
    DRAINING = "draining"
    STOPPED = "stopped"


_S = EngineState
#: Allowed state changes. ``stopped`` is where a supervisor begins and ends (it starts once).
TRANSITIONS: Mapping[EngineState, frozenset[EngineState]] = {
    _S.STOPPED: frozenset({_S.STARTING}),
    _S.STARTING: frozenset({_S.READY, _S.UNHEALTHY, _S.RESTARTING, _S.DRAINING, _S.STOPPED}),
    _S.READY: frozenset({_S.UNHEALTHY, _S.RESTARTING, _S.DRAINING, _S.STOPPED}),
    _S.UNHEALTHY: frozenset({_S.READY, _S.RESTARTING, _S.DRAINING, _S.STOPPED}),
    _S.RESTARTING: frozenset({_S.STARTING, _S.DRAINING, _S.STOPPED}),
    _S.DRAINING: frozenset({_S.STOPPED}),
}


class RestartBackoff:
    """Exponential restart delays (s): ``backoff_initial_s``, doubling up to ``backoff_max_s``; a run
    that stayed ready ``stable_after_s`` or longer starts the sequence again (the time spent loading the
    model does not count: an engine that loads for minutes, then crashes, keeps backing off)."""

    def __init__(self, policy: RestartPolicy) -> None:
        self._policy = policy
        self._next = policy.backoff_initial_s

    def delay_after(self, ready_s: float) -> float:
        """The delay before the next start, given how long (s) the process just ended had been ready (0:
        never)."""
        if ready_s >= self._policy.stable_after_s:
            self._next = self._policy.backoff_initial_s
        delay = self._next
        self._next = min(self._next * 2, self._policy.backoff_max_s)
        return delay


@dataclass(frozen=True, slots=True)
class EnginePorts:
    """The ports an engine runs on: HTTP, NIXL side channel or SGLang bootstrap (``None``: not needed).
    (KV events use Unix sockets, not ports: :func:`agent.launch.kv_socket_paths`.)"""

    port: int
    side: int | None = None


def free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports free on ``host`` now (bound together, then released: another process may
    still take one before the engine binds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks = [socket.socket(family, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def pick_ports(engine: EngineConfig) -> EnginePorts:
    """Concrete ports for ``engine``: its configured port, or free ones where it says 0."""
    host = "::" if ":" in engine.host else "0.0.0.0"  # free on the wildcard = free on every address
    wanted = (engine.port == 0) + needs_side_port(engine)
    free = iter(free_ports(host, wanted))
    port = engine.port or next(free)
    return EnginePorts(port, next(free) if needs_side_port(engine) else None)


OnChange = Callable[["EngineSupervisor", EngineState, EngineState], None]
InFlight = Callable[[], Awaitable[int]]
Renderer = Callable[[EngineConfig, AgentSection, EnginePorts], EngineLaunch]


def render_ports(engine: EngineConfig, agent: AgentSection, ports: EnginePorts) -> EngineLaunch:
    """The default renderer: :func:`agent.launch.render` on picked ports."""
    return render(engine, agent, port=ports.port, side_port=ports.side)


_SECRET = re.compile(r"(key|token|secret|password)(?![a-z])", re.IGNORECASE)


def _redacted(argv: tuple[str, ...]) -> list[str]:
    """``argv`` with the values of secret-looking flags (``--api-key X``, ``--token=X``) masked, for logs."""
    out: list[str] = []
    for arg in argv:
        flag, eq, _ = arg.partition("=")
        if eq and flag.startswith("-") and _SECRET.search(flag):
            arg = f"{flag}=***"
        elif out and out[-1].startswith("-") and _SECRET.search(out[-1]) and "=" not in out[-1]:
            arg = "***"
        out.append(arg)
    return out


def _open_private_log(path: Path) -> BinaryIO:
    """``path`` opened for appending, mode 0600 (made so if it already existed): an engine's log may hold
    what its debug level prints, credentials among them, so it is this user's only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise


def _group_alive(pgid: int) -> bool:
    """Whether a live process (zombies waiting for a reaper do not count) is in process group ``pgid``."""
    try:
        entries = os.listdir("/proc")
    except OSError:  # pragma: no cover - no procfs: ask the kernel (zombies count)
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 2 and fields[2] == str(pgid).encode() and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _makedirs(paths: tuple[str, ...]) -> None:
    for path in paths:
        Path(path).mkdir(parents=True, exist_ok=True)


def _make_private_dirs(paths: tuple[str, ...]) -> None:
    for path in paths:
        make_private_dir(path)


def make_private_dir(path: str) -> None:
    """Make ``path`` a directory only this user can enter: created mode 0700 (its parents as usual), or,
    when it exists, checked to be a directory (not a symlink) this user owns and set to 0700. ``OSError``
    naming the path when it is someone else's or not a directory: what it would hold (sockets carrying
    prompts) must not be reachable by another user."""
    directory = Path(path)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    st = directory.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{path} is not a directory (a symlink or a file): refusing it for private sockets")
    if st.st_uid != os.geteuid():
        raise OSError(f"{path} belongs to uid {st.st_uid}, not this user: refusing it for private sockets")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(directory, 0o700)


class EngineSupervisor:
    """Runs and watches one engine; see the module docstring. ``on_change(supervisor, old, new)`` is called
    on every state change (exceptions are logged, not raised). ``renderer`` is the seam tests use to run a
    stand-in engine. Intervals and timeouts are seconds."""

    def __init__(
        self,
        engine: EngineConfig,
        agent: AgentSection,
        *,
        on_change: OnChange | None = None,
        renderer: Renderer = render_ports,
        probe_interval_s: float = 0.05,
        probe_timeout_s: float = 2.0,
        liveness_interval_s: float = 1.0,
        liveness_failures: int = 3,
        unhealthy_restart_s: float = 30.0,
        stop_grace_s: float = 10.0,
        drain_poll_s: float = 0.1,
    ) -> None:
        self.engine, self.agent = engine, agent
        self._on_change, self._renderer = on_change, renderer
        self.probe_interval_s, self.probe_timeout_s = probe_interval_s, probe_timeout_s
        self.liveness_interval_s, self.liveness_failures = liveness_interval_s, liveness_failures
        self.unhealthy_restart_s, self.stop_grace_s = unhealthy_restart_s, stop_grace_s
        self.drain_poll_s = drain_poll_s
        self.log_path = Path(agent.state_dir, "logs", f"{engine.id}.log")
        self.ports: EnginePorts | None = None
        self._ever_ready = False
        self.launch: EngineLaunch | None = None
        self.restarts = 0
        self.last_exit_code: int | None = None
        self._state = EngineState.STOPPED
        self._changed = asyncio.Event()
        self._backoff = RestartBackoff(engine.restart)
        self._proc: asyncio.subprocess.Process | None = None
        #: The spawned engine's process group, until :meth:`_stop_group` has stopped it.
        self._pgid: int | None = None
        self._exit: asyncio.Task[int] | None = None
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._headers: dict[str, str] = {}
        self._began = False
        self._closing = False

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def pid(self) -> int | None:
        """The engine process's pid while it runs."""
        proc = self._proc
        return None if proc is None or proc.returncode is not None else proc.pid

    async def start(self) -> None:
        """Pick ports, render, prepare (directories, model export) and spawn; returns once the process is
        running (see :meth:`wait_ready`). Raises :class:`~agent.errors.EngineStartError` when it cannot."""
        if self._began:
            raise RuntimeError(f"engine {self.engine.id}: a supervisor starts once")
        self._began = True
        self._set(EngineState.STARTING)
        try:
            await self._prepare()
            if self.engine.started:
                await self._spawn()
        except BaseException:
            await self._shutdown()
            raise
        self._task = asyncio.create_task(self._run(), name=f"engine-{self.engine.id}")

    async def wait_for(self, *states: EngineState, timeout_s: float | None = None) -> EngineState:
        """Wait until the state is one of ``states`` (``TimeoutError`` after ``timeout_s``)."""

        async def reached() -> EngineState:
            while self._state not in states:
                await self._changed.wait()
            return self._state

        return await asyncio.wait_for(reached(), timeout_s)

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until ready; :class:`~agent.errors.EngineNotReady` (with the log tail) if the engine is
        stopped first or ``timeout_s`` passes. Restarts before that are waited through."""
        try:
            state = await self.wait_for(EngineState.READY, EngineState.STOPPED, timeout_s=timeout_s)
        except TimeoutError:
            tail = self.log_tail()
            raise EngineNotReady(self.engine.id, f"not ready after {timeout_s}s\n{tail}") from None
        if state is EngineState.STOPPED:
            raise EngineNotReady(self.engine.id, f"stopped before it was ready\n{self.log_tail()}")

    async def drain(self, in_flight: InFlight, timeout_s: float) -> int:
        """Stop taking part (the caller deregistered it first): wait until ``in_flight()`` (the engine's
        running + waiting requests) is 0 or ``timeout_s`` passed, then stop the engine. Returns the last
        count seen (0: drained; -1: ``in_flight`` kept failing)."""
        if self._state is EngineState.STOPPED:
            return 0
        self._closing = True
        self._set(EngineState.DRAINING)
        loop = asyncio.get_running_loop()
        deadline, left = loop.time() + timeout_s, -1
        while True:
            if self.engine.started and self.pid is None:
                left = 0  # nothing left to serve them
                break
            try:
                left = await in_flight()
            except Exception as exc:
                log.warning("engine %s: in-flight count unavailable while draining: %s", self.engine.id, exc)
                left = -1
            if left == 0 or loop.time() >= deadline:
                break
            await asyncio.sleep(self.drain_poll_s)
        log.info("engine %s drained (%d in flight at stop)", self.engine.id, left)
        await self._shutdown()
        return left

    async def aclose(self) -> None:
        """Stop now (SIGTERM, SIGKILL after the grace period); idempotent."""
        if self._began:
            await self._shutdown()

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the engine's log (for error messages)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # -- shell ------------------------------------------------------------------------------------------

    def _set(self, new: EngineState) -> None:
        old = self._state
        if old is new or (self._closing and new not in (EngineState.DRAINING, EngineState.STOPPED)):
            return  # nothing new, or a late report from the run loop after draining or stopping began
        if new not in TRANSITIONS[old]:
            raise RuntimeError(f"engine {self.engine.id}: invalid transition {old} -> {new}")
        self._state = new
        log.info("engine %s: %s -> %s", self.engine.id, old, new)
        self._changed.set()
        self._changed = asyncio.Event()
        if self._on_change is not None:
            try:
                self._on_change(self, old, new)
            except Exception:
                log.exception("engine %s: on_change callback failed", self.engine.id)

    async def _prepare(self) -> None:
        engine = self.engine
        self.ports = pick_ports(engine) if engine.started else EnginePorts(0)
        launch = self.launch = self._renderer(engine, self.agent, self.ports)
        if engine.api_key_env:
            key = os.environ.get(engine.api_key_env)
            if not key:
                raise EngineStartError(engine.id, f"environment variable {engine.api_key_env} is not set")
            self._headers = {"Authorization": f"Bearer {key}"}
        try:
            await asyncio.to_thread(_makedirs, (*launch.makedirs, str(self.log_path.parent)))
            if launch.export is not None:
                from engines.gguf import ensure_model_dir

                export = launch.export
                await asyncio.to_thread(ensure_model_dir, export.gguf, export.cache_root)
        except (OSError, ValueError) as exc:
            raise EngineStartError(engine.id, f"cannot prepare: {exc}") from exc
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout_s)
        connector = aiohttp.TCPConnector(force_close=True)  # no stale keep-alive across engine restarts
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)

    async def _spawn(self) -> None:
        assert self.launch is not None
        argv = self.launch.argv
        try:  # before every start: a directory removed or loosened meanwhile is made private again
            await asyncio.to_thread(_make_private_dirs, self.launch.private_dirs)
        except OSError as exc:
            raise EngineStartError(self.engine.id, f"cannot prepare: {exc}") from exc
        env = {**os.environ, **dict(self.launch.env), **dict(self.engine.env)}
        with _open_private_log(self.log_path) as out:
            out.write(f"--- kvgate agent {time.strftime('%FT%T')}: {shlex.join(_redacted(argv))}\n".encode())
            out.flush()
            try:
                spawn = spawn_dying_with_parent(argv, env, self.agent.state_dir)
                proc = await asyncio.create_subprocess_exec(
                    *spawn.argv, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                    stderr=asyncio.subprocess.STDOUT, env=env, cwd=self.agent.state_dir,
                    start_new_session=True, preexec_fn=spawn.preexec_fn,
                )  # fmt: skip
            except OSError as exc:
                raise EngineStartError(self.engine.id, f"cannot execute {argv[0]!r}: {exc}") from exc
        self._proc, self._pgid = proc, proc.pid  # its own session: process group id = its pid
        self._exit = asyncio.create_task(proc.wait())
        log.info("engine %s: started pid %d, log %s", self.engine.id, proc.pid, self.log_path)

    async def _run(self) -> None:
        try:
            if not self.engine.started:
                await self._run_remote()
                return
            loop = asyncio.get_running_loop()
            while not self._closing:
                ready_s = 0.0  # how long this run was ready
                if self._proc is not None:
                    if await self._until_ready(loop.time() + self.engine.ready_timeout_s):
                        self._ever_ready = True
                        self._set(EngineState.READY)
                        ready_at = loop.time()
                        await self._watch()
                        ready_s = loop.time() - ready_at
                    if self._closing:
                        return
                    await self._terminate()
                delay = self._backoff.delay_after(ready_s)
                self.restarts += 1
                self._set(EngineState.RESTARTING)
                code = self.last_exit_code
                log.warning("engine %s: exit %s; restart in %.2fs", self.engine.id, code, delay)
                await asyncio.sleep(delay)
                if self._closing:
                    return
                self._set(EngineState.STARTING)
                if not self._ever_ready:  # never registered: nothing holds its address yet
                    self.ports = pick_ports(self.engine)
                    self.launch = self._renderer(self.engine, self.agent, self.ports)
                try:
                    await self._spawn()
                except EngineStartError as exc:
                    log.error("%s", exc)
                    self._proc, self._exit = None, None
        except Exception:
            log.exception("engine %s: supervisor failed", self.engine.id)

    async def _run_remote(self) -> None:
        assert self.launch is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.engine.ready_timeout_s
        while not await self._probe(self.launch.health_url):
            if loop.time() >= deadline:
                self._set(EngineState.UNHEALTHY)  # keeps probing: it turns ready when the remote answers
            await asyncio.sleep(self.probe_interval_s)
        self._set(EngineState.READY)
        await self._watch()

    async def _until_ready(self, deadline: float) -> bool:
        """Poll health until 200 (True), or the process exits / the deadline passes (False)."""
        assert self.launch is not None
        loop = asyncio.get_running_loop()
        while True:
            if await self._probe(self.launch.health_url):
                return True
            if await self._exited_within(self.probe_interval_s):
                return False
            if loop.time() >= deadline:
                log.warning("engine %s: not ready after %.0fs", self.engine.id, self.engine.ready_timeout_s)
                return False

    async def _watch(self) -> None:
        """Liveness while running; returns when the process exits or stayed unhealthy too long."""
        assert self.launch is not None
        loop = asyncio.get_running_loop()
        failures, unhealthy_since = 0, None
        while not await self._exited_within(self.liveness_interval_s):
            if await self._probe(self.launch.health_url):
                failures, unhealthy_since = 0, None
                if self._state is EngineState.UNHEALTHY:
                    self._set(EngineState.READY)
                continue
            failures += 1
            if failures >= self.liveness_failures and unhealthy_since is None:
                unhealthy_since = loop.time()
                self._set(EngineState.UNHEALTHY)
            limit = self.unhealthy_restart_s
            too_long = unhealthy_since is not None and loop.time() - unhealthy_since >= limit
            if too_long and self.engine.started:
                log.warning("engine %s: unhealthy too long; restarting", self.engine.id)
                return

    async def _exited_within(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True as soon as the process exits (never for remote engines)."""
        if self._exit is None:
            await asyncio.sleep(seconds)
            return False
        done, _ = await asyncio.wait({self._exit}, timeout=seconds)
        return bool(done)

    async def _probe(self, url: str) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(url, headers=self._headers, allow_redirects=False) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def _terminate(self) -> None:
        """SIGTERM the engine, SIGKILL its process group after the grace period, and reap it; then stop
        what is left of its process group (its workers), however the engine ended."""
        proc, exited = self._proc, self._exit
        if proc is None or exited is None:
            return
        if proc.returncode is None:
            try:
                proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(asyncio.shield(exited), self.stop_grace_s)
            except ProcessLookupError:
                pass
            except TimeoutError:
                log.warning("engine %s: alive %gs after SIGTERM; SIGKILL", self.engine.id, self.stop_grace_s)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # its own group (start_new_session), not yet reaped
        self.last_exit_code = await exited
        await self._stop_group()

    async def _stop_group(self) -> None:
        """SIGTERM the engine's process group (its workers: vLLM's and SGLang's hold GPU memory and ports
        that the next start needs), SIGKILL after the grace period what is left, and wait (another grace
        period at most) until it is gone. Once per spawn (done, it forgets the group: its id could be
        another group's after it emptied); a cancelled stop is done again by the next call."""
        pgid = self._pgid
        if pgid is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):  # none left (or the id is another user's now)
                break
            if await self._group_gone(pgid, self.stop_grace_s):
                break
            name = "SIGTERM; SIGKILL" if sig is signal.SIGTERM else "SIGKILL"
            log.warning("engine %s: workers alive %gs after %s", self.engine.id, self.stop_grace_s, name)
        self._pgid = None

    async def _group_gone(self, pgid: int, within_s: float) -> bool:
        """Whether process group ``pgid`` empties within ``within_s`` (polled: its members are not our
        children, there is nothing to wait on)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while await asyncio.to_thread(_group_alive, pgid):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(self.probe_interval_s)
        return True

    async def _shutdown(self) -> None:
        self._closing = True
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self._terminate()
        self._proc = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._set(EngineState.STOPPED)
