"""End to end, burst to a hosted endpoint: client -> real Envoy -> ext_proc -> one simulated local replica
(flow control: one request at a time), and a "hosted" OpenAI-compatible endpoint: a simulator serving
HTTPS on 127.0.0.1 with a certificate for ``localhost`` from a test CA, requiring vLLM's ``--api-key``
(401 without the right Bearer). A stand-in for a hosted API, which cannot run here; it speaks the same
wire format. Envoy reaches it by name (STRICT_DNS ``localhost``), verifies its certificate against the test
CA with SNI ``localhost``, and injects the key from its file; the simulator reports a SHA-256 of the
Authorization it saw (``/_sim/auth``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import ssl
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from certs.store import ca_paths, init_ca, issue
from extproc.status.snapshot import decode
from kvgate.dev.procs import Child
from kvgate.dev.up import Stack, StackOptions
from kvgate.envoy.burst import REFUSED_MESSAGE
from tests.e2e.test_disagg import samples
from tests.polling import until

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
HOSTED_MODEL = "hosted-smol"
PER_MINUTE = 2
CLIENT_AUTH = {"authorization": "Bearer client-secret", "x-api-key": "client-key", "cookie": "session=1"}


@dataclass
class Burst:
    stack: Stack
    hosted_url: str
    hosted_address: str
    key: str
    ca: Path
    #: The ``[[burst]]`` table the stack runs with.
    endpoint: dict[str, Any]


def options(workdir: Path, endpoint: dict[str, Any]) -> StackOptions:
    """One slow local replica taking one request at a time, and the burst endpoint with its budget."""
    return StackOptions(
        replicas=1,
        port=0,
        sim_args=("--time-scale", "3"),
        workdir=workdir,
        overlay={
            "flow": {"saturation": {"max_in_flight": 1}, "burst": {"max_per_minute": PER_MINUTE}},
            "burst": [endpoint],
        },
    )


@dataclass
class Hosted:
    """The stand-in hosted endpoint: its HTTPS port, key (and file) and the CA its certificate chains to."""

    port: int
    key: str
    key_file: Path
    ca: Path

    @property
    def url(self) -> str:
        return f"https://localhost:{self.port}"


@contextmanager
def hosted_endpoint(work: Path, model_dir: str) -> Iterator[Hosted]:
    """A simulator serving HTTPS as ``localhost`` (a test CA) and requiring a fresh key (vLLM's
    ``--api-key``, passed in its environment, not on the argv)."""
    ca_dir = work / "ca"
    now = datetime.now(UTC)
    init_ca(ca_dir, now)
    leaf = issue(ca_dir, "engine-hosted", ["DNS:localhost"], now)
    key = "sk-hosted-" + secrets.token_hex(12)
    key_file = work / "hosted.key"
    key_file.write_text(key)
    key_file.chmod(0o600)
    ready = work / "hosted.ready.json"
    argv = [sys.executable, "-m", "load.sim.server", "--model", HOSTED_MODEL, "--model-dir", model_dir]
    argv += ["--host", "127.0.0.1", "--port", "0", "--ready-file", str(ready), "--time-scale", "0.05"]
    argv += ["--tls-cert", str(leaf.cert), "--tls-key", str(leaf.key)]
    hosted = Child("hosted", argv, work / "hosted.log", env={"VLLM_API_KEY": key})
    try:
        (replica,) = hosted.wait_for_json_file(ready, 120)
        yield Hosted(int(replica["address"].rpartition(":")[2]), key, key_file, ca_paths(ca_dir)[0])
    finally:
        hosted.stop()


@pytest.fixture(scope="module")
def burst(tmp_path_factory: pytest.TempPathFactory, model_dir: str) -> Iterator[Burst]:
    work = tmp_path_factory.mktemp("burst")
    with hosted_endpoint(work, model_dir) as h:
        endpoint = {
            "name": "hosted",
            "host": "localhost",
            "port": h.port,
            "ca_file": str(h.ca),
            "api_key_file": str(h.key_file),
            "models": {MODEL: HOSTED_MODEL},
        }
        with Stack(options(work / "stack", endpoint)) as running:
            yield Burst(running, h.url, f"127.0.0.1:{h.port}", h.key, h.ca, endpoint)


def gateway(stack: Stack, name: str, **labels: str) -> float:
    assert stack.info is not None and stack.info.metrics_url
    want = set(labels.items())
    return sum(v for (n, ls), v in samples(stack.info.metrics_url).items() if n == name and want <= set(ls))


def free(stack: Stack) -> bool:
    """Whether flow control sees the replica's one slot free: the scheduler's load estimate is 0 and the
    gateway has heard every completion from Envoy (its ``outstanding`` count, which the in-flight limit
    never counts fewer than). A scrape can bring the load to 0 between an answer and its completion log
    (flushed every 20 ms; later on a loaded machine): the next request would then still find the slot
    taken, be queued, and burst."""
    if gateway(stack, "kvgate_endpoint_load") != 0:
        return False
    got = httpx.get(f"http://127.0.0.1:{stack.extproc_ports['metrics']}/status.json", timeout=10)
    return got.status_code == 200 and all(e.outstanding == 0 for e in decode(got.content).endpoints)


def seen(b: Burst) -> dict[str, Any]:
    """What the hosted endpoint saw: requests with the right key, without, and the last Authorization's
    SHA-256 (read over its own TLS, checked against the test CA)."""
    verify = ssl.create_default_context(cafile=str(b.ca))
    got = httpx.get(f"{b.hosted_url}/_sim/auth", verify=verify, timeout=5)
    assert got.status_code == 200
    result: dict[str, Any] = got.json()
    return result


def streamed_model(answer: httpx.Response) -> str:
    """The model an SSE answer names (every chunk the same), checked to end with ``[DONE]``."""
    assert answer.headers["content-type"].startswith("text/event-stream"), answer.text
    events = [line[len("data: ") :] for line in answer.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2
    (model,) = {json.loads(e)["model"] for e in events[:-1]}
    assert isinstance(model, str)
    return model


def ask(content: str, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


async def test_with_room_locally_nothing_goes_to_burst(burst: Burst) -> None:
    stack = burst.stack
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
        for i in range(3):  # one at a time, each once the last one's slot is free again
            await until(lambda: free(stack), 20)
            answer = await client.post("/v1/chat/completions", json=ask(f"room {i}", 4), headers=CLIENT_AUTH)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == MODEL
    assert seen(burst)["accepted"] == seen(burst)["rejected"] == 0
    assert gateway(stack, "kvgate_burst_requests_total") == 0
    assert gateway(stack, "kvgate_burst_budget_left", endpoint="hosted") == PER_MINUTE


async def test_overflow_bursts_within_budget_with_the_injected_key(burst: Burst) -> None:
    stack = burst.stack
    async with httpx.AsyncClient(base_url=stack.url, timeout=90) as client:
        await until(lambda: free(stack), 20)  # else the long request itself may be queued and burst
        busy = asyncio.create_task(client.post("/v1/chat/completions", json=ask("long", 200)))
        await until(lambda: gateway(stack, "kvgate_endpoint_load") >= 1, 20)  # the one slot is taken
        started = time.monotonic()
        answers = await asyncio.gather(  # streamed: the hosted answer's SSE comes back through Envoy
            *(
                client.post(
                    "/v1/chat/completions", json={**ask(f"over {i}", 4), "stream": True}, headers=CLIENT_AUTH
                )
                for i in range(4)
            )
        )
        elapsed = time.monotonic() - started
        assert (await busy).status_code == 200
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    models = [streamed_model(a) for a in answers]
    hosted = [a for a, m in zip(answers, models, strict=True) if m == HOSTED_MODEL]
    local = [a for a, m in zip(answers, models, strict=True) if m == MODEL]
    # The bucket starts full (PER_MINUTE) and refills PER_MINUTE a minute; the rest waited for the replica.
    assert PER_MINUTE <= len(hosted) <= PER_MINUTE + int(elapsed * PER_MINUTE / 60)
    assert len(hosted) + len(local) == 4 and local
    assert all(a.headers["x-kvgate-endpoint"] == burst.hosted_address for a in hosted)
    auth = seen(burst)
    assert auth["rejected"] == 0 and auth["accepted"] == len(hosted)
    injected = hashlib.sha256(f"Bearer {burst.key}".encode()).hexdigest()
    assert auth["last_authorization_sha256"] == injected  # Envoy's key, never the client's
    assert gateway(stack, "kvgate_burst_requests_total", endpoint="hosted", outcome="sent") == len(hosted)
    assert gateway(stack, "kvgate_burst_requests_total", endpoint="hosted", outcome="no_budget") >= 1
    assert gateway(stack, "kvgate_burst_budget_left", endpoint="hosted") < 1


def test_the_key_is_in_no_log(burst: Burst) -> None:
    for path in Path(burst.stack.workdir).glob("*"):
        if path.is_file():
            assert burst.key.encode() not in path.read_bytes(), path.name


async def test_a_hosted_certificate_that_does_not_verify_gets_nothing(
    burst: Burst, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same hosted endpoint, but the gateway trusts another CA: Envoy refuses the handshake, so the
    request fails (503, an OpenAI error) and the endpoint sees no request, and so no key."""
    work = tmp_path_factory.mktemp("untrusted")
    init_ca(work / "other-ca", datetime.now(UTC))
    endpoint = {**burst.endpoint, "ca_file": str(ca_paths(work / "other-ca")[0])}
    before = seen(burst)
    with Stack(options(work / "stack", endpoint)) as stack:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
            busy = asyncio.create_task(client.post("/v1/chat/completions", json=ask("long", 100)))
            await until(lambda: gateway(stack, "kvgate_endpoint_load") >= 1, 20)
            answer = await client.post("/v1/chat/completions", json=ask("over", 4), headers=CLIENT_AUTH)
            assert (await busy).status_code == 200
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["type"]  # Envoy's local reply, as OpenAI JSON
        assert gateway(stack, "kvgate_burst_requests_total", outcome="sent") == 1
    assert seen(burst) == before


async def test_a_refused_gateway_key_reaches_the_client_as_a_502(
    burst: Burst, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The hosted endpoint refuses the gateway's key (401): the client, whose own credentials were fine,
    gets Envoy's 502 OpenAI error, not the hosted answer (OpenAI's quotes the key's last characters)."""
    work = tmp_path_factory.mktemp("refused")
    wrong = work / "wrong.key"
    wrong.write_text("sk-wrong-" + secrets.token_hex(12))
    wrong.chmod(0o600)
    before = seen(burst)
    with Stack(options(work / "stack", {**burst.endpoint, "api_key_file": str(wrong)})) as stack:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
            busy = asyncio.create_task(client.post("/v1/chat/completions", json=ask("long", 100)))
            await until(lambda: gateway(stack, "kvgate_endpoint_load") >= 1, 20)
            answer = await client.post("/v1/chat/completions", json=ask("over", 4), headers=CLIENT_AUTH)
            assert (await busy).status_code == 200
    assert answer.status_code == 502, answer.text
    assert answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert error["message"] == REFUSED_MESSAGE and error["type"] == "gateway_error"
    assert seen(burst)["rejected"] == before["rejected"] + 1  # it did reach the endpoint, and was refused
