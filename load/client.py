"""The load generator: sends workload sessions as streamed OpenAI chat requests and times every token.

Open loop (:attr:`LoadOptions.mode` ``"open"``): each session starts at its ``start_s`` whatever the
server does (Poisson arrivals make queueing show up as latency, not as a lower request rate). Closed
loop (``"closed"``): ``concurrency`` workers each run one session after another, for ``duration_s``.
Turns of a session run in order; with ``keep_history`` each resends the conversation including the
assistant's streamed answers, so the engine can hit its own cached output.

Every request streams (SSE) with ``stream_options.include_usage``, so each :class:`RequestRecord`
holds the real time to first token, the gaps between streamed chunks, and the engine's
``prompt_tokens`` / ``cached_tokens``; the ``x-kvgate-replica`` response header (set by the simulator,
passed through by every router) says which replica served it. Where each request goes is a
:class:`Route`: a fixed base URL, or a client-side policy (the benchmark's oracle).

The run stops by itself: arrivals end at ``duration_s`` (open loop: the last session's start), and
requests still running ``drain_s`` later are cancelled and count as failures.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import aiohttp
import orjson

from load.workloads.session import Message, Session

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-kvgate-replica"
PATH = "/v1/chat/completions"


class Route(Protocol):
    """Where a request goes: ``pick`` returns a base URL (``http://127.0.0.1:PORT``) for the next
    request of ``session``; ``done`` is called with that URL when the request ends."""

    def pick(self, session: Session, turn: int) -> str: ...

    def done(self, url: str) -> None: ...


@dataclass(frozen=True, slots=True)
class FixedRoute:
    """Every request to one base URL (a router's listener)."""

    url: str

    def pick(self, session: Session, turn: int) -> str:
        return self.url

    def done(self, url: str) -> None:
        pass


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """How to send. ``duration_s``: open loop, a cap on arrival times; closed loop, how long workers
    start new sessions. ``drain_s``: how long requests may still run after that before they are
    cancelled (failures). ``request_timeout_s``: per request, end to end. ``headers``: extra request
    headers for turn ``n`` of a session (an objective, a fairness id), ``None``: none."""

    model: str
    mode: Literal["open", "closed"] = "open"
    concurrency: int = 8
    duration_s: float = 30.0
    drain_s: float = 120.0
    request_timeout_s: float = 180.0
    progress: bool = True
    label: str = ""
    headers: Callable[[Session, int], Mapping[str, str]] | None = None


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times in seconds, ``sent_s`` from the run start.

    ``status``: ``"ok"``, an HTTP status, ``"stream_error"`` (an error event in the stream: the request
    was lost after it started), or an exception name. ``chunk_gaps_s``: time between
    consecutive streamed content chunks after the first (inter-token latency; the engine coalesces
    tokens only when the client lags). Token counts come from the final ``usage`` chunk.
    ``error_code``: a non-200 answer's (or an in-stream error event's) OpenAI ``error.code``
    (``queue_full``, ...), as a string; ``None``
    when the answer had none (or succeeded).
    """

    session: str
    turn: int
    key: str
    sent_s: float
    status: str = "pending"
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    replica: str | None = None
    error_code: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(slots=True)
class RunResult:
    """All records of one run and its wall time (first send to last end, seconds)."""

    records: list[RequestRecord]
    wall_s: float
    sessions_started: int
    sessions_aborted: int


class _Progress:
    """tqdm when installed (and wanted), else nothing."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            try:
                tqdm: Any = importlib.import_module("tqdm").tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False)

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _error_code(raw: bytes) -> str | None:
    """The ``error.code`` of an OpenAI error body, as a string; ``None`` if the body has none."""
    try:
        error = orjson.loads(raw).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return None if code is None else str(code)


async def _send(
    http: aiohttp.ClientSession,
    url: str,
    body: bytes,
    record: RequestRecord,
    t0: float,
    headers: Mapping[str, str] | None = None,
) -> str | None:
    """POST one streamed chat request (with ``headers`` added), filling ``record``; returns the answer's
    text when it succeeded."""
    started = time.perf_counter()
    record.sent_s = started - t0
    parts: list[str] = []
    last: float | None = None
    try:
        sent_headers = {**(headers or {}), "content-type": "application/json"}
        async with http.post(url + PATH, data=body, headers=sent_headers) as resp:
            record.replica = resp.headers.get(REPLICA_HEADER)
            if resp.status != 200:
                record.error_code = _error_code(await resp.read())
                record.status = str(resp.status)
                return None
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = orjson.loads(data)
                if isinstance(chunk, dict) and "error" in chunk:  # the engine (or a proxy) gave up mid-stream
                    error = chunk["error"]
                    code = error.get("code") if isinstance(error, dict) else None
                    record.error_code = None if code is None else str(code)
                    record.status = "stream_error"
                    return None
                usage = chunk.get("usage")
                if usage:
                    record.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    record.completion_tokens = int(usage.get("completion_tokens", 0))
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = int(details.get("cached_tokens") or 0)
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if not text:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        record.ttft_s = now - started
                    else:
                        record.chunk_gaps_s.append(now - last)
                    last = now
                    parts.append(text)
        record.e2e_s = time.perf_counter() - started
        record.status = "ok" if record.ttft_s is not None else "empty"
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
        record.status = type(exc).__name__
        return None
    return "".join(parts) if record.ok else None


def request_body(model: str, messages: list[Message], max_tokens: int) -> bytes:
    """The chat request every target gets for a turn (streamed, usage included)."""
    return orjson.dumps(
        {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


async def run_load(sessions: list[Session], route: Route, options: LoadOptions) -> RunResult:
    """Send ``sessions`` through ``route`` as ``options`` says; returns every request's record."""
    records: list[RequestRecord] = []
    aborted = 0
    started = 0
    progress = _Progress(sum(s.num_requests for s in sessions), options.label, options.progress)
    timeout = aiohttp.ClientTimeout(total=options.request_timeout_s, sock_connect=10)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    t0 = time.perf_counter()

    async def run_session(http: aiohttp.ClientSession, session: Session) -> None:
        nonlocal aborted, started
        started += 1
        history: list[Message] = list(session.system)
        for n, turn in enumerate(session.turns):
            if turn.think_s > 0:
                await asyncio.sleep(turn.think_s)
            messages = [*history, *turn.messages]
            record = RequestRecord(session.id, n, session.key, 0.0)
            records.append(record)
            url = route.pick(session, n)
            try:
                headers = options.headers(session, n) if options.headers is not None else None
                body = request_body(session.model or options.model, messages, turn.max_tokens)
                answer = await _send(http, url, body, record, t0, headers)
            except asyncio.CancelledError:
                record.status = "cancelled"
                raise
            finally:
                route.done(url)
                progress.update()
            if answer is None:
                aborted += 1
                return
            if session.keep_history:
                history = [*messages, {"role": "assistant", "content": answer}]

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        tasks: set[asyncio.Task[None]] = set()
        if options.mode == "open":
            for session in sorted(sessions, key=lambda s: s.start_s):
                if session.start_s > options.duration_s:
                    break
                delay = session.start_s - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.add(asyncio.create_task(run_session(http, session)))
        else:
            queue = iter(sessions)
            deadline = t0 + options.duration_s

            async def worker() -> None:
                for session in queue:
                    if time.perf_counter() > deadline:
                        return
                    await run_session(http, session)

            tasks = {asyncio.create_task(worker()) for _ in range(options.concurrency)}
        if not tasks:
            progress.close()
            return RunResult(records, 0.0, 0, 0)
        done, pending = await asyncio.wait(
            tasks, timeout=options.drain_s + (0 if options.mode == "open" else options.duration_s)
        )
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                log.error("session task failed: %r", task.exception())
    progress.close()
    for record in records:
        if record.status == "pending":
            record.status = "cancelled"
    ends = [r.sent_s + (r.e2e_s or 0.0) for r in records]
    wall = max(ends, default=0.0) - min((r.sent_s for r in records), default=0.0)
    return RunResult(records, wall, started, aborted + len(pending))
