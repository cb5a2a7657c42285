"""The splicing core: two tries of one stream become one well-formed SSE stream (in memory)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from extproc.migration.splice import DONE, Splicer


def sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def chat_try(
    rid: str, created: int, words: list[str], prompt: int, *, final: bool, usage: bool = True
) -> bytes:
    """A vLLM-shaped chat stream with per-chunk usage: role chunk, one chunk per word, then (``final``)
    the finish chunk, the usage chunk and [DONE]."""
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": "m"}

    def use(n: int) -> dict[str, Any]:
        return (
            {"usage": {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}}
            if usage
            else {}
        )

    out = [sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], **use(0)})]
    for i, w in enumerate(words, 1):
        out.append(
            sse({**head, "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}], **use(i)})
        )
    if final:
        n = len(words)
        out.append(sse({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], **use(n)}))
        if usage:
            out.append(sse({**head, "choices": [], **use(n)}))
        out.append(DONE)
    return b"".join(out)


def events(stream: bytes) -> list[Any]:
    out: list[Any] = []
    for event in stream.split(b"\n\n"):
        if event:
            assert event.startswith(b"data: ")
            data = event[6:]
            out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


def text_of(evs: list[Any]) -> str:
    return "".join(
        c["delta"].get("content") or "" for e in evs if isinstance(e, dict) for c in e.get("choices", [])
    )


@pytest.mark.parametrize("cut", [0, 7, 13])
def test_two_tries_make_one_stream(cut: int) -> None:
    """The first try dies inside an event; the continuation's ids, role chunk and usage are rewritten."""
    s = Splicer(chat=True, include_usage=True, continuous_usage=False)
    first = chat_try("a", 100, ["Hel", "lo", " wor"], prompt=10, final=False)
    torn = first + sse({"id": "a", "choices": [{"index": 0, "delta": {"content": "LOST"}}]})[: cut + 5]
    out = b""
    for i in range(0, len(torn), 9):  # arbitrary framing
        out += s.feed(torn[i : i + 9])
    assert s.text == "Hello wor" and s.produced == 3 and not s.done
    s.next_try()
    # The continuation's prompt holds the partial answer (3 more tokens); it makes 2 tokens.
    out += s.feed(chat_try("b", 200, ["ld", "!"], prompt=13, final=True))
    evs = events(out)
    assert evs.count("[DONE]") == 1 and evs[-1] == "[DONE]"
    chunks = [e for e in evs if isinstance(e, dict)]
    assert {(c["id"], c["created"], c["model"]) for c in chunks} == {("a", 100, "m")}
    roles = [c for c in chunks for ch in c["choices"] if "role" in ch["delta"]]
    assert len(roles) == 1
    assert text_of(evs) == "Hello world!"
    (usage,) = [c["usage"] for c in chunks if "usage" in c]
    assert usage == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    assert next(c for c in chunks if not c["choices"])["usage"] == usage


def test_usage_only_when_asked() -> None:
    s = Splicer(chat=True, include_usage=False, continuous_usage=False)
    out = s.feed(chat_try("a", 1, ["x", "y"], prompt=4, final=True))
    chunks = [e for e in events(out) if isinstance(e, dict)]
    assert all("usage" not in c for c in chunks) and all(c["choices"] for c in chunks)
    assert s.done and s.produced == 2


def test_continuous_usage_counts_every_try() -> None:
    s = Splicer(chat=True, include_usage=True, continuous_usage=True)
    s.feed(chat_try("a", 1, ["x", "y"], prompt=4, final=False))
    s.next_try()
    out = s.feed(chat_try("b", 2, ["z"], prompt=6, final=True))
    chunks = [e for e in events(out) if isinstance(e, dict)]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [3, 3, 3]  # z, finish, usage chunk
    assert all(c["usage"]["prompt_tokens"] == 4 for c in chunks)


def test_an_engine_without_usage_counts_chunks() -> None:
    s = Splicer(chat=True, include_usage=False, continuous_usage=False)
    s.feed(chat_try("a", 1, ["x", "y", "z"], prompt=4, final=False, usage=False))
    assert s.produced == 3


def test_closing_when_the_limit_is_reached_at_the_seam() -> None:
    s = Splicer(chat=True, include_usage=True, continuous_usage=False)
    s.feed(chat_try("a", 1, ["x", "y"], prompt=4, final=False))
    evs = events(s.closing())
    assert evs[-1] == "[DONE]" and evs[0]["choices"][0]["finish_reason"] == "length"
    assert evs[1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    assert s.done


def test_completions_text_and_error_event() -> None:
    s = Splicer(chat=False, include_usage=False, continuous_usage=False)
    head = {"id": "c", "object": "text_completion", "created": 5, "model": "m"}
    s.feed(sse({**head, "choices": [{"index": 0, "text": "ab", "finish_reason": None}]}))
    s.next_try()
    out = s.feed(sse({**head, "id": "d", "choices": [{"index": 0, "text": "cd", "finish_reason": "stop"}]}))
    (chunk,) = events(out)
    assert chunk["id"] == "c" and s.text == "abcd" and s.finish_reason == "stop"
    err = events(s.error("gone"))
    assert err[0]["error"]["code"] == 503 and err[1] == "[DONE]"


def test_an_in_band_error_passes_and_is_noted() -> None:
    s = Splicer(chat=True, include_usage=False, continuous_usage=False)
    out = s.feed(b'data: {"error": {"message": "boom", "code": 500}}\n\n: keep-alive\n\n')
    assert s.errored and events(out)[0]["error"]["message"] == "boom"
