"""Traces (OpenTelemetry, exported over OTLP/gRPC): each daemon's tracer (:mod:`runtime.tracing.tracer`)
and the HTTP server middleware of the agent's admin API (:mod:`runtime.tracing.http`). The config section
and the pure phase timeline are :mod:`contracts.tracing`; README.md says what is traced and how."""
