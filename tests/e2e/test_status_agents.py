"""End to end with node agents (``kvgate up --agents 2``: a local etcd, two agents each supervising a
simulated vLLM): the status shows the agents' feeds, a drain and a policy override written in etcd, and
flow control's queue while requests are held."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator

import httpx
import pytest

from extproc.status.snapshot import Status, decode
from kvgate.dev.up import Stack, StackOptions
from kvgate.policy_cli import drain_main
from kvgate.policy_cli import main as policy_main
from kvgate.status_cli import main as status_main
from tests.polling import until

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # The simulators' documented timing (no time scale): a request of 64 tokens decodes for a while, so
    # requests held by flow control stay held long enough to be seen.
    options = StackOptions(agents=2, port=0, workdir=tmp_path_factory.mktemp("status-agents"))
    with Stack(options) as running:
        yield running


def etcd(stack: Stack) -> str:
    assert stack.etcd is not None
    return stack.etcd.address


def status(stack: Stack) -> Status:
    url = f"http://127.0.0.1:{stack.extproc_ports['metrics']}/status.json"
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
    return decode(body)


async def test_feeds_drain_and_policy_from_etcd(stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    ids = sorted(e["id"] for e in stack.engines)
    await until(lambda: sorted(f.endpoints for f in status(stack).index.feeds) == [(i,) for i in ids], 30)
    for feed in status(stack).index.feeds:
        assert feed.connected and feed.last_error == ""
    await until(lambda: all(f.age_s is not None and f.age_s < 5 for f in status(stack).index.feeds), 30)
    assert await asyncio.to_thread(drain_main, [ids[1], "--etcd", etcd(stack)]) == 0
    assert await asyncio.to_thread(policy_main, ["set", "weights/prefix", "5", "--etcd", etcd(stack)]) == 0
    try:

        def applied() -> bool:
            now = status(stack)
            states = {e.id: e.state for e in now.endpoints}
            return states == {ids[0]: "ready", ids[1]: "draining"} and now.policy.overridden == (
                "weights/prefix",
            )

        await until(applied, 30)
        assert status(stack).policy.values["weights/prefix"] == 5.0
        capsys.readouterr()
        assert (
            await asyncio.to_thread(
                status_main, ["--url", f"http://127.0.0.1:{stack.extproc_ports['metrics']}"]
            )
            == 0
        )
        out = capsys.readouterr().out
        assert "1/2 endpoints ready" in out
        row = next(line for line in out.splitlines() if line.startswith(ids[1] + " ")).split()
        assert row[4] == "draining"
        assert any(line.split() == ["weights/prefix", "5.0", "set"] for line in out.splitlines())
        assert sum(" connected " in line for line in out.splitlines()) == 2
    finally:
        assert await asyncio.to_thread(drain_main, [ids[1], "--undo", "--etcd", etcd(stack)]) == 0
        assert await asyncio.to_thread(policy_main, ["unset", "weights/prefix", "--etcd", etcd(stack)]) == 0
    await until(lambda: all(e.state == "ready" for e in status(stack).endpoints), 30)


async def test_queue_depths_while_requests_are_held(stack: Stack) -> None:
    """With one request in flight per engine allowed, the others wait in flow control's queue, by
    (model, priority): the status counts them, and nothing once they are gone."""
    assert (
        await asyncio.to_thread(
            policy_main, ["set", "flow/saturation", '{"max_in_flight": 1}', "--etcd", etcd(stack)]
        )
        == 0
    )
    try:
        await until(lambda: status(stack).policy.overridden == ("flow/saturation",), 30)
        seen: list[Status] = []

        def held() -> bool:
            seen.append(status(stack))
            return seen[-1].queued > 0

        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:

            async def ask(i: int) -> int:
                resp = await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": MODEL,
                        "max_tokens": 64,
                        "messages": [{"role": "user", "content": f"count to {i}"}],
                    },
                )
                return resp.status_code

            asking = [asyncio.create_task(ask(i)) for i in range(8)]
            await until(held, 30)
            codes = await asyncio.gather(*asking)
        assert codes == [200] * 8
        queues = [(q.model, q.priority) for q in seen[-1].queues]
        assert queues == [(MODEL, 0)] and seen[-1].queued == seen[-1].queues[0].queued
        await until(lambda: status(stack).queued == 0, 30)
    finally:
        assert await asyncio.to_thread(policy_main, ["unset", "flow/saturation", "--etcd", etcd(stack)]) == 0
