"""kvgate node agent: engine supervision, etcd registration, KV events -> index events, telemetry."""
