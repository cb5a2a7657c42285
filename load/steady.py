"""A small steady load through the gateway, every request's outcome recorded: the fault suite's yardstick
(``load/faults.py``, ``tests/faults``, ``load/bench/faults.py``).

``clients`` concurrent loops, each sending one chat completion after another (every other one streamed),
all sharing a system prompt, until stopped. A request *succeeded* when it got a 200 and, for a stream,
the final ``[DONE]`` event and no error event (vLLM's ``data: {"error": ...}``, which kvgate's migration
proxy also sends for a stream it could not continue); anything else (an error status, a cut stream, an
error event, a client timeout) is a failure,
with the engine Envoy last tried (``x-kvgate-endpoint``, also on Envoy's own 503/504) when known.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

SYSTEM = "You are a careful assistant for a fleet operations team. " * 40  # shared by every request


@dataclass(frozen=True, slots=True)
class Outcome:
    started: float
    ended: float
    stream: bool
    status: int | None  # None: no HTTP response at all
    endpoint: str | None
    ok: bool
    error: str | None = None
    error_event: bool = False  # a 200 stream that carried an error event


@dataclass
class SteadyLoad:
    base_url: str
    model: str
    clients: int = 4
    max_tokens: int = 8
    #: No request may take longer than this in the client (it is a failure then, not a hang).
    client_timeout_s: float = 30.0
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def __aenter__(self) -> SteadyLoad:
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=self.client_timeout_s)
        self._tasks = [asyncio.create_task(self._loop(i)) for i in range(self.clients)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self._client.aclose()

    async def _loop(self, client: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            self.outcomes.append(await self._one(stream=(client + n) % 2 == 0, n=n))

    async def _one(self, stream: bool, n: int) -> Outcome:
        body = {
            "model": self.model,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {n}"}],
            "max_tokens": self.max_tokens,
            "stream": stream,
        }
        started = time.monotonic()
        status: int | None = None
        endpoint: str | None = None
        try:
            async with self._client.stream("POST", "/v1/chat/completions", json=body) as response:
                status, endpoint = response.status_code, response.headers.get("x-kvgate-endpoint")
                text = (await response.aread()).decode()
            lost = stream and has_error_event(text)
            ok = status == 200 and (not stream or ("data: [DONE]" in text and not lost))
            error = None if ok else text[-300:]
            return Outcome(started, time.monotonic(), stream, status, endpoint, ok, error, lost)
        except httpx.HTTPError as exc:
            return Outcome(started, time.monotonic(), stream, status, endpoint, False, type(exc).__name__)

    def between(self, start: float, end: float) -> list[Outcome]:
        """Requests that started in ``[start, end)`` (monotonic seconds)."""
        return [o for o in self.outcomes if start <= o.started < end]


def has_error_event(text: str) -> bool:
    """Whether the SSE body ``text`` holds an error event (a ``data:`` JSON object with ``error``)."""
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        if isinstance(event, dict) and "error" in event:
            return True
    return False


def failure_kind(o: Outcome) -> str:
    """How a request failed, for the records: its HTTP status, ``200 cut`` (a 200 whose stream or body
    ended early), ``200 error event`` (a 200 stream that ended with an error event: the request was lost),
    or ``no response`` (the connection failed or the client timed out before any status)."""
    if o.status is None:
        return "no response"
    if o.error_event:
        return "200 error event"
    return "200 cut" if o.status == 200 else str(o.status)


@dataclass(frozen=True, slots=True)
class FaultRecord:
    """One fault's count: requests ``sent`` under it, ``succeeded``, ``failed`` by :func:`failure_kind`,
    ``hung`` (took longer than every configured bound plus slack, whatever their end), and
    ``recovery_s``: seconds from the fault until full service returned (the process back, every engine
    eligible again in every ext_proc)."""

    fault: str
    sent: int
    succeeded: int
    failed: dict[str, int]
    hung: int
    recovery_s: float

    @classmethod
    def of(cls, fault: str, outcomes: list[Outcome], hang_s: float, recovery_s: float) -> FaultRecord:
        failed = Counter(failure_kind(o) for o in outcomes if not o.ok)
        return cls(
            fault,
            len(outcomes),
            sum(o.ok for o in outcomes),
            dict(sorted(failed.items())),
            sum(o.ended - o.started > hang_s for o in outcomes),
            round(recovery_s, 3),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
