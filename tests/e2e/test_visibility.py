"""End to end: where did my request go? Probes answered by the gateway alone, the serving engine named on
the response, and one access-log line per request (real Envoy, the ext_proc, simulated replicas).

The access log is read where the stack's rendered Envoy config sends it (``envoy.yaml`` in the stack's
work directory): Envoy's stdout (its child log) or a file. Envoy writes it every 10 s by default, hence the
generous waits.
"""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from contracts.epp import ENDPOINT_HEADER
from kvgate.dev.procs import http_get
from kvgate.dev.up import Stack, StackOptions
from tests.polling import until

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
REPLICA_HEADER = "x-kvgate-replica"  # every simulated replica tags its responses with its id
LOG_WAIT_S = 30.0
PROBES = [
    ("GET", "/health"),
    ("HEAD", "/health"),
    ("GET", "/ready"),
    ("HEAD", "/ready"),
    ("GET", "/readiness"),
    ("GET", "/liveness"),
]


def access_log_path(stack: Stack) -> Path:
    """Where the running Envoy writes its access log, from its rendered config."""
    config = yaml.safe_load((stack.workdir / "envoy.yaml").read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    log, _timeouts, _completions = hcm["access_log"]  # the request log, then the ext_procs' gRPC logs
    path = log["typed_config"].get("path")
    if path is not None:
        return Path(path)
    assert log["name"] == "envoy.access_loggers.stdout" and stack.envoy is not None
    return stack.envoy.log_path


def access_log(stack: Stack) -> dict[str, dict[str, Any]]:
    """The access log's entries by request id (Envoy's own log lines, not JSON, are skipped)."""
    entries = {}
    for line in access_log_path(stack).read_text(errors="replace").splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            entries[entry["request_id"]] = entry
    return entries


async def logged(stack: Stack, request_ids: list[str]) -> list[dict[str, Any]]:
    await until(lambda: set(request_ids) <= access_log(stack).keys(), LOG_WAIT_S)
    entries = access_log(stack)
    return [entries[r] for r in request_ids]


def engine_work(stack: Stack) -> list[float]:
    """Per engine: prompt and generated tokens and prefix-cache queries it has counted (``/metrics``)."""
    counted = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total")
    work = []
    for engine in stack.engines:
        got = http_get(engine["metrics_url"])
        assert got is not None and got[0] == 200
        lines = got[1].decode().splitlines()
        work.append(sum(float(line.split()[-1]) for line in lines if line.startswith(counted)))
    return work


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_probes_are_answered_by_the_gateway_alone(stack: Stack) -> None:
    before = engine_work(stack)
    ids = []
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        for method, path in PROBES:
            resp = await client.request(method, path)
            assert (resp.status_code, resp.content) == (200, b""), (method, path, resp.text)
            assert REPLICA_HEADER not in resp.headers and ENDPOINT_HEADER not in resp.headers
            ids.append(resp.headers["x-request-id"])
    assert len(set(ids)) == len(PROBES)
    assert engine_work(stack) == before
    for (method, path), entry in zip(PROBES, await logged(stack, ids), strict=True):
        assert (entry["method"], entry["path"], entry["status"]) == (method, path, 200)
        assert entry["endpoint"] is None and entry["details"] == "kvgate_probe"


async def test_responses_name_the_engine_and_the_log_holds_the_decision(stack: Stack) -> None:
    addresses = {e["id"]: e["address"] for e in stack.engines}
    marker = f"visibility-{uuid.uuid4().hex}"
    secret, query_secret = f"sk-kvg-{uuid.uuid4().hex}", uuid.uuid4().hex
    content = f"{marker}: kvgate names the engine that served each request and logs its decision. " * 6
    payload = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    )
    served = []
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        # the same prompt twice: the second goes where the first left its prefix; it also claims an engine
        for spoof in ({}, {ENDPOINT_HEADER: "10.9.9.9:9"}):
            resp = await client.post(
                f"/v1/chat/completions?api_key={query_secret}",
                content=payload,
                headers={"content-type": "application/json", "authorization": f"Bearer {secret}", **spoof},
            )
            assert resp.status_code == 200, resp.text
            replica = resp.headers[REPLICA_HEADER]
            assert resp.headers[ENDPOINT_HEADER] == addresses[replica]  # the engine that really served it
            served.append((resp.headers["x-request-id"], replica))
    first, second = await logged(stack, [rid for rid, _ in served])
    for entry, (_, replica) in zip((first, second), served, strict=True):
        assert (entry["status"], entry["method"], entry["path"]) == (200, "POST", "/v1/chat/completions")
        assert (entry["endpoint"], entry["endpoint_id"]) == (addresses[replica], replica)
        assert entry["model"] == MODEL and entry["flags"] == "-" and entry["details"] == "via_upstream"
        assert entry["prompt_blocks"] >= 4 and entry["decision_us"] > 0
        assert 0 <= entry["ttfb_ms"] <= entry["duration_ms"]
        assert entry["bytes_received"] == len(payload) and entry["bytes_sent"] > 0
    assert served[0][1] == served[1][1]
    # the first found at most the chat template's default system prompt; the second all of its prompt.
    # The first stopped hashing at its first block nobody held (the lazy path), so its prompt_blocks is
    # estimated from the prompt's characters (extproc/README.md); the second, led everywhere, hashed
    # its whole prompt and counts it exactly.
    blocks = second["prompt_blocks"]
    assert first["matched_blocks"] < blocks
    assert second["matched_blocks"] == blocks
    text = access_log_path(stack).read_text(errors="replace")
    for never in (marker, secret, query_secret):
        assert never not in text


async def test_not_ready_without_a_routable_engine(tmp_path: Path) -> None:
    options = StackOptions(
        port=0,
        model=MODEL,
        endpoints=(f"http://127.0.0.1:{closed_port()}",),
        scrape={"interval_s": 0.05, "unhealthy_after": 1},
        workdir=tmp_path,
    )
    with Stack(options) as down:
        ready = f"{down.url}/ready"
        await until(lambda: (http_get(ready) or (0, b""))[0] == 503, LOG_WAIT_S)  # after a failed scrape
        async with httpx.AsyncClient(base_url=down.url, timeout=10) as client:
            resp = await client.get("/readiness")
            assert resp.status_code == 503 and resp.headers["content-type"] == "application/json"
            assert resp.json() == {
                "error": {
                    "message": "No endpoint is ready to serve any model.",
                    "type": "service_unavailable",
                    "param": None,
                    "code": "no_ready_endpoint",
                }
            }
            assert (await client.get("/health")).status_code == 200  # the gateway itself is up


async def test_probes_fail_closed_when_the_extproc_is_down(tmp_path: Path) -> None:
    options = StackOptions(
        port=0,
        model=MODEL,
        endpoints=(f"http://127.0.0.1:{closed_port()}",),
        with_extproc=False,
        workdir=tmp_path,
    )
    with Stack(options) as closed:
        async with httpx.AsyncClient(base_url=closed.url, timeout=30) as client:
            for method, path in PROBES:
                resp = await client.request(method, path)
                assert resp.status_code == 503, (method, path)
                if method == "GET":
                    assert resp.json()["error"]["type"] == "service_unavailable"
