from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from contracts.errors import ConfigError
from engines import kinds as kinds_module
from engines.config import KV_OFFLOADS, EngineConfig
from engines.kind import EngineKind, RenderContext, Rendered
from engines.kinds import (
    ENGINE_KINDS,
    KINDS,
    KV_EVENT_KINDS,
    OFFLOAD_MATRIX,
    ROLES,
    check_combination,
    metric_names,
)
from engines.metrics import MetricNames
from engines.vllm import METRICS as VLLM_METRICS

README = Path(kinds_module.__file__).with_name("README.md").read_text()


def table_rows(heading: str) -> dict[str, list[str]]:
    """The rows of the first table after ``heading`` in engines/README.md, by their first cell."""
    section = README[README.index(heading) :]
    rows: dict[str, list[str]] = {}
    for line in section[section.index("\n|") + 1 :].splitlines():
        if not line.startswith("|"):
            break
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_the_kinds_in_their_order() -> None:
    assert ENGINE_KINDS == ("vllm", "sglang", "trtllm", "llama_cpp", "openai_compat", "sim")
    assert ROLES == ("both", "prefill", "decode")


@pytest.mark.parametrize("name", ENGINE_KINDS)
def test_each_kind_is_its_module_and_named_by_its_key(name: str) -> None:
    kind = KINDS[name]
    assert kind.name == name
    assert importlib.import_module(f"engines.{name}").KIND is kind


@pytest.mark.parametrize("name", ENGINE_KINDS)
def test_each_kind_has_paths_and_metric_names(name: str) -> None:
    kind = KINDS[name]
    assert kind.health_path.startswith("/") and kind.metrics_path.startswith("/")
    assert isinstance(kind.metrics, MetricNames) and kind.metrics.waiting and kind.metrics.running
    assert metric_names(name) is kind.metrics


def test_metric_names_fall_back_to_vllm() -> None:
    assert metric_names("no-such-engine") == VLLM_METRICS == metric_names("vllm")
    assert metric_names("") == VLLM_METRICS


@pytest.mark.parametrize("name", ENGINE_KINDS)
def test_matrix_cells_are_roles_and_offloads(name: str) -> None:
    offloads = KINDS[name].offloads
    assert offloads and set(offloads) <= set(ROLES)
    assert all(allowed and set(allowed) <= set(KV_OFFLOADS) for allowed in offloads.values())
    assert OFFLOAD_MATRIX[name] == offloads
    assert "none" in offloads.get("both", ())  # every kind runs plain, aggregated


def test_derived_tables() -> None:
    assert tuple(OFFLOAD_MATRIX) == ENGINE_KINDS
    assert KV_EVENT_KINDS == ("vllm", "sglang", "sim")
    assert [n for n, k in KINDS.items() if k.remote_only] == ["openai_compat"]
    assert all(k.render is not None for k in KINDS.values() if not k.remote_only)


def test_kinds_are_frozen() -> None:
    kind = KINDS["vllm"]
    with pytest.raises(AttributeError):
        kind.name = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        kind.offloads["both"] = ()  # type: ignore[index]


@pytest.mark.parametrize(
    ("kind", "role", "offload", "side"),
    [
        ("vllm", "both", "none", False),
        ("vllm", "both", "lmcache", False),
        ("vllm", "both", "nixl", True),
        ("vllm", "prefill", "kvbm", True),
        ("vllm", "decode", "nixl", True),
        ("sglang", "both", "hicache", False),
        ("sglang", "prefill", "nixl", True),
        ("sglang", "decode", "nixl", False),
        ("trtllm", "both", "none", False),
        ("llama_cpp", "both", "none", False),
        ("openai_compat", "both", "none", False),
        ("sim", "both", "none", False),
    ],
)
def test_side_port_predicates(kind: str, role: str, offload: str, side: bool) -> None:
    engine = EngineConfig(id="e", kind=kind, model="m", model_path="x", role=role, kv_offload=offload)
    assert KINDS[kind].side_port(engine) is side


def test_check_combination_messages() -> None:
    check_combination("sglang", "decode", "hicache", "e")
    with pytest.raises(ConfigError, match=r"^e\.kind: expected one of vllm, sglang, trtllm, llama_cpp"):
        check_combination("tgi", "both", "none", "e")
    with pytest.raises(ConfigError) as info:
        check_combination("trtllm", "prefill", "none", "engines[2]", role_from="agent.role")
    assert str(info.value) == (
        "engines[2].role: 'prefill' (inherited from agent.role) is not supported by trtllm; allowed: both"
    )
    with pytest.raises(ConfigError, match=r"'kvbm' is not supported by sglang; allowed: none, nixl, hicache"):
        check_combination("sglang", "both", "kvbm", "e")
    with pytest.raises(ConfigError, match=r"with role 'decode'; allowed: nixl$"):
        check_combination("vllm", "decode", "lmcache", "e")


def test_registry_refuses_duplicates_and_bad_rows() -> None:
    def render(ctx: RenderContext) -> Rendered:
        return ctx.rendered([], {})

    names = MetricNames("w", "r", None)
    good = EngineKind("k", names, "/health", "/metrics", False, {"both": ("none",)}, render)
    assert dict(kinds_module._registry([good])) == {"k": good}
    with pytest.raises(ValueError, match="registered twice"):
        kinds_module._registry([good, good])
    for row in ({"sideways": ("none",)}, {"both": ("swap",)}):
        bad = EngineKind("b", names, "/health", "/metrics", False, row, render)
        with pytest.raises(ValueError, match="bad offload matrix row"):
            kinds_module._registry([bad])


def test_readme_tables_match_the_registry() -> None:
    kinds = table_rows("## The kinds")
    assert list(kinds) == ["kind", "---", *ENGINE_KINDS]
    for name, kind in KINDS.items():
        waiting, running, kv, health, metrics, events, started = kinds[name]
        assert (waiting, running, kv or "-") == (kind.metrics.waiting, kind.metrics.running,
                                                 kind.metrics.kv_usage or "-")  # fmt: skip
        assert (health, metrics) == (kind.health_path, kind.metrics_path)
        assert events.startswith("yes" if kind.kv_events else "no")
        assert started.startswith("no" if kind.remote_only else "yes")
    matrix = table_rows("### KV offload x role")
    assert list(matrix) == ["kind", "---", *ENGINE_KINDS]
    for name, kind in KINDS.items():
        for role, cell in zip(ROLES, matrix[name], strict=True):
            listed = cell.split(" (")[0]
            assert listed == (", ".join(kind.offloads[role]) if role in kind.offloads else "-"), (name, role)
