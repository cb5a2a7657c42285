"""GGUF -> Hugging-Face-style model directory: the real SmolLM2 file and small synthetic GGUF files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFWriter, TokenType
from tokenizers import Tokenizer, pre_tokenizers

from engines.gguf import MARKER, GGUFExportError, build_tokenizer, ensure_model_dir, main, smollm2_gguf_path
from engines.gguf import GGUFTokenizerSpec as Spec

SMOLLM2_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<repo_name>",
    "<reponame>",
    "<file_sep>",
    "<filename>",
    "<gh_stars>",
    "<issue_start>",
    "<issue_comment>",
    "<issue_closed>",
    "<jupyter_start>",
    "<jupyter_text>",
    "<jupyter_code>",
    "<jupyter_output>",
    "<jupyter_script>",
    "<empty_output>",
]


def test_smollm2_gguf_is_found_without_importing_the_package(smollm2_gguf: Path) -> None:
    assert smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2_gguf == smollm2_gguf_path()


def test_export_writes_vocab_and_special_tokens(smollm2_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 49152
    added = tokenizer.get_added_tokens_decoder()
    assert [added[i].content for i in sorted(added)] == SMOLLM2_SPECIALS
    assert all(
        t.special and not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added.values()
    )
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"], config["unk_token"], config["pad_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<|im_end|>",
    )
    assert config["add_bos_token"] is False
    assert config["model_max_length"] == 8192
    assert config["chat_template"].startswith("{% for message in messages %}")


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("12345", ["1", "2", "3", "4", "5"]),
        ("Hello world", ["Hello", "Ġworld"]),
        ("year 2024!", ["year", "Ġ", "2", "0", "2", "4", "!"]),
        ("<|im_start|>user\nhi<|im_end|>", ["<|im_start|>", "user", "Ċ", "hi", "<|im_end|>"]),
    ],
)
def test_known_strings_tokenize_like_llama_cpp(smollm2_dir: Path, text: str, tokens: list[str]) -> None:
    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    encoding = tokenizer.encode(text, add_special_tokens=True)
    assert encoding.tokens == tokens
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == text


def test_transformers_loads_the_directory(smollm2_dir: Path, hf_tokenizer: Any) -> None:
    assert len(hf_tokenizer) == 49152
    assert hf_tokenizer.bos_token == "<|im_start|>"
    assert hf_tokenizer.eos_token_id == 2
    assert hf_tokenizer.model_max_length == 8192
    text = "Zürich 🙂 has 3 lakes\n\n  and 42 bridges"
    ids = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json")).encode(text).ids
    assert hf_tokenizer(text, add_special_tokens=True)["input_ids"] == ids
    assert hf_tokenizer.decode(ids) == text


def test_ensure_model_dir_reuses_a_current_export(smollm2_gguf: Path, smollm2_dir: Path) -> None:
    before = (smollm2_dir / "tokenizer.json").stat().st_mtime_ns
    assert ensure_model_dir(smollm2_gguf, cache_root=smollm2_dir.parent) == smollm2_dir
    assert (smollm2_dir / "tokenizer.json").stat().st_mtime_ns == before


def _write_gguf(path: Path, *, pre: str = "smollm", add_bos: bool = False, add_eos: bool = False) -> Path:
    """A tokenizer-only GGUF: the 256 byte-level symbols, a few merges, two control tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["h e", "l l", "he ll", "hell o"]
    tokens = ["<s>", "</s>", *alphabet, "he", "ll", "hell", "hello", "<tool>"]
    types = [TokenType.CONTROL] * 2 + [TokenType.NORMAL] * (len(tokens) - 3) + [TokenType.USER_DEFINED]
    writer = GGUFWriter(path, arch="llama")
    writer.add_context_length(4096)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("add_bos", "add_eos", "expected"),
    [(False, False, ["hello"]), (True, False, ["<s>", "hello"]), (True, True, ["<s>", "hello", "</s>"])],
)
def test_bos_eos_post_processor_follows_the_gguf_flags(
    tmp_path: Path, add_bos: bool, add_eos: bool, expected: list[str]
) -> None:
    spec = Spec.read(_write_gguf(tmp_path / "tiny.gguf", add_bos=add_bos, add_eos=add_eos))
    tokenizer = build_tokenizer(spec)
    assert tokenizer.encode("hello", add_special_tokens=True).tokens == expected
    assert tokenizer.encode("hello", add_special_tokens=False).tokens == ["hello"]
    added = tokenizer.get_added_tokens_decoder()
    assert {t.content: t.special for t in added.values()} == {"<s>": True, "</s>": True, "<tool>": False}


def test_unsupported_pre_tokenizer_is_refused(tmp_path: Path) -> None:
    spec = Spec.read(_write_gguf(tmp_path / "llama3.gguf", pre="llama-bpe"))
    with pytest.raises(GGUFExportError, match="llama-bpe"):
        build_tokenizer(spec)


def test_cli_exports_and_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gguf_path = _write_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    assert main([str(gguf_path), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "tokenizer.json", "tokenizer_config.json"]
    assert main([str(gguf_path), str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    assert main([str(gguf_path), str(out), "--force"]) == 0
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    assert main([str(gguf_path), str(foreign), "--force"]) == 2
    assert (foreign / "keep.txt").exists()
    assert main([str(_write_gguf(tmp_path / "bad.gguf", pre="qwen2")), str(tmp_path / "out2")]) == 1
    assert not (tmp_path / "out2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_ensure_model_dir_replaces_a_stale_export(tmp_path: Path) -> None:
    gguf_path = _write_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    first = ensure_model_dir(gguf_path, cache_root=cache)
    assert first == cache / "tiny"
    marker = json.loads((first / MARKER).read_text())
    (first / MARKER).write_text(json.dumps({**marker, "size": 1}))
    (first / "tokenizer.json").write_text("{}")
    assert ensure_model_dir(gguf_path, cache_root=cache) == first
    assert Tokenizer.from_file(str(first / "tokenizer.json")).get_vocab_size() == 263
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == ["tiny"]  # no stale or temporary copy


def test_ensure_model_dir_defaults_to_kvgate_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_CACHE", str(tmp_path / "kv"))
    gguf_path = _write_gguf(tmp_path / "tiny.gguf")
    assert ensure_model_dir(gguf_path) == tmp_path / "kv" / "models" / "tiny"


def test_missing_metadata_is_a_clear_error(tmp_path: Path) -> None:
    writer = GGUFWriter(tmp_path / "empty.gguf", arch="llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFExportError, match=r"tokenizer\.ggml\.model"):
        Spec.read(tmp_path / "empty.gguf")
