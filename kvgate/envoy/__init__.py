"""Envoy's side of kvgate: the bootstrap config (listeners, the ext_proc filter, clusters), its TLS
profile (SDS files) and its edge auth (jwt_authn, local rate limits)."""
