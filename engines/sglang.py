"""SGLang (``python -m sglang.launch_server``): HiCache offload, prefill/decode over NIXL, KV events over ZMQ.

Where each flag family comes from (read there, not copied):

- ``sglang.launch_server`` flags, HiCache (``--enable-hierarchical-cache``, ``--hicache-ratio``/
  ``--hicache-size`` (GB per rank), ``--hicache-write-policy``, ``--hicache-storage-backend``):
  https://docs.sglang.io/advanced_features/hicache_best_practices.html
- PD (``--disaggregation-mode``, ``--disaggregation-transfer-backend nixl``,
  ``--disaggregation-bootstrap-port`` on prefill servers, ``--disaggregation-decode-enable-offload-kvcache``,
  which needs a storage backend): https://docs.sglang.io/advanced_features/pd_disaggregation.html
- ``--kv-events-config`` (same keys as vLLM minus ``enable_kv_cache_events``, the same bind/connect rule:
  ``ipc://`` and wildcard PUB endpoints bind, others connect; the replay ROUTER binds):
  https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/disaggregation/kv_events.py
"""

from __future__ import annotations

import sys

from engines.config import EngineConfig
from engines.kind import GIB, EngineKind, RenderContext, Rendered, option
from engines.metrics import MetricNames


def needs_side_port(engine: EngineConfig) -> bool:
    """A prefill server runs the PD bootstrap server decode servers connect to."""
    return engine.role == "prefill"


def render(ctx: RenderContext) -> Rendered:
    e, off = ctx.engine, ctx.engine.offload
    program = e.command or (sys.executable, "-m", "sglang.launch_server")
    argv = [*program, *ctx.common(model_flag="--model-path")]
    argv += ["--served-model-name", e.model, "--page-size", str(e.block_size)]
    argv += option("--max-running-requests", e.parallel) + option("--context-length", e.context)
    if e.lora_modules:
        argv += ["--enable-lora", "--lora-paths", *(f"{n}={p}" for n, p in e.lora_modules)]
        argv += option("--max-loras-per-batch", e.max_loras)
    if e.metrics:
        argv.append("--enable-metrics")
    if ctx.events_endpoint is not None:
        argv += ["--kv-events-config", ctx.events_config(vllm_keys=False)]
    if e.role != "both":
        argv += ["--disaggregation-mode", e.role, "--disaggregation-transfer-backend", "nixl"]
        if e.role == "prefill":
            argv += ["--disaggregation-bootstrap-port", str(ctx.side_port)]
    env: dict[str, str] = {}
    if e.kv_offload == "hicache":
        if e.role == "decode":  # async offload of decoded KV into L3 (the prefill side reads it back)
            argv.append("--disaggregation-decode-enable-offload-kvcache")
        else:
            argv.append("--enable-hierarchical-cache")
        argv += option("--hicache-ratio", off.ratio)
        argv += option("--hicache-size", None if off.cpu_bytes is None else -(-off.cpu_bytes // GIB))
        argv += option("--hicache-write-policy", off.write_policy)
        argv += option("--hicache-storage-backend", off.storage_backend)
        if off.storage_backend == "file":
            env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = off.disk_path or ctx.state("offload", e.id)
    return ctx.rendered(argv, env)


KIND = EngineKind(
    name="sglang",
    metrics=MetricNames(
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang:token_usage",
        "sglang:time_to_first_token_seconds",
        "sglang:generation_tokens_total",
        lora_slots=("sglang:lora_pool_slots_used", "sglang:lora_pool_slots_total"),
    ),
    health_path="/health",
    metrics_path="/metrics",
    kv_events=True,
    offloads={"both": ("none", "hicache"), "prefill": ("nixl", "hicache"), "decode": ("nixl", "hicache")},
    render=render,
    side_port=needs_side_port,
)
