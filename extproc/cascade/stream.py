"""A gated step read as a stream (sans IO): the ``first_k`` gate decides as soon as the first ``k`` tokens'
log-probabilities are in, and the rest of the answer is assembled as the non-streamed answer would read.

:class:`StepStream` takes the engine's SSE lines one at a time (:meth:`StepStream.feed`). Once every choice
seen has ``k`` token log-probabilities, it judges them (``first_k``, the token values read
as :mod:`extproc.cascade.gate` reads them): below the threshold :meth:`feed` returns false and the caller
closes the connection (the engine aborts the request: the step costs ``k`` tokens, not the whole answer);
at or above it, and once each of the client's ``n`` choices has been seen (one not seen yet could fail),
the stream is read to its end, unless ``stop_on_pass`` (a ``replay`` cascade, a streaming client: the step
is sent again through Envoy) stops it there too.
:meth:`StepStream.answer` rebuilds the whole answer from the chunks: per choice the content (and
``reasoning_content``) joined, tool calls merged by their index, the log-probabilities concatenated, the
finish reason; ``id``, ``created``, ``model`` of the first chunk and the ``usage`` of the last chunk that
has one. Chat (``chat.completion.chunk``) and completions (``text_completion``) streams. A line that is
not JSON, or a chunk of the wrong shape (a choice's ``index`` not a non-negative integer, a ``delta``, a
tool call or its ``function`` not an object, a text not a string), or an error event (vLLM reports a
failure during generation inside its 200 stream: ``data: {"error": {...}}``, older ``{"object": "error",
...}``, then ``[DONE]``), makes the stream bad: :meth:`feed` says stop and there is no answer (the step
escalates as ``bad_answer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from extproc.cascade.gate import Verdict, entry_logprob, statistic, token_values
from extproc.cascade.spec import CascadeSpec


@dataclass(slots=True)
class _Choice:
    role: str = "assistant"
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    logprobs: list[Any] | None = None  # chat: content entries
    text_logprobs: dict[str, list[Any]] | None = None  # completions: parallel lists
    finish_reason: str | None = None
    #: The sampled tokens' log-probabilities so far, read as they come (:meth:`read`).
    numbers: list[float] = field(default_factory=list)
    #: An entry was not a number nor null (:func:`~extproc.cascade.gate.token_values`).
    unreadable: bool = False

    def read(self, entries: list[Any]) -> None:
        """Add a chunk's log-probability entries (nulls skipped) to :attr:`numbers`, once: a chunk costs
        its own entries, not the stream's so far (a long choice was quadratic on the event loop)."""
        numbers = token_values(entries)
        if numbers is None:
            self.unreadable = True
        else:
            self.numbers.extend(numbers)

    def values(self) -> list[float] | None:
        """The sampled tokens' log-probabilities so far, read as the buffered gate reads them
        (:func:`~extproc.cascade.gate.token_values`: nulls skipped; ``None``: an entry that is not a
        number)."""
        return None if self.unreadable else self.numbers


class StepStream:
    """One streamed gated step under ``spec`` (``stat`` ``first_k``); ``chat``: a chat stream;
    ``stop_on_pass``: stop reading once the first ``k`` tokens pass too; ``n``: the choices the client
    asked for (a pass waits until each has been seen) (module docstring)."""

    def __init__(self, spec: CascadeSpec, *, chat: bool, stop_on_pass: bool = False, n: int = 1) -> None:
        assert spec.stat == "first_k" and spec.k is not None, "only first_k decides before the end"
        self._spec, self._k, self._chat, self._stop_on_pass = spec, spec.k, chat, stop_on_pass
        self._n = n
        self._head: dict[str, Any] | None = None
        self._choices: dict[int, _Choice] = {}
        self._usage: Any = None
        #: The early verdict, once the first ``k`` tokens of every choice were judged.
        self.verdict: Verdict | None = None
        #: Judged on the first ``k`` tokens and the rest not read: the gate failed (or passed, with
        #: ``stop_on_pass``).
        self.cut = False
        #: A ``data:`` line that was not JSON, or a chunk of the wrong shape (no answer: ``bad_answer``).
        self.bad = False

    def feed(self, line: bytes) -> bool:
        """One line of the engine's SSE answer; false: stop reading (the gate decided early: :attr:`cut`;
        or the stream is :attr:`bad`)."""
        if self.bad:
            return False
        line = line.strip()
        if not line.startswith(b"data:"):
            return True
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            chunk = None
        if not isinstance(chunk, dict) or not self._add(chunk):
            self.bad = True  # the answer is refused whatever follows: stop the engine
            return False
        if self.verdict is None and self._choices:
            return self._decide()
        return True

    def _decide(self) -> bool:
        """The early verdict, once every choice seen has its first ``k`` tokens; false: cut. (A choice that
        ended with fewer leaves the verdict to the end: the whole answer is in by then, returned whole.)"""
        per = [c.values() for c in self._choices.values()]
        if not all(v is None or len(v) >= self._k for v in per):
            return True
        stats = [None if v is None else statistic(v[: self._k], "first_k", self._k) for v in per]
        if any(s is None for s in stats):
            return True  # judged at the end (as no_logprobs)
        worst = min(s for s in stats if s is not None)
        passed = worst >= self._spec.threshold
        if passed and not all(i in self._choices for i in range(self._n)):
            return True  # a choice not seen yet may fail the gate: the answer is judged by its worst
        self.verdict = Verdict(worst, passed, "pass" if passed else "gate")
        if not passed or self._stop_on_pass:
            self.cut = True
            return False
        return True

    def _add(self, chunk: dict[str, Any]) -> bool:
        """Fold one chunk in; false: it has the wrong shape, or is an error event (module docstring)."""
        if chunk.get("error") is not None or chunk.get("object") == "error":
            return False  # vLLM's failure inside a 200 stream: what came before is not the whole answer
        if self._head is None:
            self._head = {k: chunk.get(k) for k in ("id", "created", "model")}
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        choices = chunk.get("choices")
        if choices is None:
            return True
        if not isinstance(choices, list):
            return False
        for c in choices:
            index = c.get("index", 0) if isinstance(c, dict) else None
            if not _count(index):
                return False
            assert isinstance(c, dict) and isinstance(index, int)
            choice = self._choices.setdefault(index, _Choice())
            if c.get("finish_reason") is not None:
                choice.finish_reason = c["finish_reason"]
            lp = c.get("logprobs")
            if self._chat:
                delta = {} if c.get("delta") is None else c["delta"]
                if not isinstance(delta, dict) or not _texts(delta, "role", "content", "reasoning_content"):
                    return False
                choice.role = delta.get("role") or choice.role
                if delta.get("content"):
                    choice.content.append(delta["content"])
                if delta.get("reasoning_content"):
                    choice.reasoning.append(delta["reasoning_content"])
                calls = delta.get("tool_calls")
                if calls is not None and not isinstance(calls, list):
                    return False
                for call in calls or []:
                    if not _merge_call(choice.calls, call):
                        return False
                if isinstance(lp, dict) and isinstance(lp.get("content"), list):
                    if choice.logprobs is None:
                        choice.logprobs = []
                    choice.logprobs.extend(lp["content"])
                    choice.read([entry_logprob(e) for e in lp["content"]])
            else:
                if not _texts(c, "text"):
                    return False
                if c.get("text"):
                    choice.content.append(c["text"])
                if isinstance(lp, dict):
                    merged = choice.text_logprobs or {}
                    for key, values in lp.items():
                        if isinstance(values, list):
                            merged.setdefault(key, []).extend(values)
                            if key == "token_logprobs":
                                choice.read(values)
                    choice.text_logprobs = merged
        return True

    def answer(self) -> dict[str, Any] | None:
        """The whole answer as the engine would have sent it unstreamed; ``None`` for an empty or bad
        stream."""
        if self._head is None or self.bad:
            return None
        choices = []
        for index, c in sorted(self._choices.items()):
            if self._chat:
                message: dict[str, Any] = {"role": c.role, "content": "".join(c.content) or None}
                if c.reasoning:
                    message["reasoning_content"] = "".join(c.reasoning)
                if c.calls:
                    message["tool_calls"] = [c.calls[i] for i in sorted(c.calls)]
                logprobs = None if c.logprobs is None else {"content": c.logprobs}
                choices.append(
                    {
                        "index": index,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                    }
                )
            else:
                text = "".join(c.content)
                choices.append(
                    {
                        "index": index,
                        "text": text,
                        "logprobs": c.text_logprobs,
                        "finish_reason": c.finish_reason,
                    }
                )
        obj = "chat.completion" if self._chat else "text_completion"
        return {**self._head, "object": obj, "choices": choices, "usage": self._usage}


def _count(value: object) -> bool:
    """Whether ``value`` is an index: a non-negative integer (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _texts(obj: dict[str, Any], *keys: str) -> bool:
    """Whether each of ``keys`` in ``obj`` is a string or null (absent: null)."""
    return all(isinstance(obj.get(key), str | None) for key in keys)


def _merge_call(calls: dict[int, dict[str, Any]], delta: Any) -> bool:
    """Fold one streamed tool-call delta into the call at its index (id, type, name once; arguments
    appended); false: it has the wrong shape."""
    if not isinstance(delta, dict) or not _texts(delta, "id", "type"):
        return False
    index, fn = delta.get("index", 0), delta.get("function")
    if not _count(index) or not (fn is None or (isinstance(fn, dict) and _texts(fn, "name", "arguments"))):
        return False
    call = calls.setdefault(index, {"id": None, "type": "function", "function": {}})
    for key in ("id", "type"):
        if delta.get(key):
            call[key] = delta[key]
    fn = fn or {}
    if fn.get("name"):
        call["function"]["name"] = fn["name"]
    if fn.get("arguments"):
        call["function"]["arguments"] = call["function"].get("arguments", "") + fn["arguments"]
    return True
