"""The LoRA affinity scorer: one table of cases (extproc/scheduling/README.md), in memory."""

from __future__ import annotations

import pytest

from contracts.events import EndpointId
from engines.endpoint import Endpoint
from engines.metrics import EngineMetrics, LoraState
from extproc.fleet import EndpointState, Fleet
from extproc.scheduling.interface import CycleState, SchedulingRequest
from extproc.scheduling.lora import LoraParams, LoraScorer
from extproc.scheduling.registry import parse_scheduling

ADAPTERS = frozenset({"a1", "a2", "a3", "a4"})


def endpoint(
    running: set[str] | None = None,
    waiting: set[str] = frozenset(),  # type: ignore[assignment]
    max_lora: int | None = 2,
    recent: dict[str, float] | None = None,
    reading_at: float = 10.0,
) -> EndpointState:
    state = EndpointState(
        Endpoint(EndpointId("e"), "127.0.0.1:1", frozenset({"base"}) | ADAPTERS, adapters=ADAPTERS)
    )
    lora = None if running is None else LoraState(frozenset(running), frozenset(waiting), max_lora)
    state.metrics = EngineMetrics(0, 0, None, reading_at, lora=lora)
    state.lora_recent = dict(recent or {})
    return state


@pytest.mark.parametrize(
    ("case", "state", "want"),
    [
        ("running", endpoint({"a1"}), 1.0),
        ("waiting", endpoint(set(), {"a1"}), 1.0),
        ("routed here since the reading", endpoint(set(), recent={"a1": 11.0}), 1.0),
        ("idle in a slot", endpoint(set(), recent={"a1": 5.0}), 0.8),
        ("a free slot", endpoint({"a2"}, recent={"a2": 10.0}), 0.5),
        ("evicts an idle adapter", endpoint({"a2"}, recent={"a2": 10.0, "a3": 4.0}), 0.2),
        ("pushed out of the LRU slots", endpoint({"a2"}, recent={"a2": 10.0, "a3": 4.0, "a1": 3.0}), 0.2),
        ("every slot busy", endpoint({"a2", "a3"}), 0.0),
        ("no max_lora, seen", endpoint(set(), max_lora=None, recent={"a1": 1.0}), 0.8),
        ("no max_lora, unseen", endpoint(set(), max_lora=None), 0.3),
        ("no metrics", endpoint(None), 0.3),
    ],
)
def test_lora_score(case: str, state: EndpointState, want: float) -> None:
    request = SchedulingRequest("r", "a1", (), 0, 12.0)
    other = endpoint(set())
    other.endpoint = Endpoint(
        EndpointId("o"), "127.0.0.1:2", frozenset({"base"}) | ADAPTERS, adapters=ADAPTERS
    )
    scores = LoraScorer().score(request, CycleState(), [state, other])
    assert scores[state.id] == pytest.approx(want), case


def test_without_a_reading_a_routed_adapter_counts_as_loaded_for_unread_s_only() -> None:
    """No metrics at all (never scraped, or stale and dropped): an adapter routed there scored 1 (active)
    forever, whatever happened since; now it is loaded for unread_s seconds, then unknown, and never
    active (no reading says what runs there)."""
    state = endpoint()
    state.metrics = None
    state.saw_adapter("a1", 10.0)
    other = endpoint(set())
    other.endpoint = Endpoint(
        EndpointId("o"), "127.0.0.1:2", frozenset({"base"}) | ADAPTERS, adapters=ADAPTERS
    )

    def score(adapter: str, now: float, params: LoraParams | None = None) -> float:
        request = SchedulingRequest("r", adapter, (), 0, now)
        return LoraScorer(params=params).score(request, CycleState(), [state, other])[state.id]

    assert score("a1", 11.0) == pytest.approx(0.8)
    assert score("a1", 70.0) == pytest.approx(0.8)  # 60 s (unread_s) after
    assert score("a1", 70.5) == pytest.approx(0.3)  # past it: unknown, as an adapter never routed there
    assert score("a1", 3600.0) == pytest.approx(0.3)
    assert score("a2", 11.0) == pytest.approx(0.3)
    assert score("a1", 70.5, LoraParams(unread_s=120.0)) == pytest.approx(0.8)


def test_a_base_model_request_scores_nothing() -> None:
    request = SchedulingRequest("r", "base", (), 0, 12.0)
    assert LoraScorer().score(request, CycleState(), [endpoint({"a1"})]) == {}


def test_routing_and_readings_remember_adapters_boundedly() -> None:
    fleet = Fleet([Endpoint(EndpointId("e"), "127.0.0.1:1", frozenset({"base"}))])
    fleet.record_scrape(EndpointId("e"), EngineMetrics(0, 1, None, 3.0, lora=LoraState(frozenset({"x"}))))
    state = fleet.get(EndpointId("e"))
    assert state is not None and state.lora_recent == {"x": 3.0}
    for i in range(100):
        state.saw_adapter(f"a{i}", 4.0 + i)
    assert len(state.lora_recent) == 64 and "a99" in state.lora_recent and "x" not in state.lora_recent


@pytest.mark.parametrize(
    "params",
    [{"loaded": 1.5}, {"free": -0.1}, {"evict": "x"}, {"nope": 1}, {"unread_s": 0}, {"unread_s": -1.0}],
)
def test_bad_params_are_refused(params: dict[str, object]) -> None:
    from contracts.errors import ConfigError

    raw = {
        "plugins": [{"type": "lora", "params": params}, {"type": "max-score"}],
        "profiles": [{"name": "p", "plugins": [{"ref": "lora"}, {"ref": "max-score"}]}],
    }
    with pytest.raises(ConfigError):
        parse_scheduling(raw)
    assert LoraParams().loaded == 0.8
