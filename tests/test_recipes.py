"""recipes/: every recipe's files load through the project's real loaders (node agent configs, gateway
config, the policy store for a policy file) and every engine's command line renders; ``kvgate up
--recipe`` refuses a recipe whose engines need a GPU, naming the engine, before starting anything."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from agent.config import load_node_config
from agent.launch import render
from extproc.config import load_config
from extproc.control.policy import gateway_policy, pd_policy
from kvgate.dev import recipe
from kvgate.dev.up import main as up_main

ROOT = Path(__file__).resolve().parent.parent / "recipes"
RECIPES = sorted(p.parent for p in ROOT.glob("*/*/*/gateway.toml"))


def test_the_four_recipes_are_there() -> None:
    names = {str(p.relative_to(ROOT)) for p in RECIPES}
    assert names == {
        "smollm2/llamacpp/aggregated",
        "qwen3-8b/vllm/aggregated",
        "qwen3-8b/vllm/disaggregated",
        "qwen3-8b/sglang/aggregated",
    }
    for path in RECIPES:
        assert (path / "README.md").is_file(), path


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_loads_through_the_real_loaders(path: Path) -> None:
    gateway = load_config(path / "gateway.toml")
    if gateway.policy_file is not None:  # relative: to the directory the ext_proc starts in
        gateway = dataclasses.replace(gateway, policy_file=str(path / gateway.policy_file))
    policy = gateway_policy(gateway).policy  # validates the file's values, as the ext_proc's start does
    served = {m.name for m in gateway.models}
    nodes = [load_node_config(f) for f in sorted(path.glob("node*.toml"))]
    assert nodes
    for node in nodes:
        for engine in node.engines:
            assert engine.model in served, (engine.id, served)
            launch = render(engine, node.agent, port=8000, side_port=5600)
            assert launch.argv and launch.address.endswith(":8000")
    if "disaggregated" in path.name:
        roles = {e.role for n in nodes for e in n.engines}
        assert roles == {"prefill", "decode"}
        pd = pd_policy(policy, max_fallbacks=gateway.extproc.max_fallbacks)
        assert {m: r.spec.mode for m, r in pd.routes.items()} == {"qwen3-8b": "conditional"}


def test_vllm_disaggregated_renders_nixl_producer_and_consumer() -> None:
    path = ROOT / "qwen3-8b/vllm/disaggregated"
    flags = {}
    for name in ("node-prefill.toml", "node-decode.toml"):
        node = load_node_config(path / name)
        engine = node.engines[0]
        launch = render(engine, node.agent, port=8000, side_port=5600)
        config = launch.argv[launch.argv.index("--kv-transfer-config") + 1]
        flags[engine.role] = (config, dict(launch.env))
    assert '"kv_connector":"NixlConnector"' in flags["prefill"][0] and "kv_producer" in flags["prefill"][0]
    assert "kv_consumer" in flags["decode"][0]
    assert flags["prefill"][1]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"


@pytest.mark.parametrize(
    "path", [p for p in RECIPES if "llamacpp" not in str(p)], ids=lambda p: p.parent.name
)
def test_up_refuses_a_gpu_recipe_naming_its_engine(
    path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert up_main(["--recipe", str(path), "--workdir", str(tmp_path / "w")]) == 1
    err = capsys.readouterr().err
    engine = path.parent.name
    assert f"engine `{engine}` needs an NVIDIA GPU" in err and str(path) in err
    assert not (tmp_path / "w").exists()  # refused before anything started


def test_the_local_recipe_becomes_local_agents_and_an_overlay() -> None:
    found = recipe.load(ROOT / "smollm2/llamacpp/aggregated")
    recipe.check_local(found)
    tree = recipe.gateway_overlay(found, dev_auth=False)
    assert "etcd" not in tree and "listen" not in tree.get("extproc", {})
    assert tree["models"][0]["gguf"] == "smollm2"
    tables, agent = recipe.local_nodes(found)
    assert [t["id"] for t in tables] == ["llama-0", "llama-1"]
    assert all("port" not in t and t["kind"] == "llama_cpp" for t in tables)
    assert agent == {"drain_timeout_s": 30}


def test_a_bad_recipe_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "gateway.toml").write_text("[extproc]\nlisten = 'x'\nbogus = 1\n")
    (tmp_path / "node.toml").write_text("[[engines]]\nkind = 'llama_cpp'\nmodel = 'm'\n")
    assert up_main(["--recipe", str(tmp_path)]) == 2
    assert "bogus" in capsys.readouterr().err
    assert up_main(["--recipe", str(tmp_path / "missing")]) == 2
    assert "not a recipe" in capsys.readouterr().err
