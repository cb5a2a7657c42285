"""`kvgate up` as a user runs it: the command line, Ctrl-C, and fronting engines that already run."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import openai
import pytest

from kvgate.dev.up import Stack, StackOptions
from tests.e2e.conftest import FAST_SIM, launched_up

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"


def test_up_serves_then_ctrl_c_stops_everything(tmp_path: Path) -> None:
    with launched_up(["--port", "0", "--replicas", "2"], tmp_path) as up:
        assert up.banner, "kvgate up exited before it was up"
        client = openai.OpenAI(base_url=up.base_url, api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert reply.choices[0].message.content
        children = [int(p) for p in _child_pids(up.proc.pid)]
        assert len(children) == 4  # two simulators (one process per replica), the ext_proc, Envoy
        assert up.stop() == 0
        for pid in children:
            assert not _alive(pid), f"child {pid} survived Ctrl-C"


def test_fronts_existing_engines(stack: Stack, tmp_path: Path) -> None:
    """`kvgate up --endpoint URL` routes to engines it did not start (here: the session stack sims)."""
    urls = tuple(f"http://{e['address']}" for e in stack.engines[:2])
    with Stack(StackOptions(port=0, endpoints=urls, workdir=tmp_path, sim_args=FAST_SIM)) as front:
        assert front.engines[0]["engine"] == "vllm"
        resp = httpx.post(
            f"{front.url}/v1/completions",
            json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2},
            timeout=30,
        )
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kvgate-replica"] in {e["id"] for e in stack.engines[:2]}


def _child_pids(pid: int) -> list[str]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return children.read_text().split()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as stopped.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
