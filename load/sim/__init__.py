"""A simulated vLLM replica: the stand-in for a GPU engine in end-to-end tests and benchmarks.

Pure cores: :mod:`load.sim.cache` (paged prefix cache), :mod:`load.sim.engine` (continuous batching),
:mod:`load.sim.timing` (step durations), :mod:`load.sim.protocol` (OpenAI/vLLM wire format). IO shell:
:mod:`load.sim.tokenizer` (transformers), :mod:`load.sim.driver` (asyncio pump), :mod:`load.sim.metrics`
(Prometheus) and :mod:`load.sim.server` (``SimFleet``, ``main``). See README.md.
"""
