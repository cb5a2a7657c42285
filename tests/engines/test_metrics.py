from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from engines.kinds import metric_names
from engines.metrics import parse_metrics


def exposition(values: dict[str, list[tuple[dict[str, str], float]]]) -> str:
    registry = CollectorRegistry()
    for name, series in values.items():
        labels = sorted(series[0][0]) if series else []
        gauge = Gauge(name.replace(":", "_").replace(".", "_"), "h", labels, registry=registry)
        for label_values, value in series:
            (gauge.labels(**label_values) if labels else gauge).set(value)
    # prometheus_client cannot name a metric with ':'; real engines do: substitute after rendering.
    text = generate_latest(registry).decode()
    for name in values:
        text = text.replace(name.replace(":", "_"), name)
    return text


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm", "llama_cpp"])
def test_each_engine_names(engine: str) -> None:
    names = metric_names(engine)
    values = {names.waiting: [({}, 3.0)], names.running: [({}, 5.0)]}
    if names.kv_usage:
        values[names.kv_usage] = [({}, 0.25)]
    m = parse_metrics(exposition(values), names, at=7.0)
    assert (m.waiting, m.running, m.at) == (3.0, 5.0, 7.0)
    assert m.kv_usage == (0.25 if names.kv_usage else None)


def test_sums_over_label_sets_and_ignores_others() -> None:
    text = (
        "# HELP vllm:num_requests_waiting x\n"
        'vllm:num_requests_waiting{model_name="a"} 2.0\n'
        'vllm:num_requests_waiting{model_name="b"} 1.0\n'
        "vllm:num_requests_waiting_other 100\n"
        'vllm:num_requests_running{model_name="a",x="}"} 4\n'
        "garbage line\n"
        "vllm:kv_cache_usage_perc NaN\n"
    )
    m = parse_metrics(text, metric_names("vllm"), at=0.0)
    assert (m.waiting, m.running, m.kv_usage) == (3.0, 4.0, None)


def test_percentages_normalised() -> None:
    m = parse_metrics("vllm:kv_cache_usage_perc 42\n", metric_names("vllm"), at=0.0)
    assert m.kv_usage == pytest.approx(0.42)
