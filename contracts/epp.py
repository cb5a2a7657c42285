"""The names Envoy and the ext_proc agree on: the Endpoint Picker Protocol v1 (DESIGN.md contract 4,
REFERENCE.md section 3) and kvgate's own headers and metadata on that hop.

The processor (:mod:`extproc.processor`) reads and writes them; the Envoy config (:mod:`kvgate.envoy`)
routes on them, strips the ones a client must never set, and forwards the metadata the processor reads.
"""

from __future__ import annotations

# -- Endpoint Picker Protocol v1 ------------------------------------------------------------------------

DESTINATION = "x-gateway-destination-endpoint"
"""Header and ``envoy.lb`` metadata key: the pick then its fallbacks, ``ip:port,ip:port``."""
SERVED = "x-gateway-destination-endpoint-served"
"""``envoy.lb`` metadata key on the response path: where Envoy really sent the request."""
LB_NS = "envoy.lb"
"""Dynamic metadata namespace of the decision."""
SUBSET_NS = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
"""Metadata (namespace, key) of the subset hint: the ``ip:port`` addresses the gateway allows."""
MODEL_REWRITE = "x-gateway-model-name-rewrite"
"""Request header: serve the request under this model name."""
CONFORMANCE_HEADER = "test-epp-endpoint-selection"
CONFORMANCE_SERVED = "x-conformance-test-served-endpoint"
"""The conformance suite's pinned selection (request) and served echo (response) headers."""
MAX_CHUNK = 62_000
"""Largest body chunk streamed back to Envoy (bytes)."""

# -- kvgate's own -----------------------------------------------------------------------------------------

PRIMARY = "x-kvgate-destination-primary"
"""``envoy.lb`` metadata key: the pick alone (plain Envoy's ORIGINAL_DST cluster takes exactly one
``ip:port``)."""
UPSTREAM_HEADER = "x-kvgate-upstream-host"
"""Set by the bundled Envoy route from ``%UPSTREAM_HOST%``; removed before the client sees the response."""
REJECTED_NS = "kvgate"
REJECTED_KEY = "rejected"
"""Dynamic metadata sent with every immediate response, so the bundled Envoy config passes its OpenAI
JSON body through instead of re-wrapping it as one of Envoy's own errors."""
TENANT_HEADER = "x-kvgate-tenant"
"""Set by the processor on the upstream request (overwriting any client value; Envoy also strips it from
clients) so Envoy's local_ratelimit can key its buckets by tenant and engines can see it."""
JWT_NS = "envoy.filters.http.jwt_authn"
JWT_PAYLOAD = "jwt_payload"
JWT_STATUS = "jwt_status"
"""Dynamic metadata namespace of Envoy's jwt_authn filter, and the keys kvgate's config gives it (the
verified claims, or why verification failed)."""
