"""Engine launches: from an engine's config (plus the ports the agent picked) to the command, environment
and probe URLs that run and watch it, and the endpoint record the agent registers for it.

The argv of each kind is its renderer's (:mod:`engines.kinds`, one module per kind with the sources of its
flags); here is what is the same for every kind: the combination check, the ports each kind needs, the
agent's own view of the engine (``base_url``) and the gateway's (``address``), the extra ``args``, and the
remote branch (an engine with an ``address`` is probed, scraped and followed, never started). Nothing is
started or written here; the supervisor creates ``EngineLaunch.makedirs`` (and ``private_dirs``, mode
0700) and runs ``EngineLaunch.export`` before spawning. This is also where the engines package's errors
become the agent's.

KV events of a started engine travel over Unix sockets, never TCP (:func:`kv_socket_paths`): its events
carry prompt token ids, and ZMQ's PUB socket has no authentication, so the engine publishes on
``ipc://<state_dir>/kv/kv-<hash>.sock`` (replay: ``kv-<hash>-replay.sock``), in a directory of mode 0700
owned by the agent, which subscribes there. ``<hash>``: 12 hex digits of the SHA-256 of the engine id. A
socket path holds at most :data:`UNIX_PATH_MAX` bytes: when ``<state_dir>/kv`` is too long for that, the
directory is ``/tmp/kvgate-kv-<uid>-<hash of state_dir>`` instead (made 0700; one there that is not this
user's own directory is refused at start). A remote engine's endpoints are the operator's
(``kv_events_endpoint``); tcp ones carry the events in plaintext, so keep them on a private network.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from agent.config import AgentSection
from agent.errors import AgentConfigError, EngineError
from contracts.errors import ConfigError
from contracts.events import EndpointId
from engines.config import EngineConfig
from engines.endpoint import Endpoint
from engines.errors import ArtifactNotFound
from engines.kind import KV_EVENTS_TOPIC, ModelExport, RenderContext, host_port, local_host
from engines.kinds import KINDS, check_combination
from engines.priority import priority_order

#: Metrics path of every remote engine, whatever its kind (a remote trtllm serves /prometheus/metrics:
#: set ``metrics = false`` for it; kept as it was so that existing configs behave the same).
REMOTE_METRICS_PATH = "/metrics"
#: Longest Unix socket path, in bytes: ``sockaddr_un.sun_path`` holds 108 with the terminating NUL.
UNIX_PATH_MAX = 107
#: Where the KV event sockets go when ``<state_dir>/kv`` is too long (:func:`kv_socket_dir`).
SHORT_SOCKET_ROOT = "/tmp"


@dataclass(frozen=True, slots=True)
class EngineLaunch:
    """How to run and watch one engine.

    ``argv`` is empty for remote engines (nothing is started). ``env`` is added to the agent's environment
    (the engine's own ``env`` table last). ``base_url`` is where the agent itself reaches the engine;
    ``address`` is the ``host:port`` the gateway proxies to (the node's advertised host). Health answers
    200 when ready; ``metrics_path`` is ``None`` when metrics are off. The KV events endpoints are the
    addresses of the agent's ZMQ SUB and replay sockets (``ipc://`` for a started engine, the configured
    ones for a remote engine), ``None`` when the engine does not publish (``speaks_kv_events``).
    ``side_port``: the NIXL side channel (vLLM) or the PD bootstrap port (SGLang prefill), else ``None``.
    ``private_dirs``: directories to make mode 0700 (and owned by the agent's user) before the start.
    """

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    base_url: str
    address: str
    health_path: str
    metrics_path: str | None
    speaks_kv_events: bool = False
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    kv_events_topic: str = KV_EVENTS_TOPIC
    side_port: int | None = None
    makedirs: tuple[str, ...] = ()
    private_dirs: tuple[str, ...] = ()
    export: ModelExport | None = None

    @property
    def health_url(self) -> str:
        return self.base_url + self.health_path

    @property
    def metrics_url(self) -> str | None:
        """The metrics URL as the agent reaches it (``None``: metrics off)."""
        return None if self.metrics_path is None else self.base_url + self.metrics_path

    @property
    def public_metrics_url(self) -> str | None:
        """The metrics URL as the gateway reaches it (through ``address``)."""
        if self.metrics_path is None:
            return None
        scheme = self.base_url.split("://", 1)[0]
        return f"{scheme}://{self.address}{self.metrics_path}"


def publishes_kv_events(engine: EngineConfig) -> bool:
    """Whether a started ``engine`` is told to publish KV events (on :func:`kv_socket_paths`): KV events
    on, of a kind that publishes them over ZMQ."""
    kind = KINDS.get(engine.kind)
    return engine.kv_events and kind is not None and kind.kv_events


def _hex12(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def kv_socket_dir(state_dir: str) -> str:
    """The directory of the KV event sockets of engines started with state directory ``state_dir``:
    ``<state_dir>/kv``, or a short one under :data:`SHORT_SOCKET_ROOT` when a socket path there would be
    over :data:`UNIX_PATH_MAX` bytes (see the module docstring)."""
    directory = str(Path(state_dir, "kv"))
    longest = f"{directory}/kv-{'0' * 12}-replay.sock"
    if len(longest.encode()) <= UNIX_PATH_MAX:
        return directory
    return f"{SHORT_SOCKET_ROOT}/kvgate-kv-{os.geteuid()}-{_hex12(state_dir)}"


def kv_socket_paths(state_dir: str, engine_id: str) -> tuple[str, str]:
    """The Unix socket paths (PUB, replay ROUTER) a started engine publishes its KV events on."""
    directory, name = kv_socket_dir(state_dir), f"kv-{_hex12(engine_id)}"
    return f"{directory}/{name}.sock", f"{directory}/{name}-replay.sock"


def needs_side_port(engine: EngineConfig) -> bool:
    """Whether :func:`render` needs ``side_port``, as the engine's kind says (vLLM with a NIXL connector:
    its handshake listener; SGLang prefill: the PD bootstrap server)."""
    kind = KINDS.get(engine.kind)
    return kind is not None and kind.side_port(engine)


def render(
    engine: EngineConfig,
    agent: AgentSection,
    *,
    port: int,
    side_port: int | None = None,
) -> EngineLaunch:
    """Render the launch of ``engine`` on ``port`` (already picked: not 0; ignored for remote engines),
    its KV events (where it publishes them) on :func:`kv_socket_paths` of ``agent.state_dir``.

    Raises :class:`~agent.errors.AgentConfigError` for a kind x role x kv_offload outside the matrix,
    ``ValueError`` when a port the engine needs is missing, :class:`~agent.errors.EngineError` when a
    local artifact (llama-server, the SmolLM2 GGUF) cannot be found.
    """
    try:
        check_combination(engine.kind, engine.role, engine.kv_offload, engine.id)
    except ConfigError as exc:
        raise AgentConfigError(str(exc)) from exc
    if not engine.started:
        return _remote(engine)
    if not 0 < port <= 65535:
        raise ValueError(f"engine {engine.id}: a concrete port is needed, got {port}")
    events = publishes_kv_events(engine)
    sockets = kv_socket_paths(agent.state_dir, engine.id) if events else None
    pub, replay = (f"ipc://{path}" for path in sockets) if sockets else (None, None)
    side = needs_side_port(engine)
    if side and side_port is None:
        raise ValueError(f"engine {engine.id}: {engine.kind} with role {engine.role} needs side_port")
    kind = KINDS[engine.kind]
    if kind.render is None:
        raise ValueError(f"engine {engine.id}: {engine.kind} is remote only; it needs an address")
    renderer = kind.render
    ctx = RenderContext(
        engine,
        port=port,
        advertise=agent.advertise,
        state_dir=agent.state_dir,
        kv_events_endpoint=pub,
        kv_replay_endpoint=replay,
        side_port=side_port,
    )
    try:
        rendered = renderer(ctx)
    except ArtifactNotFound as exc:
        raise EngineError(exc.subject, exc.detail) from exc
    local = local_host(engine.host)
    return EngineLaunch(
        argv=rendered.argv + engine.args,
        env=rendered.env,
        base_url=f"http://{host_port(local, port)}",
        address=host_port(agent.advertise, port),
        health_path=kind.health_path,
        metrics_path=kind.metrics_path if engine.metrics else None,
        speaks_kv_events=events,
        kv_events_endpoint=pub,
        kv_replay_endpoint=replay,
        side_port=side_port if side else None,
        makedirs=rendered.makedirs,
        private_dirs=(str(Path(sockets[0]).parent),) if sockets else (),
        export=rendered.export,
    )


def _remote(engine: EngineConfig) -> EngineLaunch:
    """A remote engine: nothing to run; probed at its kind's health path, scraped at
    :data:`REMOTE_METRICS_PATH`, its KV events followed where the config names their endpoints."""
    assert engine.address is not None
    scheme = "https" if engine.tls else "http"
    events = engine.kv_events and engine.kv_events_endpoint is not None
    return EngineLaunch(
        (),
        (),
        f"{scheme}://{engine.address}",
        engine.address,
        KINDS[engine.kind].health_path,
        REMOTE_METRICS_PATH if engine.metrics else None,
        speaks_kv_events=events,
        kv_events_endpoint=engine.kv_events_endpoint if events else None,
        kv_replay_endpoint=engine.kv_replay_endpoint if events else None,
        kv_events_topic=engine.kv_events_topic,
    )


def endpoint_for(engine: EngineConfig, launch: EngineLaunch, *, node: str, feed: str | None) -> Endpoint:
    """The registration record of a rendered engine (etcd ``endpoints/<id>``), ``feed`` being the
    ``host:port`` of this agent's index-event stream."""
    return Endpoint(
        id=EndpointId(engine.id),
        address=launch.address,
        models=frozenset({engine.model, *(name for name, _ in engine.lora_modules)}),
        adapters=frozenset(name for name, _ in engine.lora_modules),
        engine=engine.kind,
        metrics_url=launch.public_metrics_url,
        labels=engine.labels,
        role=engine.role,
        node=node,
        feed=feed,
        kv_events=launch.speaks_kv_events,
        block_size=engine.block_size,
        # An SGLang prefill server's side port is its PD bootstrap server (engines/sglang.py).
        bootstrap_port=launch.side_port if engine.kind == "sglang" and engine.role == "prefill" else None,
        # Read from the command line it runs with: what the engine does with a body's priority field.
        priority_order=priority_order(engine.kind, launch.argv),
    )
