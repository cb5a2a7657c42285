"""The agent's handling of its engines' state changes (an in-process agent, a remote engine served by
aiohttp)."""

from __future__ import annotations

import socket
from pathlib import Path

import aiohttp
from aiohttp import web

from agent.config import AgentSection, NodeConfig
from agent.main import Agent
from agent.supervisor import EngineState
from engines.config import EngineConfig


async def test_a_remote_engine_that_answers_after_its_ready_timeout_is_followed(tmp_path: Path) -> None:
    """Down longer than ``ready_timeout_s``: ``starting -> unhealthy -> ready``; once it answers, it is
    registered and scraped, and ``/readyz`` says ready."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    remote = EngineConfig(id="late", kind="openai_compat", model="m", address=f"127.0.0.1:{port}",
                          ready_timeout_s=0.2)  # fmt: skip
    agent = Agent(
        NodeConfig(AgentSection(id="node-a", state_dir=str(tmp_path)), (remote,)), index_block_size=16
    )

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"data": []})

    app = web.Application()
    app.router.add_get("/v1/models", ok)
    runner = web.AppRunner(app)
    try:
        await agent.start()
        eng = agent.engines["late"]
        await eng.supervisor.wait_for(EngineState.UNHEALTHY, timeout_s=10)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await agent.wait_ready(timeout_s=10)
        assert eng.registered
        launch = eng.supervisor.launch
        assert launch is not None and (launch.metrics_url is None or eng.scraper is not None)
        url = f"http://127.0.0.1:{agent.admin_port}/readyz"
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            assert resp.status == 200
    finally:
        await agent.aclose()
        await runner.cleanup()
