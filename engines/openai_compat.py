"""An OpenAI-compatible API run by someone else: remote only (never started), ready when ``GET /v1/models``
answers 200, metrics off unless the config turns them on (then read with vLLM's names)."""

from __future__ import annotations

from engines.kind import EngineKind
from engines.vllm import METRICS as VLLM_METRICS

KIND = EngineKind(
    name="openai_compat",
    metrics=VLLM_METRICS,
    health_path="/v1/models",
    metrics_path="/metrics",
    kv_events=False,
    offloads={"both": ("none",)},
    render=None,
)
