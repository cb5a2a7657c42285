"""The ext_proc as an upstream client of engines: one HTTP client for every sub-request the gateway sends
itself (README.md)."""
