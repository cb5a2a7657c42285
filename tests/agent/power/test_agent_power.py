"""A node agent with a [[power]] source, end to end: it runs a simulated vLLM whose GPU is a capped A100
(--gpu, serving dcgm-exporter's format), reads that exporter, and its feed carries the readings and the
engine's output tokens/s with every load to a gateway's FeedManager, where the endpoint learns its node's
power, tokens/s and energy per token, its /status shows the source, and the gateway's gauges show it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from agent.config import parse_node_config
from agent.main import Agent
from contracts.events import EndpointId
from engines.endpoint import Endpoint
from extproc.control.feeds import FeedManager
from extproc.fleet import Fleet
from extproc.metrics import GatewayMetrics
from load.sim.server import DCGM_PATH
from tests.agent.power.bmc import free_port
from tests.agent.test_telemetry import MODEL, model_dir  # noqa: F401  (the module-scoped fixture)
from tests.polling import until


class NoIndex:
    def apply(self, events: object, now: float) -> None:
        pass

    def clear_endpoint(self, endpoint: EndpointId) -> None:
        pass


async def test_power_travels_from_the_agent_to_the_gateway(tmp_path: Path, model_dir: Path) -> None:  # noqa: F811
    port = free_port()
    raw = {
        "agent": {"id": "node-a", "state_dir": str(tmp_path / "state")},
        "engines": [
            {
                "id": "sim-0",
                "kind": "sim",
                "model": MODEL,
                "model_path": str(model_dir),
                "port": port,
                "parallel": 4,
                "args": ["--gpu", "a100", "--power-cap-w", "200", "--time-scale", "0.2"],
            }
        ],
        "power": [
            {"kind": "dcgm", "url": f"http://127.0.0.1:{port}{DCGM_PATH}", "interval_s": 0.1},
            {
                "kind": "redfish",
                "name": "bmc",
                "url": "https://127.0.0.1:1",
                "username": "u",
                "password_env": "NO_SUCH_VAR_KVGATE",
            },
        ],
    }
    agent = Agent(parse_node_config(raw), index_block_size=16)
    fleet = Fleet()
    manager = FeedManager(NoIndex(), fleet, subscriber="test")  # type: ignore[arg-type]
    metrics = GatewayMetrics(fleet)
    try:
        await agent.start()
        await agent.wait_ready(120.0)
        fleet.upsert(
            Endpoint(
                EndpointId("sim-0"),
                f"127.0.0.1:{port}",
                frozenset({MODEL}),
                node="node-a",
                feed=agent.feed_address,
            )
        )
        manager.sync()
        state = fleet.get(EndpointId("sim-0"))
        assert state is not None
        await until(
            lambda: any(p.source == "dcgm" and p.watts == 55.0 for p in state.power), 20.0
        )  # idle A100
        bmc = next(p for p in state.power if p.source == "bmc")
        assert bmc.watts is None and "NO_SUCH_VAR_KVGATE is not set" in bmc.error  # reported, not fatal
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 300, "n": 4}
            busy = asyncio.create_task(http.post(f"http://127.0.0.1:{port}/v1/completions", json=body))
            try:
                await until(lambda: any(p.source == "dcgm" and p.throttled for p in state.power), 20.0)
                await until(
                    lambda: (state.output_tps or 0.0) > 0 and state.energy_per_token is not None, 20.0
                )
            finally:
                busy.cancel()
                await asyncio.gather(busy, return_exceptions=True)
        labels = {"node": "node-a", "source": "dcgm"}
        assert metrics.registry.get_sample_value("kvgate_power_limit_watts", labels) == 200.0
        assert (
            metrics.registry.get_sample_value("kvgate_power_source_up", {"node": "node-a", "source": "bmc"})
            == 0
        )
        status = {s["name"]: s for s in agent.status()["power"]}  # type: ignore[union-attr]
        assert status["dcgm"]["error"] is None and status["dcgm"]["reads"] > 0
        assert status["bmc"]["failures"] >= 1 and "not set" in str(status["bmc"]["error"])
    finally:
        await manager.aclose()
        await agent.aclose()
