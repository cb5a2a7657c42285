"""``kvgate up --recipe recipes/smollm2/llamacpp/aggregated`` as a user runs it: a local etcd, one node
agent per engine of the recipe, each running a real ``llama-server`` (SmolLM2-135M on the CPU), the ext_proc
on the recipe's gateway config and Envoy; one chat request through it, then Ctrl-C stops everything."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import launched_up

pytestmark = pytest.mark.e2e
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "smollm2" / "llamacpp" / "aggregated"


def test_up_runs_the_llama_cpp_recipe(tmp_path: Path) -> None:
    with launched_up(["--recipe", str(RECIPE), "--port", "0"], tmp_path) as up:
        banner = up.banner
        assert banner, "kvgate up exited before it was up"
        assert "llama-0=" in banner and "llama-1=" in banner  # the recipe's engine ids
        client = openai.OpenAI(base_url=up.base_url, api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            temperature=0,
        )
        assert reply.choices[0].message.content is not None and reply.usage is not None
        # The recipe's gateway config is in force: its model entry (the GGUF) and its context bound.
        gateway = (tmp_path / "gateway.json").read_text()
        assert '"gguf": "smollm2"' in gateway and '"max_model_len": 2048' in gateway
        assert up.stop() == 0
