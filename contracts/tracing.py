"""Tracing: the ``[tracing]`` config section every daemon reads, and the pure phase timeline.

The section is the same in the gateway's, the agent's and kvcached's config (each process parses it with
:func:`parse_tracing`)::

    [tracing]
    enabled = true                     # default false: no tracer, no span objects, one branch per request
    sampling_ratio = 0.1               # of traces started here (a parent's sampled flag is followed)
    endpoint = "127.0.0.1:4317"        # an OTLP/gRPC collector (host:port, plaintext)
    service_name = "kvgate-extproc"    # default: the process's own (kvgate-extproc, kvgate-agent, ...)
    flush_interval_s = 1.0             # spans are exported in batches at least this often

:class:`Timeline` is what the gateway's pure core records when a request is traced: named phases as
``(name, start, end)`` in nanoseconds of an injected clock; the shell (:mod:`runtime.tracing`) turns them
into spans after the fact. No OpenTelemetry object exists on the request path unless a request is traced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from contracts.config import Section, hostport
from contracts.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """``[tracing]``: whether this process traces, the ratio of new traces it samples (0..1; a traced
    parent's decision is followed), the OTLP/gRPC collector (``host:port``), the ``service.name`` of its
    spans and how often (s) batches are flushed."""

    enabled: bool = False
    sampling_ratio: float = 1.0
    endpoint: str = "127.0.0.1:4317"
    service_name: str = "kvgate"
    flush_interval_s: float = 1.0


def parse_tracing(raw: object, default_service: str, where: str = "tracing") -> TracingSettings:
    """The ``[tracing]`` table ``raw`` (``None``: absent, tracing off); :class:`ConfigError` naming the key
    for an unknown key, a ratio outside [0, 1], an endpoint that is not ``host:port``."""
    if raw is None:
        return TracingSettings(service_name=default_service)
    sec = Section(raw, where)
    enabled = sec.flag("enabled", False)
    ratio = sec.number("sampling_ratio", 1.0)
    if ratio > 1.0:
        raise ConfigError(f"{where}.sampling_ratio: must be between 0 and 1, got {ratio}")
    endpoint = hostport(sec.string("endpoint", "127.0.0.1:4317"), f"{where}.endpoint")
    service = sec.string("service_name", default_service)
    if not service:
        raise ConfigError(f"{where}.service_name: must not be empty")
    flush = sec.number("flush_interval_s", 1.0)
    if flush <= 0:
        raise ConfigError(f"{where}.flush_interval_s: must be > 0, got {flush}")
    sec.done()
    return TracingSettings(enabled, ratio, endpoint, service, flush)


class Timeline:
    """Phases of one traced request: ``spans`` of ``(name, start_ns, end_ns)``, in the order recorded.

    :meth:`mark` closes a phase that began where the previous one ended (or at :meth:`skip`, or at
    construction); :meth:`add` records one with explicit bounds. ``clock``: nanoseconds since the epoch
    (``time.time_ns`` in the shell), so spans line up with other processes'.
    """

    __slots__ = ("_clock", "_last", "spans")

    def __init__(self, clock: Callable[[], int]) -> None:
        self._clock = clock
        self._last = clock()
        self.spans: list[tuple[str, int, int]] = []

    def now(self) -> int:
        return self._clock()

    def mark(self, name: str) -> None:
        """The phase ``name`` ran from the last mark (or skip) until now."""
        now = self._clock()
        self.spans.append((name, self._last, now))
        self._last = now

    def skip(self) -> None:
        """What ran since the last mark belongs to no phase: the next one starts now."""
        self._last = self._clock()

    def add(self, name: str, start: int, end: int) -> None:
        self.spans.append((name, start, end))
