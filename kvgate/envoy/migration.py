"""Envoy's side of in-flight migration (extproc/migration): opted-in models' requests go through the
migration proxy; every other model's stream goes straight from engine to client as before.

* a route per opted-in model, matched on the model header the ext_proc sets after its decision (the
  route is chosen again after the ext_proc's reply), to the ``kvgate_migration`` cluster (the proxy on
  loopback), with no retries (the proxy walks the fallbacks itself);
* on that route Envoy writes :data:`~contracts.epp.MIGRATE_UPSTREAMS_HEADER` from the decision's
  ``envoy.lb`` metadata (only the ext_proc writes it; a client's copy of the header is stripped before
  any filter) and :data:`~contracts.epp.MIGRATION_LIMIT_HEADER` with the model's ``migration_limit``;
* the proxy serves plain HTTP: the secure profile takes it on a loopback address only
  (:func:`require_loopback`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from contracts.epp import DESTINATION, LB_NS, MIGRATE_UPSTREAMS_HEADER, MIGRATION_LIMIT_HEADER, MODEL_HEADER
from contracts.errors import ConfigError
from extproc.config import GatewayConfig
from kvgate.envoy.hosts import cluster_type, is_ip

CLUSTER = "kvgate_migration"


@dataclass(frozen=True, slots=True)
class EnvoyMigration:
    """The proxy's address and the opted-in models: (name, migration_limit, idle timeout or ``None``)."""

    host: str
    port: int
    models: tuple[tuple[str, int, float | None], ...]


def migrating_models(config: GatewayConfig) -> tuple[tuple[str, int, float | None], ...]:
    """The ``[[models]]`` of a gateway config with ``migration = true``."""
    return tuple((m.name, m.migration_limit, m.idle_timeout_s) for m in config.models if m.migration)


def require_loopback(migration: EnvoyMigration) -> None:
    """:class:`ConfigError` unless the proxy is on a loopback address: it serves plain HTTP, so the secure
    profile (TLS on every hop) reaches it only on this machine, never sends prompts across a network."""
    if not (is_ip(migration.host) and ipaddress.ip_address(migration.host).is_loopback):
        raise ConfigError(
            f"--migration-proxy {migration.host}:{migration.port}: the migration proxy serves plain HTTP; "
            "the secure profile reaches it on a loopback address only (127.0.0.1 or ::1, beside Envoy)"
        )


def routes(migration: EnvoyMigration | None, idle_s: float) -> list[dict[str, Any]]:
    """One route per opted-in model, with its idle timeout (the model's, else ``idle_s``: the stream idle
    timeout of routed requests; the listener's is longer, for requests the ext_proc holds)."""
    if migration is None:
        return []
    out = []
    for model, limit, idle in migration.models:
        action: dict[str, Any] = {
            "cluster": CLUSTER,
            "timeout": "0s",
            "idle_timeout": f"{idle_s if idle is None else idle}s",
        }
        out.append(
            {
                "match": {
                    "prefix": "/",
                    "headers": [{"name": MODEL_HEADER, "string_match": {"exact": model}}],
                },
                "route": action,
                "request_headers_to_remove": [MODEL_HEADER],
                "request_headers_to_add": [
                    {
                        "header": {
                            "key": MIGRATE_UPSTREAMS_HEADER,
                            "value": f"%DYNAMIC_METADATA({LB_NS}:{DESTINATION})%",
                        },
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    },
                    {
                        "header": {"key": MIGRATION_LIMIT_HEADER, "value": str(limit)},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    },
                ],
            }
        )
    return out


def cluster(migration: EnvoyMigration, connect_timeout_s: float, buffer_limit: int) -> dict[str, Any]:
    """The proxy's cluster: by address, or by DNS name (a STATIC cluster takes addresses only)."""
    return {
        "name": CLUSTER,
        "type": cluster_type((migration.host,)),
        "connect_timeout": f"{connect_timeout_s}s",
        "per_connection_buffer_limit_bytes": buffer_limit,
        "circuit_breakers": {
            "thresholds": [
                {"max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000}
            ]
        },
        "load_assignment": {
            "cluster_name": CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {
                                        "address": migration.host,
                                        "port_value": migration.port,
                                    }
                                }
                            }
                        }
                    ]
                }
            ],
        },
    }
