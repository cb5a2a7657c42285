"""The simulator (``python -m load.sim.server``): a simulated vLLM without a GPU, with vLLM's metric names
and KV events. Its flags: :func:`load.sim.server.build_parser` (vLLM-style, ``--kv-events-config``).

``model_path`` is a tokenizer directory, or a ``.gguf`` (or the ``smollm2`` alias) whose tokenizer is
exported once under ``<state_dir>/models`` before the start.
"""

from __future__ import annotations

import sys
from pathlib import Path

from engines.config import SMOLLM2
from engines.kind import EngineKind, ModelExport, RenderContext, Rendered, option
from engines.vllm import METRICS as VLLM_METRICS


def render(ctx: RenderContext) -> Rendered:
    e = ctx.engine
    assert e.model_path is not None
    if e.model_path == SMOLLM2 or e.model_path.endswith(".gguf"):
        gguf = ctx.gguf()
        ctx.export = ModelExport(Path(gguf), Path(ctx.state_dir, "models"))
        model_dir = str(ctx.export.model_dir)
    else:
        model_dir = e.model_path
    program = e.command or (sys.executable, "-m", "load.sim.server")
    argv = [*program, "--model", e.model, "--model-dir", model_dir, "--host", e.host, "--port", str(ctx.port)]
    argv += ["--replica-prefix", e.id, "--block-size", str(e.block_size)]
    argv += option("--max-num-seqs", e.parallel) + option("--max-model-len", e.context)
    if e.lora_modules:
        argv += ["--lora-modules", *(f"{n}={p}" for n, p in e.lora_modules)]
        argv += option("--max-loras", e.max_loras)
    if ctx.events_endpoint is not None:
        argv += ["--kv-events-config", ctx.events_config(vllm_keys=True)]
    if e.role != "both":  # vLLM's kv_transfer_params, both halves (load/sim/handoff.py)
        argv += ["--role", e.role]
    return ctx.rendered(argv, {})


KIND = EngineKind(
    name="sim",
    metrics=VLLM_METRICS,
    health_path="/health",
    metrics_path="/metrics",
    kv_events=True,
    offloads={"both": ("none",), "prefill": ("none",), "decode": ("none",)},
    render=render,
)
