"""What the ext_proc serves Envoy besides decisions: the engine cluster's endpoints (EDS), the failed
tries Envoy reports (gRPC access logs), and the ejections they cause (formulas in README.md)."""
