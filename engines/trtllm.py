"""TensorRT-LLM (``trtllm-serve``): aggregated serving only, no offload, no ZMQ KV events.

``trtllm-serve MODEL --host --port --backend --max_batch_size --max_seq_len``, health ``/health``,
Prometheus at ``/prometheus/metrics``: https://nvidia.github.io/TensorRT-LLM/latest/commands/trtllm-serve.html
and https://nvidia.github.io/TensorRT-LLM/latest/examples/prometheus_metrics.html .

Only ``none`` x ``both``: its KV offload (``kv_cache_config.host_cache_size``), KV transfer
(``cache_transceiver_config``) and KV events (``event_buffer_max_size``, polled over HTTP, not ZMQ) are
YAML options (``--extra_llm_api_options``), and prefill/decode needs its own ``trtllm-serve disaggregated``
orchestrator between the two servers, which a per-node agent cannot stand in for.
"""

from __future__ import annotations

from engines.kind import EngineKind, RenderContext, Rendered, option
from engines.metrics import MetricNames


def render(ctx: RenderContext) -> Rendered:
    e = ctx.engine
    argv = [*(e.command or ("trtllm-serve",)), *ctx.common(model_flag=None), "--backend", "pytorch"]
    if e.model != e.model_path:  # older trtllm-serve lacks the flag; only pass it when it matters
        argv += ["--served_model_name", e.model]
    argv += option("--max_batch_size", e.parallel) + option("--max_seq_len", e.context)
    return ctx.rendered(argv, {})


KIND = EngineKind(
    name="trtllm",
    metrics=MetricNames(
        "trtllm_num_requests_waiting", "trtllm_num_requests_running", "trtllm_kv_cache_utilization"
    ),
    health_path="/health",
    metrics_path="/prometheus/metrics",
    kv_events=False,
    offloads={"both": ("none",)},
    render=render,
)
