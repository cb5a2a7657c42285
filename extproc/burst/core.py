"""Burst: hosted endpoints (``[[burst]]``), the rule that sends a request there, and its budget.

Pure: every method takes ``now`` (seconds, monotonic). The processor asks :meth:`Burster.pick` for a
request that flow control would not let go at once; Envoy sends it (``kvgate.envoy.burst``).
"""

from __future__ import annotations

import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field

from contracts.config import REQUIRED, Section
from contracts.errors import ConfigError

#: Request header the ext_proc sets to the burst endpoint's name; the bundled Envoy route matching it
#: sends the request to that endpoint's cluster (``kvgate_burst_<name>``). Stripped from clients.
BURST_HEADER = "x-kvgate-burst"
#: Envoy cluster of a burst endpoint.
CLUSTER_PREFIX = "kvgate_burst_"
#: Client credential headers the ext_proc removes from a burst request (Envoy removes them from every
#: request too, ``kvgate.envoy.bootstrap.CREDENTIAL_HEADERS``, and injects the upstream key).
CLIENT_CREDENTIALS = ("authorization", "proxy-authorization", "x-api-key", "api-key", "cookie")
#: Request kinds (``extproc.routing.request.Kind`` values) that may burst: a hosted OpenAI-compatible
#: endpoint serves them statelessly. Not ``responses`` (its id, and any later ``previous_response_id``,
#: would name a response only the hosted account holds), nor vLLM's ``score`` / ``rerank`` (not served).
BURST_KINDS = frozenset({"chat", "completion", "embedding"})
#: Body fields dropped from every burst request (README "What is sent"): they bill the gateway's account
#: (``service_tier``, ``priority``, ``web_search_options``), reach what is stored in it
#: (``conversation``, ``previous_response_id``, ``metadata`` (kept with stored completions)), or name or
#: steer the gateway's account per end user or cache (``user``, ``safety_identifier``, ``cache_salt``,
#: ``prompt_cache_key``).
DROPPED_FIELDS = frozenset(
    {
        "service_tier",
        "priority",
        "web_search_options",
        "conversation",
        "previous_response_id",
        "metadata",
        "user",
        "safety_identifier",
        "cache_salt",
        "prompt_cache_key",
    }
)
#: Dropped from a Responses API body besides: ``prompt`` is a reference to a prompt stored in the account
#: (in completions, ``prompt`` is the prompt itself and stays).
DROPPED_RESPONSES_FIELDS = frozenset({"prompt"})
#: Kinds whose API stores responses when ``store`` is true: forced to false.
STORE_KINDS = frozenset({"chat", "responses"})
#: Outcomes counted by ``kvgate_burst_requests_total{endpoint,outcome}``.
SENT, NO_BUDGET = "sent", "no_budget"

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_HOST = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


@dataclass(frozen=True, slots=True)
class BurstEndpoint:
    """A hosted OpenAI-compatible endpoint (``engine = "openai_compat"``, the only kind allowed).

    ``name`` names its Envoy cluster; ``host`` is its DNS name (resolved by Envoy, the TLS SNI, the
    certificate name verified and the ``Host`` sent); ``port`` its HTTPS port; ``models`` maps a local
    model name to the hosted one (the body's ``model`` is rewritten); ``api_key_file`` holds the key
    Envoy sends as ``Authorization: Bearer <key>`` (read by Envoy only, never by the ext_proc);
    ``ca_file`` the PEM bundle its certificate must chain to (``None``: the system bundle).
    """

    name: str
    host: str
    models: Mapping[str, str]
    api_key_file: str
    port: int = 443
    ca_file: str | None = None
    #: The gateway host's credential an etcd record named (:mod:`extproc.burst.records`); ``None``: a
    #: ``[[burst]]`` endpoint of the gateway config, with its own key file.
    credential: str | None = None

    @property
    def cluster(self) -> str:
        return CLUSTER_PREFIX + self.name

    @property
    def header_value(self) -> str:
        """What the ext_proc sets ``x-kvgate-burst`` to: a config endpoint's name (its own route), an etcd
        one's cluster (the route that takes the cluster from the header, for clusters Envoy got over CDS)."""
        return self.name if self.credential is None else self.cluster


def parse_burst(raw: object, where: str = "burst") -> tuple[BurstEndpoint, ...]:
    """A gateway config's ``[[burst]]`` array: every field of :class:`BurstEndpoint` (``engine``, if
    given, must be ``openai_compat``); names unique, and a local model bursts to one endpoint at most.
    :class:`ConfigError` names the first bad field."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: expected an array of tables")
    out = tuple(_endpoint(item, f"{where}[{i}]") for i, item in enumerate(raw))
    names = [e.name for e in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: duplicate name")
    seen: dict[str, str] = {}
    for e in out:
        for model in e.models:
            if model in seen:
                raise ConfigError(f"{where}: model {model!r} bursts to both {seen[model]!r} and {e.name!r}")
            seen[model] = e.name
    return out


def valid_name(name: str) -> bool:
    """An endpoint's (or credential's) name: ``[a-z0-9][a-z0-9_-]*``, at most 63 characters."""
    return bool(_NAME.match(name))


def valid_host(host: str) -> bool:
    """A DNS name (not an IP address): the TLS server name and the certificate name verified."""
    return bool(_HOST.match(host)) and not host.replace(".", "").isdigit()


def parse_endpoint_fields(s: Section, where: str) -> tuple[str, int, dict[str, str]]:
    """``engine`` (``openai_compat`` only), ``host``, ``port`` and ``models`` of an endpoint's table:
    shared by ``[[burst]]`` and etcd ``burst/<name>`` records."""
    engine = s.string("engine", "openai_compat")
    if engine != "openai_compat":
        raise ConfigError(f"{where}.engine: a burst endpoint is openai_compat, got {engine!r}")
    host = s.string("host", REQUIRED)
    if not valid_host(host):
        raise ConfigError(f"{where}.host: expected a DNS name (the TLS server name), got {host!r}")
    port = s.integer("port", 443, minimum=1)
    if port > 65535:
        raise ConfigError(f"{where}.port: must be a port number, got {port}")
    models = s.table("models")
    mapping = {local: models.string(local, REQUIRED) for local in models.names()}
    models.done()
    if not mapping or not all(k and v for k, v in mapping.items()):
        raise ConfigError(f"{where}.models: a non-empty table of local model name = hosted model name")
    return host, port, mapping


def _endpoint(raw: object, where: str) -> BurstEndpoint:
    s = Section(raw, where)
    name = s.string("name", REQUIRED)
    if not valid_name(name):
        raise ConfigError(f"{where}.name: lowercase letters, digits, '-' and '_' (at most 63), got {name!r}")
    host, port, mapping = parse_endpoint_fields(s, where)
    key_file = s.string("api_key_file", REQUIRED)
    ca_file = s.string("ca_file")
    if not key_file or ca_file == "":
        raise ConfigError(f"{where}: api_key_file (and ca_file when set) must be paths")
    s.done()
    return BurstEndpoint(name, host, types.MappingProxyType(mapping), key_file, port, ca_file)


def wants_burst(queued: bool, budget_s: float | None, predicted_miss: bool) -> bool:
    """The rule (README): never while the request would go at once (``queued`` False); with a TTFT
    deadline (``budget_s`` seconds left), only when even routed now every local endpoint is predicted
    to miss it (``predicted_miss``); with none, whenever it would be queued."""
    if not queued:
        return False
    if budget_s is None:
        return True
    return predicted_miss


def burst_body(kind: str, body: Mapping[str, object], hosted_model: str) -> dict[str, object]:
    """The body a hosted endpoint gets: the client's, ``model`` the hosted name, the fields of
    :data:`DROPPED_FIELDS` (and a Responses body's :data:`DROPPED_RESPONSES_FIELDS`) dropped, and ``store``
    false where the kind has it (:data:`STORE_KINDS`), dropped elsewhere."""
    dropped = DROPPED_FIELDS | DROPPED_RESPONSES_FIELDS if kind == "responses" else DROPPED_FIELDS
    out = {k: v for k, v in body.items() if k not in dropped}
    out["model"] = hosted_model
    if kind in STORE_KINDS:
        out["store"] = False
    else:  # not the kind's field: nothing a client sends there reaches the account's storage
        out.pop("store", None)
    return out


@dataclass(slots=True)
class TokenBucket:
    """``per_minute`` tokens a minute, refilled continuously (``per_minute / 60`` a second), holding at
    most ``max(per_minute, 1)``; starts full. In any window of ``T`` seconds it gives at most
    ``capacity + per_minute x T / 60``."""

    tokens: float = 0.0
    at: float | None = None
    per_minute: float = 0.0

    def level(self, per_minute: float, now: float) -> float:
        """Tokens there are at ``now`` under ``per_minute`` (a changed rate keeps what is left, capped);
        changes nothing (the metrics read it from another thread)."""
        capacity = max(per_minute, 1.0) if per_minute > 0 else 0.0
        if self.at is None:
            return capacity
        refilled = self.tokens + max(0.0, now - self.at) * per_minute / 60.0
        return min(refilled, capacity)

    def take(self, per_minute: float, now: float) -> bool:
        """Spend one token if there is one."""
        tokens = self.level(per_minute, now)
        ok = tokens >= 1.0
        self.tokens, self.at, self.per_minute = tokens - 1.0 if ok else tokens, now, per_minute
        return ok

    def rerate(self, per_minute: float, now: float) -> None:
        """The rate becomes ``per_minute`` at ``now``: the time before it is counted at the old rate (the
        tokens it refilled, capped at the old capacity), so a raised rate gives nothing back."""
        if self.at is not None and per_minute != self.per_minute:
            self.tokens, self.at = self.level(self.per_minute, now), now
        self.per_minute = per_minute


@dataclass(slots=True)
class Burster:
    """The burst endpoints by local model, a bucket each, and the counts the metrics read."""

    endpoints: tuple[BurstEndpoint, ...]
    buckets: dict[str, TokenBucket] = field(default_factory=dict)
    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    #: The budget (``flow/burst``) the buckets are up to date with; ``None``: none seen yet.
    per_minute: float | None = None

    def rerate(self, per_minute: float, now: float) -> None:
        """The policy's budget is ``per_minute`` from ``now`` (the shell calls it when the policy changes):
        each bucket is brought up to date at the old rate first (:meth:`TokenBucket.rerate`)."""
        if per_minute != self.per_minute:
            for bucket in self.buckets.values():
                bucket.rerate(per_minute, now)
            self.per_minute = per_minute

    def target(self, model: str) -> BurstEndpoint | None:
        """The burst endpoint serving local ``model`` (``None``: it never bursts)."""
        for e in self.endpoints:
            if model in e.models:
                return e
        return None

    def take(self, endpoint: BurstEndpoint, per_minute: float, now: float) -> bool:
        """Spend one of ``endpoint``'s budget (``per_minute``: the policy's ``flow/burst``); counted as
        ``sent`` or ``no_budget``. A budget :meth:`rerate` was not told of changes here: the pause before
        counts at the old rate (never more than the README's bound)."""
        self.rerate(per_minute, now)
        ok = self.buckets.setdefault(endpoint.name, TokenBucket()).take(per_minute, now)
        key = (endpoint.name, SENT if ok else NO_BUDGET)
        self.counts[key] = self.counts.get(key, 0) + 1
        return ok

    def left(self, per_minute: float, now: float) -> dict[str, float]:
        """Each endpoint's budget left at ``now`` (tokens). Writes nothing: the metrics call it from their
        scrape thread, while the loop may be iterating :attr:`buckets` (a rerate)."""
        fresh = TokenBucket()
        return {e.name: self.buckets.get(e.name, fresh).level(per_minute, now) for e in self.endpoints}
