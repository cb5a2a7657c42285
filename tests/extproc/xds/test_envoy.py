"""A real Envoy (the wheel's 1.40) on the gateway's EDS and failed-try services.

The bootstrap is rendered here, minimal and independent of :mod:`kvgate.envoy`: an EDS cluster
``kvgate_engines`` fed over ``envoy_grpc`` by a STATIC HTTP/2 cluster pointing at the gateway's ext_proc
port, balanced by ``override_host`` (from a request header here, so no ext_proc filter is needed), and
the router's ``upstream_log``: an ``http_grpc`` access logger filtered to failed tries, which is what the
bundled config renders for every ext_proc replica.
"""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from contracts.epp import DESTINATION, ENGINES_CLUSTER, FAILURE_LOG_NAME
from contracts.events import EndpointId
from extproc.config import parse_config
from extproc.server import Gateway
from kvgate.dev.procs import Child, http_get, start_envoy
from kvgate.envoy.resilience import failure_loggers
from tests.polling import until

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_GRPC_LOG = "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig"
_HTTP_OPTS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_OVERRIDE_HOST = "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
_ROUND_ROBIN = "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
XDS_CLUSTER = "kvgate_extproc"

#: What Envoy sends: every failed upstream try (and nothing else), as the bundled config filters it.
FAILED_TRY_FILTER = failure_loggers(1)[0]["filter"]


def _addr(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def bootstrap(extproc_port: int) -> dict[str, Any]:
    """Listener ``openai`` → router (one retry, to the next host of the header's list) → ``kvgate_engines``
    (EDS from the gateway); failed tries logged to the gateway."""
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": _ROUTER,
            "upstream_log": [
                {
                    "name": "envoy.access_loggers.http_grpc",
                    "filter": FAILED_TRY_FILTER,
                    "typed_config": {
                        "@type": _GRPC_LOG,
                        "common_config": {
                            "log_name": FAILURE_LOG_NAME,
                            "transport_api_version": "V3",
                            "grpc_service": {"envoy_grpc": {"cluster_name": XDS_CLUSTER}},
                            "buffer_flush_interval": "0.1s",
                        },
                    },
                }
            ],
        },
    }
    route = {
        "match": {"prefix": "/"},
        "route": {
            "cluster": ENGINES_CLUSTER,
            "retry_policy": {"retry_on": "connect-failure", "num_retries": 1},
        },
    }
    hcm = {
        "@type": _HCM,
        "stat_prefix": "openai",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]},
        "http_filters": [router],
    }
    return {
        "node": {"id": "test-envoy", "cluster": "kvgate"},
        "admin": {"address": _addr("127.0.0.1", 0)},
        "static_resources": {
            "listeners": [
                {
                    "name": "openai",
                    "address": _addr("127.0.0.1", 0),
                    "filter_chains": [
                        {
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": XDS_CLUSTER,
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": _HTTP_OPTS,
                            "explicit_http_config": {"http2_protocol_options": {}},
                        }
                    },
                    "load_assignment": {
                        "cluster_name": XDS_CLUSTER,
                        "endpoints": [
                            {"lb_endpoints": [{"endpoint": {"address": _addr("127.0.0.1", extproc_port)}}]}
                        ],
                    },
                },
                {
                    "name": ENGINES_CLUSTER,
                    "type": "EDS",
                    "connect_timeout": "0.5s",
                    "eds_cluster_config": {
                        "service_name": ENGINES_CLUSTER,
                        "eds_config": {
                            "resource_api_version": "V3",
                            "api_config_source": {
                                "api_type": "GRPC",
                                "transport_api_version": "V3",
                                "grpc_services": [{"envoy_grpc": {"cluster_name": XDS_CLUSTER}}],
                            },
                        },
                    },
                    "load_balancing_policy": {
                        "policies": [
                            {
                                "typed_extension_config": {
                                    "name": "envoy.load_balancing_policies.override_host",
                                    "typed_config": {
                                        "@type": _OVERRIDE_HOST,
                                        "override_host_sources": [{"header": DESTINATION}],
                                        "fallback_policy": {
                                            "policies": [
                                                {
                                                    "typed_extension_config": {
                                                        "name": "rr",
                                                        "typed_config": {"@type": _ROUND_ROBIN},
                                                    }
                                                }
                                            ]
                                        },
                                    },
                                }
                            }
                        ]
                    },
                },
            ],
        },
    }


def dead_port() -> int:
    """A loopback port nothing listens on (bound, then closed): connecting to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def engine_hosts(admin: str) -> dict[str, str]:
    """``ip:port`` → EDS health status of each host of ``kvgate_engines`` in Envoy's admin ``/clusters``."""
    got = http_get(f"{admin}/clusters?format=json")
    assert got is not None and got[0] == 200
    out: dict[str, str] = {}
    for cluster in json.loads(got[1]).get("cluster_statuses", []):
        if cluster["name"] != ENGINES_CLUSTER:
            continue
        for host in cluster.get("host_statuses", []):
            sa = host["address"]["socket_address"]
            out[f"{sa['address']}:{sa['port_value']}"] = host["health_status"]["eds_health_status"]
    return out


class Stack:
    """The gateway (fleet: ``dead-0``, ``dead-1`` refuse connections, ``draining`` answers 503), Envoy on
    it, Envoy's admin URL and listener port."""

    def __init__(
        self, gateway: Gateway, envoy: Child, admin: str, port: int, addresses: dict[str, str]
    ) -> None:
        self.gateway, self.envoy, self.admin, self.port, self.addresses = (
            gateway,
            envoy,
            admin,
            port,
            addresses,
        )


async def refusing_engine() -> tuple[web.AppRunner, int]:
    """An engine that answers every request with 503, as a draining vLLM does."""

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": "draining"}, status=503)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port: int = runner.addresses[0][1]
    return runner, port


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    refusing, refusing_port = await refusing_engine()
    addresses = {
        "dead-0": f"127.0.0.1:{dead_port()}",
        "dead-1": f"127.0.0.1:{dead_port()}",
        "draining": f"127.0.0.1:{refusing_port}",
    }
    config = parse_config(
        {
            "extproc": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "metrics_listen": ""},
            # Long enough to see the ejections in Envoy's admin on a busy machine.
            "ejection": {"base_s": 3.0},
            "endpoints": [{"id": i, "address": a, "models": ["m"]} for i, a in addresses.items()],
        }
    )
    gateway = Gateway(config)
    await gateway.start()
    try:
        # Envoy is ready only once it has the EDS answer, which this event loop serves: start it off the loop.
        envoy, admin, port = await asyncio.to_thread(
            start_envoy, "envoy", json.dumps(bootstrap(gateway.ports["extproc"])), tmp_path
        )
        try:
            yield Stack(gateway, envoy, admin, port, addresses)
        finally:
            await asyncio.to_thread(envoy.stop)
    finally:
        await gateway.aclose(grace_s=0)
        await refusing.cleanup()


async def test_envoy_learns_the_fleet_and_failed_tries_eject(stack: Stack) -> None:
    await until(lambda: set(engine_hosts(stack.admin)) == set(stack.addresses.values()), 10)
    assert set(engine_hosts(stack.admin).values()) == {"HEALTHY"}
    # The list is walked: the first host refuses the connection, the one retry goes to the second (refused).
    dead = f"{stack.addresses['dead-0']},{stack.addresses['dead-1']}"
    assert await asyncio.to_thread(get_through, stack.port, dead) == 503
    # An engine's own 503 is a failed try too (not retried: the route retries connect failures only).
    assert await asyncio.to_thread(get_through, stack.port, stack.addresses["draining"]) == 503
    fleet = stack.gateway.fleet
    kinds = {
        "dead-0": "upstream_connection_failure",
        "dead-1": "upstream_connection_failure",
        "draining": "http_503",
    }
    states = [fleet.get(EndpointId(e)) for e in kinds]
    await until(lambda: all(s is not None and s.ejected_until > 0 for s in states), 10)
    ejections = stack.gateway.metrics.registry.get_sample_value
    for endpoint, kind in kinds.items():
        assert ejections("kvgate_endpoint_ejections_total", {"endpoint": endpoint, "kind": kind}) == 1.0
    # EDS tells Envoy while they are ejected, and again when the ejections end.
    await until(lambda: set(engine_hosts(stack.admin).values()) == {"UNHEALTHY"}, 10)
    await until(lambda: set(engine_hosts(stack.admin).values()) == {"HEALTHY"}, 10)


def get_through(port: int, destination: str) -> int:
    """The status of ``GET /v1/models`` through Envoy's listener with ``destination`` as the host list."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers={DESTINATION: destination})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code
