"""Engines: what kvgate knows of the engines it fronts.

The engine kinds and roles (:mod:`engines.kinds`), the endpoint record an agent registers for a running
replica (:mod:`engines.endpoint`), the metrics engines export for routing (:mod:`engines.metrics`) and the
model files they serve (:mod:`engines.gguf`). Pure but for the GGUF export; builds on :mod:`contracts`.
"""
