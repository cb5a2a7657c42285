"""How long one engine step takes: the simulator's only notion of GPU speed.

One step runs one forward pass over a batch made of one token for every sequence in decode plus up to
``max_num_batched_tokens`` uncached prompt tokens of sequences in prefill (chunked prefill)::

    step_s = time_scale * (base_s + decode_s_per_seq * n_decoding + prefill_s_per_token * n_prefill_tokens)

The defaults describe an 8B dense model in bf16 on one H100 (vLLM, CUDA graphs):

* ``base_s`` = 6 ms: reading ~16 GB of weights at ~3 TB/s plus launch overhead; the inter-token
  latency (ITL) of a lone sequence.
* ``decode_s_per_seq`` = 0.15 ms: per-sequence cost of a decode step (KV reads, sampling), so ITL is
  ~15.6 ms at 64 running sequences.
* ``prefill_s_per_token`` = 50 us (20,000 tokens/s): compute-bound prefill at ~30% of bf16 peak, so
  a cold 6,000-token prompt adds ~0.3 s to its time to first token and a cached one almost nothing.

Attention cost growing with context length is not modelled. ``time_scale`` stretches (>1) or shrinks
(<1) all of it; 0 makes every step instantaneous.

Prefill/decode disaggregation adds one more duration, the KV transfer from the prefill replica to the
decode replica, outside any step (the decode replica's GPU keeps stepping its other sequences)::

    transfer_s = time_scale * tokens * kv_bytes_per_token / link_bytes_per_s

* ``kv_bytes_per_token`` = 131,072 (128 KiB): K and V x 32 layers x 8 KV heads x 128 dims x 2 bytes,
  Llama-3.1-8B in bf16;
* ``link_bytes_per_s`` = 50e9: one 400 Gb/s RDMA NIC (NIXL over UCX), so 6,000 tokens take ~16 ms.

A LoRA adapter swapped into a GPU slot (:mod:`load.sim.lora`) adds, once, to the step that admits the
request needing it::

    step_s += time_scale * lora_load_s * adapters_loaded

* ``lora_load_s`` = 25 ms: a rank-16 adapter of an 8B model (all attention and MLP projections, ~84 MB
  in bf16) copied from host memory over PCIe Gen5 (~50 GB/s: ~2 ms) plus vLLM's per-adapter setup
  (building the LoRA layers' weight stacks); an adapter read from disk first costs more (set it higher).

On an aggregated replica a prefill shares steps with the decodes batched with it (the
``prefill_s_per_token x n_prefill_tokens`` term lengthens every decoding sequence's step: chunked-prefill
interference); a decode replica of a pair computes one prompt token per request instead.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TimingModel:
    """Step duration model; all durations in seconds before ``time_scale`` is applied."""

    base_s: float = 0.006
    decode_s_per_seq: float = 0.00015
    prefill_s_per_token: float = 1 / 20_000
    time_scale: float = 1.0
    kv_bytes_per_token: float = 131_072.0
    link_bytes_per_s: float = 50e9
    lora_load_s: float = 0.025

    def __post_init__(self) -> None:
        if self.link_bytes_per_s <= 0:
            raise ValueError("link_bytes_per_s must be > 0")
        for name in (
            "base_s",
            "decode_s_per_seq",
            "prefill_s_per_token",
            "time_scale",
            "kv_bytes_per_token",
            "lora_load_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    def step_s(self, n_decoding: int, n_prefill_tokens: int) -> float:
        """Seconds for a step decoding ``n_decoding`` sequences and prefilling ``n_prefill_tokens``."""
        raw = self.base_s + self.decode_s_per_seq * n_decoding + self.prefill_s_per_token * n_prefill_tokens
        return raw * self.time_scale

    def lora_s(self, loaded: int) -> float:
        """Seconds a step spends loading ``loaded`` LoRA adapters into GPU slots."""
        return self.time_scale * self.lora_load_s * loaded

    def transfer_s(self, tokens: int) -> float:
        """Seconds to move the KV of ``tokens`` prompt tokens from a prefill replica to a decode replica."""
        return self.time_scale * tokens * self.kv_bytes_per_token / self.link_bytes_per_s
