"""extproc.models.registry: served models from model directories and GGUF files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from contracts.errors import ConfigError
from extproc.errors import NotFound
from extproc.models.registry import ModelAssets, ModelRegistry
from tests.engines.test_gguf import _write_gguf


@dataclass(frozen=True)
class Source:
    name: str
    model_dir: str | None = None
    gguf: str | None = None
    chat_template: str | None = None
    max_model_len: int | None = None


def test_model_registry_loads_dirs_and_ggufs(
    tmp_path: Path, smollm2_dir: Path, tools_template_path: Path
) -> None:
    tiny = _write_gguf(tmp_path / "tiny.gguf")
    registry = ModelRegistry.from_config(
        [
            Source("smol", model_dir=str(smollm2_dir)),
            Source("smol-tools", model_dir=str(smollm2_dir), chat_template=str(tools_template_path)),
            Source("tiny", gguf=str(tiny)),
        ],
        cache_root=tmp_path / "cache",
    )
    assert sorted(registry) == ["smol", "smol-tools", "tiny"]
    smol = registry.get_model("smol")
    assert isinstance(smol, ModelAssets) and smol.tokenizer.exact
    assert registry.find("nope") is None
    assert "<functions>" in registry["smol-tools"].template.render([{"role": "user", "content": "hi"}], [{}])
    assert registry.get_model("tiny").template.render([{"role": "user", "content": "hello"}]) == "hello"
    with pytest.raises(NotFound) as info:
        registry.get_model("gpt-9")
    assert info.value.status == 404 and info.value.message == "The model `gpt-9` does not exist."
    with pytest.raises(ConfigError, match="twice"):
        ModelRegistry([smol, smol])
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        ModelAssets.load("empty", tmp_path)
    with pytest.raises(ConfigError, match="cannot export"):
        ModelRegistry.from_config([Source("bad", gguf=str(_write_gguf(tmp_path / "q.gguf", pre="qwen2")))])
