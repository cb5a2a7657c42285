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


def test_kv_usage_of_several_engine_cores_is_their_mean() -> None:
    """vLLM with --data-parallel-size 2 reports one gauge per engine core: 0.6 and 0.7 used is 0.65, not
    their sum (1.3) read as a percentage (0.013), which would show a nearly full engine as empty."""
    text = (
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.6\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 3\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 4\n'
    )
    m = parse_metrics(text, metric_names("vllm"), at=0.0)
    assert m.kv_usage == pytest.approx(0.65)
    assert m.running == 7.0  # request counts still add up
    pct = parse_metrics(
        'x{engine="0"} 1\nvllm:kv_cache_usage_perc{a="0"} 40\nvllm:kv_cache_usage_perc{a="1"} 60\n',
        metric_names("vllm"),
        at=0.0,
    )
    assert pct.kv_usage == pytest.approx(0.5)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_ttft_histogram_sum_and_count_are_read(engine: str) -> None:
    names = metric_names(engine)
    assert names.ttft == f"{engine}:time_to_first_token_seconds"
    text = (
        f'{names.ttft}_bucket{{le="0.1",model_name="a"}} 3.0\n'
        f'{names.ttft}_sum{{model_name="a"}} 1.5\n'
        f'{names.ttft}_count{{model_name="a"}} 4.0\n'
        f'{names.ttft}_sum{{model_name="b"}} 0.5\n'
        f'{names.ttft}_count{{model_name="b"}} 1.0\n'
    )
    m = parse_metrics(text, names, at=1.0)
    assert (m.ttft_sum, m.ttft_count) == (2.0, 5.0)
    half = parse_metrics(f'{names.ttft}_sum{{model_name="a"}} 1.5\n', names, at=1.0)
    assert (half.ttft_sum, half.ttft_count) == (None, None)  # a sum without its count: none


@pytest.mark.parametrize("engine", ["trtllm", "llama_cpp"])
def test_engines_without_a_ttft_histogram_read_none(engine: str) -> None:
    m = parse_metrics("time_to_first_token_seconds_sum 3\n", metric_names(engine), at=1.0)
    assert (m.ttft_sum, m.ttft_count) == (None, None)


def test_generation_token_counter() -> None:
    """Each kind's output-token counter is read (summed over models); absent, it reads as None."""
    text = (
        "# TYPE vllm:generation_tokens counter\n"
        'vllm:generation_tokens_total{model_name="a"} 120\n'
        'vllm:generation_tokens_total{model_name="b"} 30\n'
        "vllm:num_requests_running 1\n"
    )
    assert parse_metrics(text, metric_names("vllm"), 0.0).generation_tokens == 150.0
    assert parse_metrics("vllm:num_requests_running 1\n", metric_names("vllm"), 0.0).generation_tokens is None
    llama = "llamacpp:tokens_predicted_total 42\nllamacpp:requests_processing 1\n"
    assert parse_metrics(llama, metric_names("llama_cpp"), 0.0).generation_tokens == 42.0


def test_prefix_cache_counters_are_read_as_a_pair() -> None:
    """vLLM's prefix-cache counters (the drift alarm's second source); one without the other is neither."""
    names = metric_names("vllm")
    both = (
        'vllm:prefix_cache_hits_total{model_name="m"} 48.0\n'
        'vllm:prefix_cache_queries_total{model_name="m"} 100.0\n'
        'vllm:prefix_cache_queries_total{model_name="n"} 20.0\n'
    )
    m = parse_metrics(both, names, 1.0)
    assert (m.prefix_hits, m.prefix_queries) == (48.0, 120.0)
    alone = parse_metrics('vllm:prefix_cache_hits_total{model_name="m"} 48.0\n', names, 1.0)
    assert (alone.prefix_hits, alone.prefix_queries) == (None, None)
    assert parse_metrics(both, metric_names("sglang"), 1.0).prefix_hits is None


def test_vllm_lora_requests_info_the_latest_series_wins() -> None:
    # As vLLM writes it (multiprocess "livemostrecent": older series may linger; the value is a timestamp).
    text = (
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 1.0e+09\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="alpaca, beta",'
        'waiting_lora_adapters="gamma"} 1.789828498802105e+09\n'
        "vllm:num_requests_running 3\n"
    )
    m = parse_metrics(text, metric_names("vllm"), 0.0)
    assert m.running == 3
    assert m.lora is not None
    assert m.lora.running == {"alpaca", "beta"} and m.lora.waiting == {"gamma"} and m.lora.max_lora == 2
    assert m.lora.free_slots == 0


@pytest.mark.parametrize(
    "line",
    [
        'vllm:lora_requests_info{max_lora="x",running_lora_adapters=""} 1',
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a",} 1',
        "vllm:lora_requests_info{broken} 1",
        'vllm:lora_requests_info{max_lora="4"} nan-ish',
    ],
)
def test_odd_lora_lines_never_raise(line: str) -> None:
    m = parse_metrics(line + "\n", metric_names("vllm"), 0.0)
    assert m.lora is None or m.lora.running <= {"a"}


def test_sglang_lora_pool_slots_and_no_lora_metric() -> None:
    text = "sglang:lora_pool_slots_used 1\nsglang:lora_pool_slots_total 4\n"
    lora = parse_metrics(text, metric_names("sglang"), 0.0).lora
    assert lora is not None and lora.free_slots == 3 and lora.running == frozenset()
    assert parse_metrics("vllm:num_requests_running 1\n", metric_names("vllm"), 0.0).lora is None
