"""The local stack for development and tests: ``kvgate up`` (Envoy + ext_proc + engines on one machine),
child processes, a local etcd, and the development identity (a dev OIDC issuer, tokens, API keys)."""
