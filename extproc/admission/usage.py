"""Reading the engine's token ``usage`` out of a response body, chunk by chunk, without holding it.

OpenAI-compatible engines report ``usage`` (``prompt_tokens``, ``completion_tokens``) at the end of a
non-streamed JSON body, and in a final SSE event of a stream when the client asked
``stream_options.include_usage``. The reader is fed the body as Envoy streams it through the ext_proc:

* JSON: the body is kept (up to ``max_json_bytes``) and parsed once at its end;
* SSE: complete events are scanned as they arrive; only events containing ``"usage"`` are parsed,
  and the last non-null usage wins. Without one, each ``data:`` event counts as one output token, an
  estimate (engines send one event per decode step; batching makes it an over-count, never under).

Pure: bytes in, numbers out.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

DEFAULT_MAX_JSON_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens a response used. ``exact``: reported by the engine (else estimated from SSE events;
    ``prompt`` is then ``None`` and the admission's own count applies)."""

    prompt: int | None
    completion: int
    exact: bool


class UsageReader:
    """Feed it the response body; :meth:`result` says what it used, or ``None`` if unknown."""

    def __init__(self, *, sse: bool, max_json_bytes: int = DEFAULT_MAX_JSON_BYTES) -> None:
        self._sse = sse
        self._max = max_json_bytes
        self._buf = bytearray()
        self._overflow = False
        self._events = 0
        self._usage: Usage | None = None
        self.ended = False

    def feed(self, chunk: bytes, end_of_stream: bool = False) -> None:
        if self.ended:
            return
        if self._sse:
            self._feed_sse(chunk)
        elif not self._overflow:
            if len(self._buf) + len(chunk) > self._max:
                self._overflow = True
                self._buf.clear()
            else:
                self._buf += chunk
        if end_of_stream:
            self.ended = True
            if self._sse:
                self._feed_sse(b"\n\n")
            elif not self._overflow:
                self._usage = _from_json(bytes(self._buf))
                self._buf.clear()

    def _feed_sse(self, chunk: bytes) -> None:
        # JSON never carries a raw CR, so dropping them turns CRLF framing into LF framing.
        chunk = chunk.replace(b"\r", b"")
        start = max(0, len(self._buf) - 1)  # an event boundary may straddle two chunks
        self._buf += chunk
        if self._buf.find(b"\n\n", start) < 0:
            if len(self._buf) > self._max:  # one absurdly long event: give up on it
                self._buf.clear()
            return
        *events, rest = bytes(self._buf).split(b"\n\n")
        self._buf = bytearray(rest)
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if not data or data == b"[DONE]":
                    continue
                self._events += 1
                if b'"usage"' in data:
                    found = _from_json(data)
                    if found is not None:
                        self._usage = found

    def result(self) -> Usage | None:
        """Exact usage if the engine reported it; for SSE without it an estimate; else ``None``."""
        if self._usage is not None:
            return self._usage
        if self._sse and self._events:
            return Usage(None, self._events, False)
        return None


def _from_json(data: bytes) -> Usage | None:
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if not isinstance(usage, dict):
        return None
    completion = usage.get("completion_tokens")
    prompt = usage.get("prompt_tokens")
    if not isinstance(completion, int) or isinstance(completion, bool) or completion < 0:
        return None
    if not isinstance(prompt, int) or isinstance(prompt, bool) or prompt < 0:
        prompt = None
    return Usage(prompt, completion, True)
