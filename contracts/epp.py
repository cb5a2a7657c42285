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
EXTPROC_ATTRIBUTES = "envoy.filters.http.ext_proc"
SOURCE_ADDRESS = "source.address"
"""Key of the request attributes Envoy's ext_proc filter sends with the request headers (its
``request_attributes``), and the attribute kvgate asks for under auth: the client's ``ip:port`` as Envoy
saw it (after ``xff_num_trusted_hops``), which failed-authentication limits are keyed on."""
DECISION_NS = "kvgate.decision"
"""Dynamic metadata namespace the processor fills with each routing decision, for Envoy's access log
(never routed on). Keys below; values are the model, endpoint id and plain numbers, never prompt
content."""
DECISION_MODEL = "model"
"""The model the request was routed for (after any ``x-gateway-model-name-rewrite``)."""
DECISION_TENANT = "tenant"
"""The tenant the request was admitted for (``[auth]`` only): the access log's ``tenant``. Not the
``x-kvgate-tenant`` header: a burst route removes it before the hosted endpoint, and Envoy's access log
sees request headers as the route left them."""
DECISION_ENDPOINT = "endpoint"
"""The picked endpoint's id (its ``ip:port`` is in ``envoy.lb``; Envoy logs where it really went)."""
DECISION_MATCHED = "matched_blocks"
"""Leading prompt blocks the pick was known to hold."""
DECISION_BLOCKS = "prompt_blocks"
"""Full blocks of the prompt looked up in the index (at most the index's ``max_match_blocks``)."""
DECISION_US = "decision_us"
"""Microseconds the decision took: tokenizing, hashing, index lookup, admission and scheduling."""
DECISION_MATCHED_TOKENS = "matched_tokens"
"""Prompt tokens the pick was predicted to hold: matched blocks x the index's block size at the decision
(the drift alarm compares it with what the engine reports it reused, :mod:`extproc.drift`)."""
USAGE_NS = "kvgate.usage"
USAGE_CACHED = "cached_tokens"
"""Dynamic metadata namespace and key Envoy's ``json_to_metadata`` filter fills from a JSON response's
``usage.prompt_tokens_details.cached_tokens`` (the prompt tokens the engine reused); the completion log
carries it to the ext_procs (:func:`kvgate.envoy.usage.usage_filter`)."""
USAGE_RESPONSE_ID = "response_id"
"""Key (in :data:`USAGE_NS`) Envoy's ``json_to_metadata`` fills with a JSON response's top-level ``id``; for a
Responses API request the completion log carries it to the ext_procs, which learn which endpoint produced
that response (:mod:`extproc.affinity`)."""
DECISION_RESPONSES_SCOPE = "responses_scope"
"""A Responses API request's affinity scope (its tenant's, or the open gateway's: :mod:`extproc.affinity`);
present only on such requests, so only their response ids are learned."""
DECISION_CASCADE_STEP = "cascade_step"
"""A cascade's escalated request (:mod:`extproc.cascade`): the 1-based step it was routed as; the bundled
Envoy route copies it into the response header :data:`CASCADE_STEP_HEADER`."""
CASCADE_STEP_HEADER = "x-kvgate-cascade-step"
"""Response header: which step of a cascade (1-based) answered a request for a virtual model; set by the
ext_proc on an answer it returns itself, by Envoy (from ``kvgate.decision``) on an escalated one."""
ANSWERED_KEY = "answered"
"""Key in the ``kvgate`` dynamic metadata namespace of an immediate response that is an answer, not an
error (a cascade step's): its content type's short name (``json`` or ``sse``), so the bundled Envoy
config passes its body through with that type."""
ENDPOINT_HEADER = "x-kvgate-endpoint"
"""Response header: ``ip:port`` of the engine that served the request, set by Envoy from
``%UPSTREAM_HOST%`` (overwriting any copy; off with ``EnvoyParams.endpoint_header``)."""
EXTPROC_CLUSTER = "kvgate_extproc"
"""The bundled Envoy's cluster of ext_proc replicas (ext_proc streams, EDS, health checks)."""
ENGINES_CLUSTER = "kvgate_engines"
"""The bundled Envoy's engine cluster: EDS served by the ext_proc replicas (every endpoint they may pick)."""
FAILURE_LOG_NAME = "kvgate-upstream-failures"
"""Log name of the gRPC access-log entries Envoy sends the ext_procs, one per failed upstream try."""
MODEL_HEADER = "x-kvgate-model"
"""Request header the processor sets to the decision's model (overwriting; Envoy strips clients' copies):
the bundled Envoy config routes on it to the model's own stream idle timeout, and removes it upstream."""
COMPLETION_LOG_NAME = "kvgate-completions"
"""Log name of the gRPC access-log entries Envoy sends the ext_procs, one per request the ext_proc routed
(``kvgate.decision`` metadata present), after its response is complete: the completion signal."""
MIGRATE_UPSTREAMS_HEADER = "x-kvgate-migrate-upstreams"
"""Request header Envoy writes on an opted-in model's route to the migration proxy (extproc/migration) from
the decision's ``envoy.lb`` list: the hosts the proxy may use, pick first (clients' copies stripped)."""
MIGRATION_LIMIT_HEADER = "x-kvgate-migration-limit"
"""Request header Envoy writes on that route: the model's ``migration_limit`` (clients' copies stripped)."""
TTFT_DEADLINE_UPSTREAM = "x-kvgate-ttft-deadline-ms"
"""Request header the processor sets on a routed request with a TTFT deadline (extproc/flow): the milliseconds
left of it when it leaves the gateway. Only the gateway states it: Envoy strips clients' copies."""
