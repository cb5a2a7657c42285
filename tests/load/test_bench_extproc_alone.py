"""``load.bench.extproc_alone``: its quick run routes at 1 and 2 workers, and only routed streams count.

Benchmarks are not tests: nothing here asserts a figure beyond "requests were served".
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.config import parse_config
from extproc.server import Gateway
from kvgate.dev.options import DEFAULT_MODEL
from load.bench import extproc_alone

STATS = {"n", "p50", "p90", "p99", "max", "mean"}
ADDRESSES = ["127.0.0.1:9", "127.0.0.1:10"]


def test_quick_routes_with_one_and_two_workers(tmp_path: Path) -> None:
    out = tmp_path / "extproc-alone.json"
    assert extproc_alone.main(["--quick", "--workers", "1,2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"benchmark", "command", "machine", "revision", "parameters", "per_workers", "scaling"} <= (
        result.keys()
    )
    assert result["parameters"]["client_processes"] >= 1
    assert set(result["per_workers"]) == {"1", "2"}
    for cell in result["per_workers"].values():
        assert cell["served"] > 0 and cell["rps_median"] > 0
        assert cell["not_served"] == 0, cell["outcomes"]
        assert cell["stream_us"].keys() >= STATS and cell["answer_us"]["n"] == cell["served"]
        assert cell["extproc_cpu_ms_per_req"] > 0 and cell["client_cores"] > 0
    assert result["scaling"]["baseline_workers"] == 1
    assert result["scaling"]["rps_ratio"]["1"] == 1.0 and result["scaling"]["rps_ratio"]["2"] > 0
    assert {r["workers"] for r in result["rounds"]} == {1, 2}


@pytest.fixture
async def gateway(model_dir: str) -> AsyncIterator[Gateway]:
    """A real ext_proc in-process: its endpoints serve the benchmark's model only at ``ADDRESSES``."""
    config = parse_config(
        {
            "extproc": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "metrics_listen": ""},
            "models": [{"name": DEFAULT_MODEL, "model_dir": model_dir}],
            "endpoints": [
                {"id": f"e{i}", "address": a, "models": [DEFAULT_MODEL]} for i, a in enumerate(ADDRESSES)
            ],
        }
    )
    gw = Gateway(config)
    await gw.start()
    yield gw
    await gw.aclose(grace_s=0)


async def outcome(gw: Gateway, body: bytes, replicas: list[str], response_headers: bool = False) -> str:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.ports['extproc']}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        got, stream_ns, answer_ns = await extproc_alone._one(
            stub, body, "t1", frozenset(replicas), response_headers
        )
    assert 0 < answer_ns <= stream_ns
    return got


@pytest.mark.parametrize("response_headers", [False, True])
async def test_only_a_routed_stream_is_served(gateway: Gateway, response_headers: bool) -> None:
    # Without tenants the bundled Envoy skips the response-headers phase; with them it sends it.
    body = extproc_alone.chat_body(1)
    assert await outcome(gateway, body, ADDRESSES, response_headers) == extproc_alone.SERVED


async def test_a_rejected_stream_is_not_served(gateway: Gateway) -> None:
    unknown = json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert await outcome(gateway, unknown.encode(), ADDRESSES) == "rejected_404"
    assert await outcome(gateway, b"{not json", ADDRESSES) == "rejected_400"


async def test_a_pick_outside_the_replicas_is_not_served(gateway: Gateway) -> None:
    assert await outcome(gateway, extproc_alone.chat_body(1), ["127.0.0.1:11"]) == "no_destination"


def test_load_client_refuses_other_hosts() -> None:
    with pytest.raises(SystemExit):
        extproc_alone.client_main(
            [
                "--target",
                "10.0.0.1:9",
                "--replica",
                "x",
                "--concurrency",
                "1",
                "--warmup-s",
                "0",
                "--duration-s",
                "0",
            ]
        )


def test_the_median_of_an_even_count_of_rounds_is_the_middle_twos_mean() -> None:
    """``--rounds 2`` (or 4): the median is not the upper of the middle two."""
    assert extproc_alone._median([10.0, 30.0]) == 20.0
    assert extproc_alone._median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert extproc_alone._median([3.0, 1.0, 2.0]) == 2.0
