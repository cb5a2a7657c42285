"""How long Envoy waits for an engine, per model: the headers the processor sets on each routed request.

Two bounds, both enforced by Envoy's router (the ext_proc sets them; clients cannot, the bundled config
strips them from requests):

* ``request_s``: the whole response, first byte to last, retries included
  (``x-envoy-upstream-rq-timeout-ms``). It must outlast the longest generation the model may produce;
  it is not a time-to-first-token deadline (that would cut streams mid-generation).
* ``first_byte_s``: for a streamed request, how long one try may wait for the engine's response headers
  (``x-envoy-upstream-rq-per-try-timeout-ms``; Envoy's per-try timer stops at the headers). An engine
  that accepted the connection but answers nothing (hung, stopped, wedged) fails the request with a 504
  at this bound, and that failed try ejects the endpoint in every ext_proc (:mod:`extproc.xds`).
  vLLM, SGLang and the simulator send a stream's headers as soon as they accept the request, so the
  bound does not include queueing or prefill. A non-streamed answer's first byte is its last, so it gets
  no first-byte bound: ``request_s`` alone.

A request forwarded to a peer cluster (:mod:`extproc.federation`) goes to the peer's ingress first and to
the local pick as the fallback, so every try is bounded, streamed or not: a streamed one by
``first_byte_s`` as above, a non-streamed one by the federation's ``forward_first_byte_s`` per try (its
first byte is its whole answer; ``0``, or none given: ``request_s``), never more than ``request_s``, and
the whole by ``request_s`` plus that bound, so the local pick still has a full ``request_s``. A peer that
accepts the connection and never answers then costs at most that bound before the local pick serves the
request (the per-try timeout is retried, ``reset``), never a 504 without a fallback; a non-streamed answer
the peer takes longer than the bound to complete is served by the local pick instead.

``0`` disables a bound. Between bytes, Envoy's stream idle timeout applies (``kvgate envoy-config
--stream-idle-timeout``, 300 s).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

REQUEST_TIMEOUT_HEADER = "x-envoy-upstream-rq-timeout-ms"
FIRST_BYTE_TIMEOUT_HEADER = "x-envoy-upstream-rq-per-try-timeout-ms"


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds; ``0``: no bound."""

    request_s: float = 1800.0
    first_byte_s: float = 30.0


@dataclass(frozen=True, slots=True)
class TimeoutTable:
    """The gateway's default and each model's own (models not named use the default)."""

    default: Timeouts = Timeouts()
    models: Mapping[str, Timeouts] = field(default_factory=dict)

    def headers(
        self, model: str, stream: bool, *, forwarded: bool = False, forward_s: float = 0.0
    ) -> list[tuple[str, str]]:
        """The request headers that bound this request at the engine (``forwarded``: to a peer cluster's
        ingress first, the local pick as the fallback: every try bounded; ``forward_s``: the bound of a
        non-streamed forwarded try, seconds, ``0``: ``request_s``)."""
        t = self.models.get(model, self.default)
        try_s = 0.0
        if forwarded and not stream:
            bounds = [s for s in (forward_s, t.request_s) if s > 0]
            try_s = min(bounds) if bounds else 0.0
        out = []
        if t.request_s > 0:
            out.append((REQUEST_TIMEOUT_HEADER, _ms(t.request_s + try_s)))
        if stream and t.first_byte_s > 0:
            out.append((FIRST_BYTE_TIMEOUT_HEADER, _ms(t.first_byte_s)))
        elif try_s > 0:
            out.append((FIRST_BYTE_TIMEOUT_HEADER, _ms(try_s)))
        return out


def _ms(seconds: float) -> str:
    return str(max(1, round(seconds * 1000)))
