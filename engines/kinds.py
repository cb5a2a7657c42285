"""The engine kinds kvgate fronts, and the roles an engine plays (prefill/decode disaggregation)."""

from __future__ import annotations

ENGINE_KINDS = ("vllm", "sglang", "trtllm", "llama_cpp", "openai_compat", "sim")
ROLES = ("both", "prefill", "decode")
