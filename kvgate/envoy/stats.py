"""A read-only Prometheus endpoint for Envoy's own statistics (``EnvoyParams.stats_port``).

Envoy's admin serves ``/stats/prometheus``, but the admin also changes log levels and quits the server,
so kvgate keeps it on a 0600 Unix socket (or loopback). This listener exposes that one path and nothing
else: ``GET /stats/prometheus`` (any query string) is proxied to the admin through the static cluster
``kvgate_envoy_admin``; every other method or path is a 404 answered by Envoy itself.
"""

from __future__ import annotations

from typing import Any

from contracts.errors import ConfigError

STATS_LISTENER = "stats"
ADMIN_CLUSTER = "kvgate_envoy_admin"
STATS_PATH = "/stats/prometheus"

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


def stats_listener(host: str, port: int) -> dict[str, Any]:
    """The ``stats`` listener on ``host:port``: ``GET /stats/prometheus`` to the admin, else 404."""
    routes = [
        {
            "match": {"path": STATS_PATH, "headers": [{"name": ":method", "string_match": {"exact": "GET"}}]},
            "route": {"cluster": ADMIN_CLUSTER, "timeout": "5s"},
        },
        {"match": {"prefix": "/"}, "direct_response": {"status": 404}},
    ]
    hcm = {
        "@type": _HCM,
        "stat_prefix": STATS_LISTENER,
        "codec_type": "AUTO",
        "route_config": {
            "name": STATS_LISTENER,
            "virtual_hosts": [{"name": STATS_LISTENER, "domains": ["*"], "routes": routes}],
        },
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}],
    }
    return {
        "name": STATS_LISTENER,
        "address": {"socket_address": {"address": host, "port_value": port}},
        "enable_reuse_port": False,
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
        ],
    }


def admin_cluster(admin_address: dict[str, Any]) -> dict[str, Any]:
    """The static cluster whose one host is Envoy's own admin (``admin_address`` as the bootstrap's
    ``admin.address``: a pipe or a loopback socket). A TCP admin on port 0 cannot be named: ConfigError."""
    socket = admin_address.get("socket_address")
    if socket is not None and int(socket.get("port_value", 0)) == 0:
        raise ConfigError("Envoy's stats listener needs the admin on a Unix socket or a fixed port")
    return {
        "name": ADMIN_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": ADMIN_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": admin_address}}]}],
        },
    }
