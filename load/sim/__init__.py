"""A simulated vLLM replica: the stand-in for a GPU engine in end-to-end tests and benchmarks.

Pure cores: :mod:`load.sim.cache` (paged prefix cache), :mod:`load.sim.engine` (continuous batching),
:mod:`load.sim.timing` (step durations), the OpenAI/vLLM wire format (:mod:`load.sim.errors`,
:mod:`load.sim.fields`, :mod:`load.sim.protocol`, :mod:`load.sim.responses`) and :mod:`load.sim.output`
(what each choice says). IO shell: :mod:`load.sim.tokenizer` (transformers), :mod:`load.sim.driver`
(asyncio pump), :mod:`load.sim.metrics` (Prometheus), :mod:`load.sim.serving` (the generate routes) and
:mod:`load.sim.server` (``SimFleet``, ``main``). See README.md.
"""
