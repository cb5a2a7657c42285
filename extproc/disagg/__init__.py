"""Prefill/decode disaggregation: a model's serving mode, the pair's prefill half, and the handoff bodies
(README.md: the formulas and the protocol)."""
