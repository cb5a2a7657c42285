"""The simulator's ``--api-key`` (as vLLM's): /v1 needs the Bearer key, 401 otherwise; /_sim/auth says
what arrived as a digest, never the key."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import aiohttp
import pytest

from load.sim.server import SimConfig, SimFleet, build_parser, config_from_args
from tests.load.test_sim_server import config, model_dir  # noqa: F401  (fixtures)

KEY = "sk-sim-test"


async def test_v1_requires_the_key_and_the_digest_of_what_arrived(config: SimConfig) -> None:  # noqa: F811
    body = {"model": config.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with (
        SimFleet(dataclasses.replace(config, api_key=KEY), 1) as fleet,
        aiohttp.ClientSession() as http,
    ):
        base = f"http://{fleet.addresses[0]}"
        for auth in (None, "Bearer wrong", KEY):  # a bare key is not a Bearer credential
            hs = {} if auth is None else {"Authorization": auth}
            async with http.post(f"{base}/v1/chat/completions", json=body, headers=hs) as resp:
                assert resp.status == 401 and await resp.json() == {"error": "Unauthorized"}
        hs = {"Authorization": f"Bearer {KEY}"}
        async with http.post(f"{base}/v1/chat/completions", json=body, headers=hs) as resp:
            assert resp.status == 200
        async with http.get(f"{base}/health") as resp:  # as vLLM: only /v1 is guarded
            assert resp.status == 200
        async with http.get(f"{base}/_sim/auth") as resp:
            seen = await resp.json()
    assert seen == {
        "accepted": 1,
        "rejected": 3,
        "last_authorization_sha256": hashlib.sha256(f"Bearer {KEY}".encode()).hexdigest(),
    }
    assert KEY not in str(seen)


def test_the_key_comes_from_the_flag_or_vllms_environment(
    monkeypatch: pytest.MonkeyPatch,
    model_dir: Path,  # noqa: F811
) -> None:
    base = ["--model", "m", "--model-dir", str(model_dir)]
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert config_from_args(build_parser().parse_args(base)).api_key is None
    assert config_from_args(build_parser().parse_args([*base, "--api-key", "a"])).api_key == "a"
    monkeypatch.setenv("VLLM_API_KEY", "b")
    assert config_from_args(build_parser().parse_args(base)).api_key == "b"
