"""The node agent's Prometheus metrics (``GET /metrics`` on its admin API), read from
:meth:`agent.main.Agent.status` at each scrape, so nothing on the agent's paths keeps them.

Per engine (label ``engine``): ``kvgate_agent_engine_state{kind,state}`` (1 for the supervisor's current
state, 0 for the others: ``starting``, ``ready``, ``unhealthy``, ``restarting``, ``draining``,
``stopped``), ``kvgate_agent_engine_registered`` (its endpoint is in etcd under the agent's lease),
``kvgate_agent_engine_restarts_total``; where the engine sends KV events,
``kvgate_agent_kv_subscriber_<name>_total`` (batches received, replayed, duplicates, losses reported,
undecodable, replay requests and timeouts) and ``kvgate_agent_kv_translator_<name>_total`` (engine
blocks stored and removed, unknown parents (gaps), unknown removals, other KV groups, unknown media,
malformed events, clears); ``kvgate_agent_task_failures_total{engine,task,error}``: unexpected
exceptions, by type, that ended a supervised task (``task="kv_events"``: the KV event pump and its ZMQ
subscriber), each restarted (:mod:`agent.supervised`). Per agent: ``kvgate_agent_feed_seq``, the
sequence number of the last event on its index-event feed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: Supervisor states, as ``agent.supervisor.EngineState`` values.
STATES = ("starting", "ready", "unhealthy", "restarting", "draining", "stopped")


def families(status: Mapping[str, Any]) -> Iterator[Metric]:
    """The metric families of one ``Agent.status()`` snapshot."""
    engines: list[Mapping[str, Any]] = list(status.get("engines", []))
    state = GaugeMetricFamily(
        "kvgate_agent_engine_state",
        "1 for the engine supervisor's current state, 0 for the others.",
        labels=["engine", "kind", "state"],
    )
    registered = GaugeMetricFamily(
        "kvgate_agent_engine_registered",
        "1 while the engine's endpoint is registered in etcd.",
        labels=["engine"],
    )
    restarts = CounterMetricFamily(
        "kvgate_agent_engine_restarts", "Times the agent restarted the engine.", labels=["engine"]
    )
    counters: dict[str, CounterMetricFamily] = {}
    for engine in engines:
        name, kind = str(engine["id"]), str(engine["kind"])
        for value in STATES:
            state.add_metric([name, kind, value], 1 if engine["state"] == value else 0)
        registered.add_metric([name], 1 if engine["registered"] else 0)
        restarts.add_metric([name], float(engine["restarts"]))
        for source in ("kv_subscriber", "kv_translator"):
            for field, number in (engine.get(source) or {}).items():
                if isinstance(number, bool) or not isinstance(number, int | float):
                    continue
                metric = f"kvgate_agent_{source}_{field}"
                if metric not in counters:
                    counters[metric] = CounterMetricFamily(
                        metric,
                        f"KV events of the engine: {source.removeprefix('kv_')} {field}.",
                        labels=["engine"],
                    )
                counters[metric].add_metric([name], float(number))
    yield state
    yield registered
    yield restarts
    yield from counters.values()
    failures = CounterMetricFamily(
        "kvgate_agent_task_failures",
        "Unexpected exceptions that ended a supervised agent task (it was restarted), by exception type.",
        labels=["engine", "task", "error"],
    )
    for row in status.get("task_failures", []):
        failures.add_metric([str(row["engine"]), str(row["task"]), str(row["error"])], float(row["count"]))
    yield failures
    yield GaugeMetricFamily(
        "kvgate_agent_feed_seq",
        "Sequence number of the last event on the agent's feed.",
        value=status["feed_seq"],
    )


class _StatusCollector(Collector):
    def __init__(self, status: Callable[[], Mapping[str, Any]]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        yield from families(self._status())


def agent_registry(status: Callable[[], Mapping[str, Any]]) -> CollectorRegistry:
    """A registry of its own exposing the agent whose ``status()`` this is."""
    registry = CollectorRegistry()
    registry.register(_StatusCollector(status))
    return registry
