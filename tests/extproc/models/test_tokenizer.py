"""SegmentTokenizer.encode equals whole-text tokenization (the engine's) and re-tokenizes only new pieces."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, processors

from extproc.models.template import ChatTemplate
from extproc.models.tokenizer import CacheLimits, SegmentTokenizer

SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<repo_name>",
    "<reponame>",
    "<|im_start|",
    "<",
    "|>",
]
PIECES = st.one_of(
    st.text(max_size=12),
    st.text(alphabet="0123456789 \t\n\r\u00a0\u3000.,'sl", max_size=12),
    st.sampled_from([*SPECIALS, "   ", "\n\n", " 42", "'s", "🙂👍🏽", "日本語", "Zürich", "\r\n"]),
)
TEXT = st.lists(PIECES, max_size=12).map("".join)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT})
FAST = settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def shared_tokenizer(smollm2_dir: Path) -> SegmentTokenizer:
    """One tokenizer for a whole hypothesis run, so later examples also exercise cache hits."""
    return SegmentTokenizer.from_file(smollm2_dir, CacheLimits(max_entries=64, max_tokens=2_000))


@pytest.fixture(scope="module")
def template(smollm2_dir: Path) -> ChatTemplate:
    return ChatTemplate.from_model_dir(smollm2_dir)


@FAST
@given(messages=st.lists(MESSAGE, min_size=1, max_size=5), add_generation_prompt=st.booleans())
def test_rendered_conversations_encode_like_whole_text(
    shared_tokenizer: SegmentTokenizer,
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> None:
    text = template.render(messages, add_generation_prompt=add_generation_prompt)
    assert shared_tokenizer.encode(text, False) == shared_tokenizer.encode_whole(text, False)


@FAST
@given(text=TEXT, add_special_tokens=st.booleans())
def test_raw_strings_encode_like_whole_text(
    shared_tokenizer: SegmentTokenizer, text: str, add_special_tokens: bool
) -> None:
    assert shared_tokenizer.encode(text, add_special_tokens) == shared_tokenizer.encode_whole(
        text, add_special_tokens
    )


def test_follow_up_turn_tokenizes_only_new_segments(
    smollm2_tokenizer: SegmentTokenizer, template: ChatTemplate
) -> None:
    history = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three prime numbers above 100."},
    ]
    first = template.render(history, add_generation_prompt=True)
    smollm2_tokenizer.encode(first, False)
    after_first = smollm2_tokenizer.stats
    follow_up = [
        *history,
        {"role": "assistant", "content": "101, 103, 107."},
        {"role": "user", "content": "More?"},
    ]
    second = template.render(follow_up, add_generation_prompt=True)
    ids = smollm2_tokenizer.encode(second, False)
    assert ids == smollm2_tokenizer.encode_whole(second, False)

    old = {p for p in smollm2_tokenizer.split(first) if isinstance(p, str)}
    pieces = [p for p in smollm2_tokenizer.split(second) if isinstance(p, str)]
    new = set(pieces) - old
    assert new == {"assistant\n101, 103, 107.", "user\nMore?"}  # "assistant\n" (prompt) and "\n" are cached
    stats = smollm2_tokenizer.stats
    assert stats.misses - after_first.misses == len(new)
    assert stats.miss_tokens - after_first.miss_tokens == sum(
        len(smollm2_tokenizer.encode_whole(p, False)) for p in new
    )
    assert stats.hits - after_first.hits == len(pieces) - len(new)
    assert stats.whole == 0


CHAT_IDS_CASES = [
    [{"role": "user", "content": "Hi there! 2 + 2 = ?"}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Zürich 🙂\n\n  1234"},
        {"role": "assistant", "content": "Grüezi <|im_end|> ok"},
        {"role": "user", "content": "again"},
    ],
    [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part 2"}]}],
]


@pytest.mark.parametrize("messages", CHAT_IDS_CASES)
def test_ids_equal_transformers_apply_chat_template(
    smollm2_tokenizer: SegmentTokenizer,
    template: ChatTemplate,
    hf_tokenizer: Any,
    messages: list[dict[str, Any]],
) -> None:
    ids = smollm2_tokenizer.encode(template.render(messages, add_generation_prompt=True), False)
    hf_messages = [
        {**m, "content": "\n".join(p["text"] for p in m["content"])} if isinstance(m["content"], list) else m
        for m in messages
    ]
    reference = hf_tokenizer.apply_chat_template(hf_messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(reference, list):  # transformers 5 returns a BatchEncoding
        reference = reference["input_ids"]
    assert ids == list(reference)


def _variant(smollm2_dir: Path, edit: Any) -> Tokenizer:
    spec = json.loads((smollm2_dir / "tokenizer.json").read_text(encoding="utf-8"))
    edit(spec)
    return Tokenizer.from_str(json.dumps(spec))


def _lstrip_im_end(spec: dict[str, Any]) -> None:
    spec["added_tokens"][2]["lstrip"] = True


def _metaspace_first(spec: dict[str, Any]) -> None:
    spec["pre_tokenizer"] = {
        "type": "Metaspace",
        "replacement": "▁",
        "prepend_scheme": "first",
        "split": True,
    }


def _normalized_with_normalizer(spec: dict[str, Any]) -> None:
    spec["normalizer"] = {"type": "NFKC"}
    spec["added_tokens"][1]["normalized"] = True


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (_lstrip_im_end, "lstrip"),
        (_metaspace_first, "prepend_scheme=first"),
        (_normalized_with_normalizer, "normaliz"),
    ],
)
def test_inexact_tokenizers_fall_back_to_whole_text(
    smollm2_dir: Path, caplog: pytest.LogCaptureFixture, edit: Any, reason: str
) -> None:
    with caplog.at_level(logging.WARNING, logger="extproc.models.tokenizer"):
        tokenizer = SegmentTokenizer(_variant(smollm2_dir, edit), name="variant")
    assert not tokenizer.exact and reason in (tokenizer.fallback_reason or "")
    assert [r.getMessage() for r in caplog.records if "segment tokenization disabled" in r.getMessage()]
    text = "<|im_start|>user\n  hi   <|im_end|>\n"
    assert tokenizer.encode(text, True) == tokenizer.encode_whole(text, True)
    assert tokenizer.stats.whole == 1 and tokenizer.stats.misses == 0


OVERLAPPING = st.sampled_from(["abcd", "bc", "xyz", "<tool>", "<tool", "ol>", "a", "d"])


@pytest.fixture(scope="module")
def extended_tokenizer(smollm2_dir: Path) -> SegmentTokenizer:
    """SmolLM2 plus BOS/EOS post-processing, raw added tokens that overlap or prefix each other
    (leftmost-longest), and normalized ones that are only matched inside the pieces the raw ones leave
    (tokenizers' two-pass extraction)."""
    backend = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    backend.add_tokens([AddedToken("abcd", normalized=True), AddedToken("xyz", normalized=True)])
    backend.add_special_tokens([AddedToken(t, normalized=False) for t in ("bc", "<tool>", "<tool", "ol>")])
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A <|im_end|>", special_tokens=[("<|im_start|>", 1), ("<|im_end|>", 2)]
    )
    return SegmentTokenizer(backend, name="extended")


@FAST
@given(pieces=st.lists(st.one_of(PIECES, OVERLAPPING), max_size=12), add_special_tokens=st.booleans())
def test_two_pass_extraction_and_post_processor_are_exact(
    extended_tokenizer: SegmentTokenizer, pieces: list[str], add_special_tokens: bool
) -> None:
    text = "".join(pieces)
    assert extended_tokenizer.exact
    assert extended_tokenizer.encode(text, add_special_tokens) == extended_tokenizer.encode_whole(
        text, add_special_tokens
    )


def test_empty_text_and_special_tokens_edges(extended_tokenizer: SegmentTokenizer) -> None:
    assert extended_tokenizer.encode("", True) == extended_tokenizer.encode_whole("", True) == [1, 2]
    assert extended_tokenizer.encode("", False) == []
    assert extended_tokenizer.encode("abcd", False) == extended_tokenizer.encode_whole("abcd", False)


def test_encode_special_tokens_flag_is_respected(smollm2_dir: Path) -> None:
    backend = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    backend.encode_special_tokens = True
    tokenizer = SegmentTokenizer(backend)
    text = "<|im_start|>user\nhi<|im_end|>"
    assert tokenizer.exact
    assert tokenizer.encode(text, False) == tokenizer.encode_whole(text, False)
    assert 1 not in tokenizer.encode(text, False)


def test_cache_is_bounded(smollm2_dir: Path) -> None:
    tokenizer = SegmentTokenizer.from_file(smollm2_dir, CacheLimits(max_entries=3, max_tokens=20))
    for i in range(10):
        text = f"<|im_start|>user\nmessage number {i} with a few words<|im_end|>\n"
        assert tokenizer.encode(text, False) == tokenizer.encode_whole(text, False)
        stats = tokenizer.stats
        assert stats.entries <= 3 and stats.cached_tokens <= 20
    long_text = "word " * 100  # 100 tokens: more than the whole cache holds, so never cached
    before = tokenizer.stats.misses
    tokenizer.encode(long_text, False)
    tokenizer.encode(long_text, False)
    assert tokenizer.stats.misses - before == 2
    tokenizer.clear_cache()
    assert tokenizer.stats.entries == 0 and tokenizer.stats.cached_tokens == 0


def test_cache_bounds_the_characters_it_holds(smollm2_dir: Path) -> None:
    # SmolLM2 has a token of 80 "#": a piece "user\n<i>" + 400 of them is 9 tokens, so the token bound
    # alone (100 here) would keep 11 such pieces, over 4,000 characters: the text is held to 8 characters
    # a token of the bound (800).
    limits = CacheLimits(max_entries=1000, max_tokens=100)
    tokenizer = SegmentTokenizer.from_file(smollm2_dir, limits)
    for i in range(20):
        text = f"<|im_start|>user\n{i}{'#' * 80 * 5}<|im_end|>\n"
        assert tokenizer.encode(text, False) == tokenizer.encode_whole(text, False)
        stats = tokenizer.stats
        assert stats.cached_tokens <= 100 and stats.cached_chars <= limits.max_chars == 800
    assert sum(map(len, tokenizer._cache)) == tokenizer.stats.cached_chars
    assert tokenizer.stats.entries >= 2  # what fits is still cached (the last piece and "\n")
    tokenizer.clear_cache()
    assert tokenizer.stats.cached_chars == 0


def test_helpers(smollm2_tokenizer: SegmentTokenizer) -> None:
    text = "<|im_start|>user\nhello 42<|im_end|>"
    ids = smollm2_tokenizer.encode(text, False)
    assert smollm2_tokenizer.token_count(text, False) == len(ids)
    assert smollm2_tokenizer.decode(ids) == text
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=True) == "user\nhello 42"
    assert smollm2_tokenizer.split(text) == [1, "user\nhello 42", 2]
    assert smollm2_tokenizer.vocab_size == 49152


PIECES = ["hello world ", "12345 ", "<|im_start|>", "<|im_end|>", "\n", "émoji 🎉 "]


@FAST
@given(parts=st.lists(st.sampled_from(PIECES), max_size=60), limit=st.integers(0, 80), special=st.booleans())
def test_encode_prefix_is_a_prefix_of_encode(
    shared_tokenizer: SegmentTokenizer, parts: list[str], limit: int, special: bool
) -> None:
    tok = shared_tokenizer
    text = "".join(parts)
    full = tok.encode(text, add_special_tokens=special)
    ids, count = tok.encode_prefix(text, add_special_tokens=special, limit=limit)
    assert ids == full[: len(ids)]
    assert len(ids) >= min(limit, len(full))
    if len(ids) == len(full):
        assert count == len(full)


def test_estimate_counts_added_tokens_once(
    smollm2_tokenizer: SegmentTokenizer, template: ChatTemplate
) -> None:
    # A chat of many short turns is 1/3 added tokens: the characters left are estimated at the ratio of
    # the ordinary pieces' ids to their characters, the added tokens left counted apart (counting the ones
    # taken in that ratio too made the estimate ~30% long).
    turns = [{"role": ("user", "assistant")[i % 2], "content": "ok ok ok"} for i in range(200)]
    messages = [{"role": "system", "content": "ok ok ok"}, *turns]  # no default (prose) system prompt
    text = template.render(messages, add_generation_prompt=True)
    exact = len(smollm2_tokenizer.encode(text, False))
    for want in (64, 256):
        cursor = smollm2_tokenizer.cursor(text, False)
        cursor.advance(want)
        assert not cursor.done
        assert abs(cursor.estimate() - exact) <= 0.05 * exact
