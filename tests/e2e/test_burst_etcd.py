"""End to end, a burst endpoint declared in etcd (``burst/<name>``) while everything runs: real etcd, real
Envoy (the endpoint's cluster arrives over the ext_proc's CDS, no restart), the gateway, one slow local
replica (flow control: one request at a time), and the stand-in hosted endpoint of ``test_burst`` (a
simulator serving HTTPS as ``localhost`` from a test CA and requiring a key: the real OpenAI wire format).
The gateway host declares the credential (``[burst_credentials.hosted]``: key file, allowed host, CA); the
record only names it. ``kvgate policy set`` writes and validates the records.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from contracts.etcd import EtcdSettings
from kvgate import policy_cli
from kvgate.dev.procs import admin_get
from kvgate.dev.up import Stack, StackOptions
from runtime.etcd import connect
from tests.e2e.test_burst import (
    CLIENT_AUTH,
    HOSTED_MODEL,
    MODEL,
    PER_MINUTE,
    Hosted,
    ask,
    gateway,
    hosted_endpoint,
    streamed_model,
)
from tests.polling import until

pytestmark = pytest.mark.e2e

PREFIX = "/kvgate/"
CLUSTER = "kvgate_burst_hosted"


@dataclass
class Running:
    stack: Stack
    hosted: Hosted
    etcd: str


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory, model_dir: str) -> Iterator[Running]:
    work = tmp_path_factory.mktemp("burst-etcd")
    with hosted_endpoint(work, model_dir) as hosted:
        opts = StackOptions(
            agents=1,  # the stack's own etcd, which the gateway follows
            port=0,
            agent_args=("--time-scale", "3"),
            workdir=work / "stack",
            overlay={
                "flow": {"saturation": {"max_in_flight": 1}, "burst": {"max_per_minute": PER_MINUTE}},
                "burst_credentials": {
                    "hosted": {
                        "api_key_file": str(hosted.key_file),
                        "hosts": ["localhost"],
                        "ca_file": str(hosted.ca),
                    }
                },
            },
        )
        with Stack(opts) as stack:
            assert stack.etcd is not None
            yield Running(stack, hosted, stack.etcd.address)


def record(hosted: Hosted, **changes: Any) -> str:
    return json.dumps(
        {
            "host": "localhost",
            "port": hosted.port,
            "credential": "hosted",
            "models": {MODEL: HOSTED_MODEL},
            **changes,
        }
    )


async def policy(r: Running, *argv: str) -> int:
    """``kvgate policy ARGV`` against the test's etcd (in a thread: the CLI runs its own event loop)."""
    return await asyncio.to_thread(policy_cli.main, [*argv, "--etcd", r.etcd, "--prefix", PREFIX])


def envoy_cluster(stack: Stack) -> str:
    """Envoy's view of the burst cluster (its ``/clusters`` lines), ``""`` when it has none."""
    got = admin_get(stack.admin_url, "/clusters", timeout_s=2)
    assert got is not None and got[0] == 200
    return "\n".join(line for line in got[1].decode().splitlines() if line.startswith(CLUSTER + "::"))


def seen(hosted: Hosted) -> dict[str, Any]:
    verify = ssl.create_default_context(cafile=str(hosted.ca))
    got = httpx.get(f"{hosted.url}/_sim/auth", verify=verify, timeout=5)
    assert got.status_code == 200
    result: dict[str, Any] = got.json()
    return result


async def overflow(stack: Stack, n: int) -> list[str]:
    """Take the one local slot with a long request, then send ``n`` streamed ones: who answered each."""
    async with httpx.AsyncClient(base_url=stack.url, timeout=90) as client:
        await until(lambda: gateway(stack, "kvgate_endpoint_load") == 0, 30)
        busy = asyncio.create_task(client.post("/v1/chat/completions", json=ask("long", 200)))
        await until(lambda: gateway(stack, "kvgate_endpoint_load") >= 1, 20)
        answers = await asyncio.gather(
            *(
                client.post(
                    "/v1/chat/completions", json={**ask(f"over {i}", 4), "stream": True}, headers=CLIENT_AUTH
                )
                for i in range(n)
            )
        )
        assert (await busy).status_code == 200
    assert [a.status_code for a in answers] == [200] * n, [a.text for a in answers]
    return [streamed_model(a) for a in answers]


async def test_an_etcd_record_adds_a_burst_endpoint_without_an_envoy_restart(running: Running) -> None:
    stack, hosted = running.stack, running.hosted
    assert stack.envoy is not None
    envoy_pid = stack.envoy.pid
    # Before any record: overflow waits for the local replica, Envoy has no such cluster.
    models = await overflow(stack, 2)
    assert models == [MODEL, MODEL]
    assert envoy_cluster(stack) == "" and seen(hosted)["accepted"] == 0

    # Refused by `kvgate policy set` (exit 2, nothing written): a credential the gateway host (its config)
    # does not declare, and a key written into the record.
    config = str(stack.workdir / "gateway.json")
    assert (
        await policy(running, "set", "burst/hosted", record(hosted, credential="other"), "--config", config)
        == 2
    )
    assert await policy(running, "set", "burst/hosted", record(hosted, api_key="sk-inline")) == 2
    assert await policy(running, "set", "burst/hosted", record(hosted)) == 0
    await until(lambda: gateway(stack, "kvgate_burst_budget_left", endpoint="hosted") == PER_MINUTE, 20)
    await until(lambda: f"{CLUSTER}::" in envoy_cluster(stack), 30)  # over CDS

    models = await overflow(stack, 4)
    hosted_answers = models.count(HOSTED_MODEL)
    assert hosted_answers >= PER_MINUTE and models.count(MODEL) >= 1
    auth = seen(hosted)
    assert auth["rejected"] == 0 and auth["accepted"] == hosted_answers
    assert auth["last_authorization_sha256"] == hashlib.sha256(f"Bearer {hosted.key}".encode()).hexdigest()
    assert gateway(stack, "kvgate_burst_requests_total", endpoint="hosted", outcome="sent") == hosted_answers
    assert stack.envoy.pid == envoy_pid  # the same Envoy


async def test_a_bad_record_in_etcd_is_refused_and_the_last_good_one_stays(running: Running) -> None:
    stack, hosted = running.stack, running.hosted

    await policy(running, "set", "burst/hosted", record(hosted))
    await until(lambda: f"{CLUSTER}::" in envoy_cluster(stack), 30)
    before = gateway(stack, "kvgate_burst_records_refused_total")
    client = await connect(EtcdSettings(endpoints=(running.etcd,), prefix=PREFIX))
    try:  # written past the CLI: the key sent to a host its credential does not list
        await client.kv.put(f"{PREFIX}burst/hosted", record(hosted, host="evil.example").encode())
    finally:
        await client.close()
    await until(lambda: gateway(stack, "kvgate_burst_records_refused_total") > before, 20)
    assert f"{CLUSTER}::" in envoy_cluster(stack)
    assert "evil" not in envoy_cluster(stack)
    assert gateway(stack, "kvgate_burst_budget_left", endpoint="hosted") >= 0  # still in force

    # Unset: the endpoint leaves the burster and Envoy's cluster goes (CDS), still no restart.
    assert await policy(running, "unset", "burst/hosted") == 0
    await until(lambda: envoy_cluster(stack) == "", 30)
    models = await overflow(stack, 2)
    assert models == [MODEL, MODEL]


def test_the_key_is_in_no_file_of_the_stack(running: Running) -> None:
    for path in Path(running.stack.workdir).glob("*"):
        if path.is_file():
            assert running.hosted.key.encode() not in path.read_bytes(), path.name
