"""The completion signal end to end: the bundled Envoy (``render()``, the wheel's 1.40) in front of the real
ext_proc and an engine; once a routed request's response is complete, the ext_proc hears its completion
(``kvgate-completions`` gRPC access log) with the request id it decided under and the engine that served
it, and the router counts it at that endpoint. Requests the gateway answers itself are not logged."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
from aiohttp import web

from contracts.epp import ENDPOINT_HEADER
from contracts.events import EndpointId
from extproc.config import parse_config
from extproc.fleet import EndpointState
from extproc.server import Gateway
from extproc.xds.als import Completion
from kvgate.dev.procs import start_envoy
from kvgate.envoy.bootstrap import EnvoyParams, render
from tests.kvgate.envoy.test_edge_headers import engines_known
from tests.polling import until


async def engine() -> tuple[web.AppRunner, str]:
    """An engine answering every request with a short completion after 50 ms; its ``ip:port``."""

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(0.05)  # some work, so the log's timings are not all zero
        return web.json_response({"id": "c1", "object": "text_completion", "choices": [{"text": "ok"}]})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"127.0.0.1:{runner.addresses[0][1]}"


async def test_a_routed_request_completes_at_the_ext_proc(tmp_path: Path) -> None:
    runner, address = await engine()
    config = parse_config(
        {
            "extproc": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "metrics_listen": ""},
            "endpoints": [{"id": "e0", "address": address, "models": ["m"]}],
        }
    )
    gateway = Gateway(config)
    heard: list[tuple[Completion, EndpointState | None]] = []
    # What the lead wires in extproc/server.py: the router counts each completion.
    gateway.failed_tries.on_completion = lambda c: heard.append(
        (c, gateway.router.completed(c.request_id, time.monotonic()))
    )
    await gateway.start()
    try:
        params = EnvoyParams(
            listen_port=0, admin_port=0, extproc_port=gateway.ports["extproc"], access_log_path=None
        )
        envoy, admin, port = await asyncio.to_thread(
            start_envoy, "envoy", json.dumps(render(params)), tmp_path
        )
        try:
            await until(lambda: engines_known(admin, address), 10)
            async with httpx.AsyncClient(timeout=10) as client:
                base = f"http://127.0.0.1:{port}"
                # First the gateway's own answer (no engine): were it logged, its entry would come first.
                assert (await client.get(f"{base}/v1/models")).status_code == 200
                resp = await client.post(f"{base}/v1/completions", json={"model": "m", "prompt": "hello"})
                assert resp.status_code == 200, resp.text
            await until(lambda: len(heard) >= 1, 10)
        finally:
            await asyncio.to_thread(envoy.stop)
    finally:
        await gateway.aclose(grace_s=0)
        await runner.cleanup()
    ((done, counted),) = heard  # one entry: the routed request only
    assert done.request_id == resp.headers["x-request-id"]
    assert done.address == resp.headers[ENDPOINT_HEADER] == address
    assert done.status == 200
    assert done.ttfb_s is not None and done.duration_s is not None
    assert 0.05 <= done.ttfb_s <= done.duration_s < 5
    state = gateway.fleet.get(EndpointId("e0"))
    assert counted is state and state is not None
    assert (state.routed_since_scrape, state.completed_since_scrape) == (1, 1)
