"""Engines: what kvgate knows of the engines it fronts.

The engine kinds, one module each (:mod:`engines.vllm`, :mod:`engines.sglang`, ...), registered by name in
:mod:`engines.kinds` with the roles; what a kind is and how its argv is rendered (:mod:`engines.kind`); the
engine configuration the node agent parses (:mod:`engines.config`); the endpoint record an agent registers
for a running replica (:mod:`engines.endpoint`); the metrics engines export for routing
(:mod:`engines.metrics`) and the model files they serve (:mod:`engines.gguf`). Pure but for the GGUF
export; builds on :mod:`contracts`. The table of kinds and how to add one: engines/README.md.
"""
