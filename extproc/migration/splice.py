"""Splicing the tries of one streamed request into the one SSE stream its client sees (sans-IO).

:class:`Splicer` is fed the engine's bytes as they come (:meth:`Splicer.feed`) and returns the bytes
to send on; :meth:`Splicer.next_try` marks a seam (a continuation on another replica begins). It
keeps what a continuation needs: the text sent so far and the tokens produced. Only whole events are
passed on, so a try cut inside an event loses nothing the client saw. The rules (README.md):

* every chunk carries the first try's ``id``, ``created``, ``model`` and ``system_fingerprint``;
* a continuation's opening chunk (its ``role`` with empty content) is dropped, and ``role`` is removed
  from its deltas: the client got one role at the start;
* usage is the whole request's: ``prompt_tokens`` the client's prompt (the first try's count; the
  continuation's prompt holds the answer's start too), ``completion_tokens`` every try's tokens,
  ``total_tokens`` their sum. Per-chunk usage (the engine is always asked for it, to count tokens)
  reaches the client only with ``continuous_usage_stats``; the final usage chunk only with
  ``include_usage``;
* ``[DONE]`` once, from the try that finished (or :meth:`Splicer.closing` when the length limit was
  reached exactly at a seam).
"""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


class Splicer:
    """One streamed request's state across its tries (module docstring). ``chat``: a chat completion
    (text in ``delta.content``) rather than a completion (``text``); ``include_usage`` /
    ``continuous_usage``: what the client asked in ``stream_options``."""

    def __init__(self, *, chat: bool, include_usage: bool, continuous_usage: bool) -> None:
        self.chat = chat
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage
        self.tries = 0
        self.done = False
        self.finish_reason: str | None = None
        self.errored = False
        self.sent_any = False
        self._buf = b""
        self._parts: list[str] = []
        self._head: dict[str, Any] | None = None
        self._prompt_tokens: int | None = None
        self._before = 0
        self._this = 0
        self._this_counted = 0
        self._usage_extra: dict[str, Any] = {}

    @property
    def text(self) -> str:
        """Everything the client got as answer text so far."""
        return "".join(self._parts)

    @property
    def produced(self) -> int:
        """Tokens produced so far, over every try (per the engines' usage; chunks counted without it)."""
        return self._before + self._this

    def next_try(self) -> None:
        """A try failed; the next one continues the answer (its events get the seam's treatment)."""
        self.tries += 1
        self._before += self._this
        self._this = self._this_counted = 0
        self._buf = b""

    def feed(self, data: bytes) -> bytes:
        """The engine's next bytes; the bytes to send the client (whole events only)."""
        self._buf += data.replace(b"\r\n", b"\n")
        out: list[bytes] = []
        while True:
            end = self._buf.find(b"\n\n")
            if end < 0:
                break
            event, self._buf = self._buf[:end], self._buf[end + 2 :]
            sent = self._event(event)
            if sent:
                out.append(sent)
        if out:
            self.sent_any = True
        return b"".join(out)

    def closing(self) -> bytes:
        """The end of a stream whose length limit was reached at a seam (or whose last try finished
        but died before ``[DONE]``): a final chunk when none came, the usage chunk when asked, ``[DONE]``."""
        out: list[bytes] = []
        if self.finish_reason is None:
            self.finish_reason = "length"
            empty: dict[str, Any] = {"content": ""} if self.chat else {}
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
            if self.chat:
                choice["delta"] = empty
            else:
                choice["text"] = ""
            out.append(self._frame({**self._header(), "choices": [choice]}))
        if self.include_usage:
            out.append(self._frame({**self._header(), "choices": [], "usage": self._usage({})}))
        out.append(DONE)
        self.done = True
        return b"".join(out)

    def error(self, message: str, code: int = 503) -> bytes:
        """An in-stream error event (vLLM's shape) then ``[DONE]``: the request is lost."""
        body = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": code}}
        self.done = True
        return self._frame(body) + DONE

    # -- one event --------------------------------------------------------------------------------------

    def _event(self, event: bytes) -> bytes | None:
        data = b"".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
        if not data:
            return None  # a comment or keep-alive
        if data == b"[DONE]":
            self.done = True
            return DONE
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return event + b"\n\n"  # not ours to judge: passed on as it came
        if not isinstance(chunk, dict):
            return event + b"\n\n"
        if "error" in chunk:
            self.errored = True
            return event + b"\n\n"
        return self._chunk(chunk)

    def _chunk(self, chunk: dict[str, Any]) -> bytes | None:
        if self._head is None:
            self._head = {
                k: chunk.get(k) for k in ("id", "created", "model", "system_fingerprint") if k in chunk
            }
        else:
            chunk.update(self._head)
        usage = chunk.pop("usage", None)
        if isinstance(usage, dict):
            self._count(usage)
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return self._frame(chunk)
        if not choices:  # the final usage chunk
            if not self.include_usage or not isinstance(usage, dict):
                return None
            chunk["usage"] = self._usage(usage)
            return self._frame(chunk)
        content = False
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            piece = self._piece(choice)
            if piece:
                self._parts.append(piece)
                content = True
            reason = choice.get("finish_reason")
            if reason is not None:
                self.finish_reason = str(reason)
        if content and not isinstance(usage, dict):
            self._this_counted += 1  # an engine without per-chunk usage: one token per chunk
            self._this = max(self._this, self._this_counted)
        if self.tries and not content and self.finish_reason is None and not _carries(choices):
            return None  # a continuation's opening role chunk
        if self.continuous_usage and isinstance(usage, dict):
            chunk["usage"] = self._usage(usage)
        return self._frame(chunk)

    def _piece(self, choice: dict[str, Any]) -> str:
        if not self.chat:
            text = choice.get("text")
            return text if isinstance(text, str) else ""
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return ""
        if self.tries:
            delta.pop("role", None)
        text = delta.get("content")
        return text if isinstance(text, str) else ""

    def _count(self, usage: dict[str, Any]) -> None:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if self.tries == 0 and isinstance(prompt, int) and self._prompt_tokens is None:
            self._prompt_tokens = prompt
        if self.tries == 0 and isinstance(prompt, int):
            self._usage_extra = {k: v for k, v in usage.items() if k.endswith("_details")}
        if isinstance(completion, int):
            self._this = max(self._this, completion)
        if self._prompt_tokens is None and isinstance(prompt, int):
            # Never saw the first try's count: the continuation's prompt holds the answer's start.
            self._prompt_tokens = max(0, prompt - self._before)

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        prompt = self._prompt_tokens if self._prompt_tokens is not None else usage.get("prompt_tokens", 0)
        completion = self.produced
        out = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
        out.update(self._usage_extra)
        return out

    def _header(self) -> dict[str, Any]:
        head = dict(self._head or {})
        head["object"] = "chat.completion.chunk" if self.chat else "text_completion"
        return head

    @staticmethod
    def _frame(chunk: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _carries(choices: list[Any]) -> bool:
    """Whether a content-less chunk still says something (tool calls, logprobs)."""
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(v for k, v in delta.items() if k != "content"):
            return True
        if choice.get("logprobs"):
            return True
    return False
