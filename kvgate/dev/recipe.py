"""``kvgate up --recipe DIR``: a recipe (``recipes/<model>/<engine>/<topology>/``) run on this machine.

A recipe holds its node agents' configs (``node*.toml``) and its gateway's (``gateway.toml``, with a
``policy.toml`` where it names one). Run locally, the launcher keeps what makes the stack local, as for
``kvgate up --config`` (:mod:`kvgate.dev.overlay`): a local etcd, one agent per ``[[engines]]`` table
(the table's engine settings; its ``host``, ``port`` and the ``[agent]`` addresses, state directory,
TLS and kvcached are the launcher's), free ports; the gateway config is merged over the generated one
without its ``[[endpoints]]``, ``[etcd]``, ``[feeds]`` and listen addresses and TLS files (a relative
``[policy] file`` is found in the recipe's directory).

Only engines that run without a GPU run here (:data:`LOCAL_KINDS`); any other is refused, naming it,
before anything starts (:class:`RecipeUnavailable`). The agents validate their own configs as they
always do; the gateway config is validated here first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.config import read_tree
from contracts.errors import ConfigError
from kvgate.dev import overlay

#: Engine kinds ``kvgate up --recipe`` starts on this machine: no GPU needed.
LOCAL_KINDS = ("llama_cpp", "sim")
#: What each GPU engine needs, for the refusal.
NEEDS = {
    "vllm": "an NVIDIA GPU and vLLM (`vllm serve`)",
    "sglang": "an NVIDIA GPU and SGLang (`python -m sglang.launch_server`)",
    "trtllm": "an NVIDIA GPU and TensorRT-LLM (`trtllm-serve`)",
    "openai_compat": "a remote OpenAI-compatible server (kvgate up --endpoint URL fronts one)",
}
#: ``[[engines]]`` keys the launcher sets for a local run.
_ENGINE_LOCAL = ("host", "port", "address", "ready_timeout_s")
#: ``[agent]`` keys kept from a recipe for a local run (the rest are addresses, paths, TLS: the launcher's).
_AGENT_KEPT = ("role", "drain_timeout_s", "slot_save_min_tokens")


class RecipeUnavailable(Exception):
    """The recipe's engines cannot run on this machine (the message names them and what they need)."""


@dataclass(frozen=True, slots=True)
class Recipe:
    """A recipe's files as read: ``gateway`` the gateway config's tree (validated), ``nodes`` each node
    config's tree (``[[engines]]`` tables in order)."""

    path: Path
    gateway: dict[str, Any]
    nodes: tuple[tuple[Path, dict[str, Any]], ...]

    @property
    def engines(self) -> list[dict[str, Any]]:
        return [dict(e) for _, node in self.nodes for e in node.get("engines", [])]

    @property
    def model(self) -> str:
        return str(self.engines[0]["model"])


def load(path: Path) -> Recipe:
    """Read the recipe in ``path``: :class:`ConfigError` naming the file for a missing or bad file."""
    gateway_file = path / "gateway.toml"
    if not path.is_dir() or not gateway_file.is_file():
        raise ConfigError(f"{path}: not a recipe (no gateway.toml)")
    node_files = sorted(path.glob("node*.toml"))
    if not node_files:
        raise ConfigError(f"{path}: not a recipe (no node*.toml)")
    gateway = read_tree(gateway_file, "gateway config")
    if not isinstance(gateway, dict):
        raise ConfigError(f"{gateway_file}: expected a table at the top")
    nodes = []
    for file in node_files:
        tree = read_tree(file, "node config")
        engines = tree.get("engines") if isinstance(tree, dict) else None
        if not isinstance(tree, dict) or not isinstance(engines, list) or not engines:
            raise ConfigError(f"{file}: expected [[engines]] tables")
        if not all(isinstance(e, dict) and isinstance(e.get("kind"), str) for e in engines):
            raise ConfigError(f"{file}: every [[engines]] table needs a kind")
        nodes.append((file, tree))
    return Recipe(path, gateway, tuple(nodes))


def check_local(recipe: Recipe) -> None:
    """:class:`RecipeUnavailable` unless every engine of ``recipe`` runs here (:data:`LOCAL_KINDS`)."""
    missing = sorted({e["kind"] for e in recipe.engines} - set(LOCAL_KINDS))
    if missing:
        needs = "; ".join(f"engine `{kind}` needs {NEEDS.get(kind, 'a GPU')}" for kind in missing)
        raise RecipeUnavailable(
            f"recipe {recipe.path} cannot run on this machine: {needs}. "
            f"kvgate up runs recipes of {' and '.join(LOCAL_KINDS)} engines; run this one's node*.toml with "
            "`kvgate agent --config` on nodes that have the engine, and its gateway.toml with "
            "`kvgate extproc --config`"
        )


def gateway_overlay(recipe: Recipe, *, dev_auth: bool) -> dict[str, Any]:
    """The recipe's gateway config as a ``--config`` overlay: the launcher's keys dropped, a relative
    policy file made absolute (in the recipe's directory); validated (:class:`ConfigError`)."""
    tree: dict[str, Any] = {}
    for key, value in recipe.gateway.items():
        taken = overlay.LAUNCHER_KEYS.get(key, ())
        if taken is None:
            continue  # the whole section is the launcher's
        if taken and isinstance(value, Mapping):
            value = {k: v for k, v in value.items() if k not in taken}
            if not value:
                continue
        tree[key] = value
    policy = tree.get("policy")
    if isinstance(policy, Mapping) and isinstance(policy.get("file"), str):
        tree["policy"] = {**policy, "file": str((recipe.path / policy["file"]).resolve())}
    try:
        overlay.check(tree, dev_auth=dev_auth)
        from extproc.config import parse_config

        parse_config(tree)
    except ConfigError as exc:
        raise ConfigError(f"{recipe.path / 'gateway.toml'}: {exc}") from exc
    return tree


def local_nodes(recipe: Recipe) -> tuple[tuple[dict[str, Any], ...], dict[str, Any]]:
    """Per local agent (one per ``[[engines]]`` table) its engine table without the launcher's keys, and
    the ``[agent]`` keys kept from the first node config."""
    tables = tuple({k: v for k, v in e.items() if k not in _ENGINE_LOCAL} for e in recipe.engines)
    agent = recipe.nodes[0][1].get("agent", {})
    kept = {k: v for k, v in agent.items() if k in _AGENT_KEPT} if isinstance(agent, Mapping) else {}
    return tables, kept
