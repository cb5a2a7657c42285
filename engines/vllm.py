"""vLLM (``vllm serve``): every KV offload family, prefill/decode over NIXL, KV events over ZMQ.

Where each flag family comes from (read there, not copied):

- ``vllm serve`` flags and ``--kv-transfer-config``: NixlConnector with ``kv_role`` producer / consumer /
  both and ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT`` (one port per engine on a host):
  https://docs.vllm.ai/en/latest/features/nixl_connector_usage.html ; MultiConnector (ordered
  ``kv_connector_extra_config.connectors``): https://docs.vllm.ai/en/latest/features/disagg_prefill.html
- ``--kv-events-config`` keys (``enable_kv_cache_events``, ``publisher``, ``endpoint``,
  ``replay_endpoint``, ``topic``): https://docs.vllm.ai/en/latest/api/vllm/config/kv_events.html and
  ``ZmqEventPublisher`` in vllm/distributed/kv_events.py. The PUB socket binds only when the endpoint is
  ``ipc://``/``inproc://`` or holds a wildcard (``*``, ``::``: every interface), else it connects; the
  replay ROUTER always binds. The agent gives both ``ipc://`` endpoints in a directory of its own
  (:func:`agent.launch.kv_socket_paths`): the events carry prompt token ids, unauthenticated. (A data
  parallel rank > 0 offsets tcp ports only and refuses an ``ipc://`` endpoint; the agent follows one
  publisher per engine.)
- LMCache (``LMCacheConnectorV1``, ``LMCACHE_*`` environment):
  https://docs.lmcache.ai/api_reference/configurations.html and
  https://docs.nvidia.com/dynamo/latest/integrations/kv-cache-integrations/lm-cache
- KVBM (``DynamoConnector`` in ``kvbm.vllm_integration.connector``; Dynamo's ``PdConnector`` stacking it with
  NIXL on prefill workers; decode workers run NIXL alone; ``DYN_KVBM_*`` tier sizes):
  https://github.com/ai-dynamo/dynamo/blob/main/components/src/dynamo/vllm/args.py and
  https://docs.nvidia.com/dynamo/components/kvbm/kvbm-guide.md
"""

from __future__ import annotations

from typing import Any

from engines.config import EngineConfig
from engines.kind import EngineKind, RenderContext, Rendered, compact_json, gib, option
from engines.metrics import MetricNames

#: vLLM's load series; the simulator and OpenAI-compatible servers name theirs the same way.
METRICS = MetricNames(
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    lora_info="vllm:lora_requests_info",
)
#: Where KVBM's vLLM connectors live (DynamoConnector, PdConnector).
KVBM_MODULE = "kvbm.vllm_integration.connector"
_KV_ROLES = {"both": "kv_both", "prefill": "kv_producer", "decode": "kv_consumer"}


def needs_side_port(engine: EngineConfig) -> bool:
    """A NIXL connector (its handshake listener): ``kv_offload = "nixl"`` or any disaggregated role."""
    return engine.kv_offload == "nixl" or engine.role != "both"


def render(ctx: RenderContext) -> Rendered:
    e = ctx.engine
    argv = [*(e.command or ("vllm", "serve")), *ctx.common(model_flag=None)]
    argv += ["--served-model-name", e.model, "--block-size", str(e.block_size)]
    argv += option("--max-num-seqs", e.parallel) + option("--max-model-len", e.context)
    if e.lora_modules:
        argv += ["--enable-lora", "--lora-modules", *(f"{n}={p}" for n, p in e.lora_modules)]
        argv += option("--max-loras", e.max_loras)
    env: dict[str, str] = {}
    transfer = _transfer(e)
    if transfer is not None:
        argv += ["--kv-transfer-config", compact_json(transfer)]
    if ctx.side_port is not None and needs_side_port(e):
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = ctx.advertise
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(ctx.side_port)
    if ctx.events_endpoint is not None:
        argv += ["--enable-prefix-caching", "--kv-events-config", ctx.events_config(vllm_keys=True)]
    off = e.offload
    if e.kv_offload == "lmcache":
        if off.chunk_size is not None:
            env["LMCACHE_CHUNK_SIZE"] = str(off.chunk_size)
        if off.cpu_bytes is not None:
            env.update(LMCACHE_LOCAL_CPU="True", LMCACHE_MAX_LOCAL_CPU_SIZE=gib(off.cpu_bytes))
        if off.disk_bytes is not None:
            disk = off.disk_path or ctx.state("offload", e.id)
            env.update(LMCACHE_LOCAL_DISK=f"file://{disk}/", LMCACHE_MAX_LOCAL_DISK_SIZE=gib(off.disk_bytes))
    elif e.kv_offload == "kvbm":
        if off.cpu_bytes is not None:
            env["DYN_KVBM_CPU_CACHE_GB"] = gib(off.cpu_bytes)
        if off.disk_bytes is not None:
            env["DYN_KVBM_DISK_CACHE_GB"] = gib(off.disk_bytes)
            env["DYN_KVBM_DISK_CACHE_DIR"] = off.disk_path or ctx.state("offload", e.id)
    return ctx.rendered(argv, env)


def _transfer(e: EngineConfig) -> dict[str, Any] | None:
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


KIND = EngineKind(
    name="vllm",
    metrics=METRICS,
    health_path="/health",
    metrics_path="/metrics",
    kv_events=True,
    offloads={
        "both": ("none", "nixl", "lmcache", "kvbm"),
        "prefill": ("nixl", "lmcache", "kvbm"),
        "decode": ("nixl",),
    },
    render=render,
    side_port=needs_side_port,
)
