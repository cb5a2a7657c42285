"""`kvgate up` as a user runs it: the command line, Ctrl-C, and fronting engines that already run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from kvgate.dev.up import Stack, StackOptions
from tests.e2e.conftest import FAST_SIM

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"


def test_up_serves_then_ctrl_c_stops_everything(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvgate.cli",
            "up",
            "--port",
            "0",
            "--replicas",
            "2",
            "--workdir",
            str(tmp_path),
        ],
        env={**os.environ, "KVGATE_STATE_DIR": str(tmp_path / "state")},  # not the user's stack.json
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        banner = ""
        for line in proc.stdout:  # readiness: the launcher prints its URL once Envoy listens
            if line.startswith("kvgate is up: "):
                banner = line
                break
        assert banner, "kvgate up exited before it was up"
        base = banner.split()[3]
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert reply.choices[0].message.content
        children = [int(p) for p in _child_pids(proc.pid)]
        assert len(children) == 4  # two simulators (one process per replica), the ext_proc, Envoy
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        for pid in children:
            assert not _alive(pid), f"child {pid} survived Ctrl-C"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


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
