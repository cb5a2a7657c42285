"""extproc.flow.policy: every flow path's good and bad values (table-driven), band and saturation
lookups, the file tables (flow_paths, parse_flow) and flow_values as the inverse of apply_flow."""

from __future__ import annotations

import types

import pytest

from contracts.errors import ConfigError
from extproc.flow.policy import (
    MAX_WAIT_S,
    BandLimits,
    EnginePriority,
    FlowPolicy,
    ModelSaturation,
    Objective,
    Saturation,
    apply_flow,
    check_flow_path,
    flow_paths,
    flow_values,
    number,
    parse_flow,
)
from extproc.processor import HOLD_SLACK_S
from extproc.server import HOLD_TIMEOUT_S

GOOD: list[tuple[str, object, FlowPolicy]] = [
    ("flow/saturation", {"max_waiting": 8}, FlowPolicy(saturation=Saturation(max_waiting=8.0))),
    (
        "flow/saturation",
        {"max_in_flight": 4, "max_kv_usage": 0.9, "max_waiting": None},
        FlowPolicy(saturation=Saturation(max_in_flight=4.0, max_kv_usage=0.9)),
    ),
    ("flow/saturation", {}, FlowPolicy()),
    (
        "flow/models/org/llama-3",
        {"max_waiting": 2, "roles": {"prefill": {"max_in_flight": 1}}},
        FlowPolicy(
            models=types.MappingProxyType(
                {
                    "org/llama-3": ModelSaturation(
                        Saturation(max_waiting=2.0),
                        types.MappingProxyType({"prefill": Saturation(max_in_flight=1.0)}),
                    )
                }
            )
        ),
    ),
    ("flow/models/m", {}, FlowPolicy(models=types.MappingProxyType({"m": ModelSaturation()}))),
    ("flow/bands/default", {"max_requests": 8}, FlowPolicy(bands=BandLimits(max_requests=8))),
    (
        "flow/bands/-1",
        {"max_wait_s": 0.5, "max_bytes": 1024},
        FlowPolicy(band_limits=types.MappingProxyType({-1: BandLimits(max_bytes=1024, max_wait_s=0.5)})),
    ),
    ("flow/bands/2", {}, FlowPolicy(band_limits=types.MappingProxyType({2: BandLimits()}))),
    (
        "flow/bands/0",
        {"headroom": 0.25},
        FlowPolicy(band_limits=types.MappingProxyType({0: BandLimits(headroom=0.25)})),
    ),
    ("flow/sheddable_max_wait_s", 0, FlowPolicy(sheddable_max_wait_s=0.0)),
    ("flow/waiting_room_s", 2.5, FlowPolicy(waiting_room_s=2.5)),
    ("flow/fairness", "requests", FlowPolicy(fairness="requests")),
    ("flow/retry_after_s", 3, FlowPolicy(retry_after_s=3)),
    (
        "flow/bands/1",
        {"headroom": -0.5},
        FlowPolicy(band_limits=types.MappingProxyType({1: BandLimits(headroom=-0.5)})),
    ),
    ("flow/engine_priority", {}, FlowPolicy(engine_priority=EnginePriority())),
    (
        "flow/engine_priority",
        {"order": "high_first", "scale": 100},
        FlowPolicy(engine_priority=EnginePriority("high_first", 100)),
    ),
    ("flow/engine_priority", None, FlowPolicy()),
    (
        "objectives/interactive",
        {"priority": 2, "ttft_ms": 500, "tpot_ms": 20},
        FlowPolicy(objectives=types.MappingProxyType({"interactive": Objective("interactive", 2, 500, 20)})),
    ),
    (
        "objectives/team/batch",
        {"priority": -1},
        FlowPolicy(objectives=types.MappingProxyType({"team/batch": Objective("team/batch", -1)})),
    ),
]


@pytest.mark.parametrize(("path", "value", "expected"), GOOD)
def test_good_values(path: str, value: object, expected: FlowPolicy) -> None:
    assert apply_flow(FlowPolicy(), {path: value}) == expected


BAD: list[tuple[str, object, str]] = [
    ("flow/saturation", 8, "expected an object"),
    ("flow/saturation", {"max_queue": 1}, "unknown key(s) max_queue"),
    ("flow/saturation", {"max_waiting": -1}, "max_waiting: must be finite and >= 0"),
    ("flow/saturation", {"max_waiting": "8"}, "expected a number"),
    ("flow/saturation", {"max_waiting": True}, "expected a number"),
    ("flow/saturation", {"max_kv_usage": 1.5}, "a fraction of the KV cache"),
    ("flow/saturation", {"max_in_flight": float("inf")}, "must be finite"),
    ("flow/models/m", {"roles": {"encode": {}}}, "unknown role 'encode'"),
    ("flow/models/m", {"roles": []}, "expected an object of role -> limits"),
    ("flow/models/m", {"roles": {"prefill": {"max_waiting": -2}}}, "roles.prefill.max_waiting"),
    ("flow/models/", {}, "unknown policy path"),
    ("flow/models/a//b", {}, "unknown policy path"),
    ("flow/bands/default", {"max_requests": 0}, "max_requests: must be finite and >= 1"),
    ("flow/bands/default", {"max_requests": 1.5}, "expected an integer"),
    ("flow/bands/default", {"max_wait_s": -1}, "max_wait_s: must be finite and >= 0"),
    ("flow/bands/0", {"headroom": 1}, "-1 <= headroom < 1"),
    ("flow/bands/0", {"headroom": -1.5}, "headroom: must be finite and >= -1"),
    ("flow/engine_priority", {"order": "first"}, "order: expected one of low_first, high_first"),
    ("flow/engine_priority", {"scale": 0}, "scale: must be finite and >= 1"),
    ("flow/engine_priority", {"scale": 2, "field": "x"}, "unknown key(s) field"),
    ("flow/engine_priority", "vllm", "expected an object"),
    ("flow/bands/0", {"headroom": "0.2"}, "headroom: expected a number"),
    ("flow/bands/high", {}, "a band is named by its priority"),
    ("flow/bands/01", {}, "a band is named by its priority"),  # one band, one path
    ("flow/bands/+1", {}, "a band is named by its priority"),
    ("flow/bands/", {}, "unknown policy path"),
    ("flow/sheddable_max_wait_s", -0.1, "must be finite and >= 0"),
    ("flow/waiting_room_s", "5", "expected a number"),
    ("flow/fairness", "bytes", "expected one of tokens, requests"),
    ("flow/fairness", ["tokens"], "expected one of tokens, requests"),
    ("flow/retry_after_s", 0, "must be finite and >= 1"),
    ("flow/retry_after_s", 1.5, "expected an integer"),
    ("flow/queue", 1, "unknown policy path 'flow/queue'"),
    ("flow/saturation/max_waiting", 1, "unknown policy path"),
    ("objectives/x", {"priority": 1.5}, "priority: expected an integer"),
    ("objectives/x", {"priority": True}, "priority: expected an integer"),
    ("objectives/x", {"ttft_ms": 0}, "ttft_ms: must be finite and >= 1"),
    ("objectives/x", {"slo": 1}, "unknown key(s) slo"),
    ("objectives/x", 1, "expected an object"),
    ("objectives/", {}, "unknown policy path"),
    # longer than a held stream's Envoy message timeout allows (it would end in a bodiless 5xx, not a 429)
    ("flow/bands/default", {"max_wait_s": 3600}, "max_wait_s: at most 595 s"),
    ("flow/bands/-1", {"max_wait_s": 595.5}, "max_wait_s: at most 595 s"),
    ("flow/waiting_room_s", 1e6, "at most 595 s"),
    ("flow/sheddable_max_wait_s", 600, "at most 595 s"),
]


def test_the_longest_wait_fits_the_hold_extension() -> None:
    """The bound is the hold extension's cap less the slack the ext_proc asks past a wait, and it is
    itself accepted."""
    assert MAX_WAIT_S == HOLD_TIMEOUT_S - HOLD_SLACK_S
    policy = apply_flow(
        FlowPolicy(),
        {
            "flow/bands/default": {"max_wait_s": 595},
            "flow/waiting_room_s": 595,
            "flow/sheddable_max_wait_s": 595,
        },
    )
    assert (policy.bands.max_wait_s, policy.waiting_room_s, policy.sheddable_max_wait_s) == (595, 595, 595)


@pytest.mark.parametrize(("path", "value", "message"), BAD)
def test_bad_values_name_the_path(path: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_flow(FlowPolicy(), {path: value})
    assert message in str(info.value) and path in str(info.value)


@pytest.mark.parametrize("integer", [False, True])
def test_a_number_too_large_for_a_float_is_refused(integer: bool) -> None:
    huge = 10**400  # math.isfinite raised OverflowError on it, past every caller's ConfigError handler
    for value in (huge, -huge):
        with pytest.raises(ConfigError, match="flow/retry_after_s: must be finite"):
            number(value, "flow/retry_after_s", 0.0, integer=integer)
    with pytest.raises(ConfigError, match="flow/retry_after_s"):
        apply_flow(FlowPolicy(), {"flow/retry_after_s": huge})


def test_other_paths_are_ignored() -> None:
    assert apply_flow(FlowPolicy(), {"weights/prefix": "not mine"}) == FlowPolicy()


def test_check_flow_path() -> None:
    for path in ("flow/saturation", "flow/models/a/b", "flow/bands/-3", "objectives/x", "flow/fairness"):
        check_flow_path(path)
    with pytest.raises(ConfigError, match="flow paths: flow/saturation"):
        check_flow_path("flow/nope")


def test_limits_and_saturation_lookup() -> None:
    policy = apply_flow(
        FlowPolicy(),
        {
            "flow/bands/default": {"max_requests": 10, "max_wait_s": 30},
            "flow/bands/-1": {"max_wait_s": 20},
            "flow/sheddable_max_wait_s": 2,
            "flow/saturation": {"max_waiting": 8},
            "flow/models/m": {"roles": {"decode": {"max_in_flight": 3}}},
        },
    )
    assert policy.limits(0) == BandLimits(max_requests=10, max_wait_s=30)
    assert policy.limits(-1).max_wait_s == 2.0  # sheddable: capped
    assert policy.limits(-2).max_wait_s == 2.0
    assert policy.saturation_for("m", "decode") == Saturation(max_in_flight=3.0)
    assert policy.saturation_for("m", "prefill") == Saturation(max_waiting=8.0)  # the default
    assert policy.saturation_for("other", "both") == Saturation(max_waiting=8.0)
    assert policy.holds and not FlowPolicy().holds
    headroom = apply_flow(policy, {"flow/bands/0": {"headroom": 0.5}})
    assert (headroom.headroom(0), headroom.headroom(1), headroom.headroom(None)) == (0.5, 0.0, 0.0)


def test_flow_values_is_the_inverse_of_apply_flow() -> None:
    overrides = {path: value for path, value, _ in GOOD}
    policy = apply_flow(FlowPolicy(), overrides)
    values = flow_values(policy)
    assert apply_flow(FlowPolicy(), values) == policy
    assert values["objectives/team/batch"] == {"priority": -1, "ttft_ms": None, "tpot_ms": None}


FILE_TREE = {
    "saturation": {"max_waiting": 8},
    "waiting_room_s": 5,
    "models": {"org/llama-3": {"roles": {"prefill": {"max_in_flight": 4}}}},
    "bands": {"default": {"max_requests": 100}, "-1": {"max_requests": 64}},
}


def test_flow_paths_of_a_file_tree() -> None:
    assert flow_paths("flow", FILE_TREE, "f.flow") == {
        "flow/saturation": {"max_waiting": 8},
        "flow/waiting_room_s": 5,
        "flow/models/org/llama-3": {"roles": {"prefill": {"max_in_flight": 4}}},
        "flow/bands/default": {"max_requests": 100},
        "flow/bands/-1": {"max_requests": 64},
    }
    assert flow_paths("objectives", {"a/b": {"priority": 1}}, "f.objectives") == {
        "objectives/a/b": {"priority": 1}
    }


@pytest.mark.parametrize(
    ("top", "tree", "message"),
    [
        ("flow", {"queue": 1}, "f: unknown key 'queue'"),
        ("flow", {"models": 3}, "f.models: expected a table"),
        ("flow", {"bands": []}, "f.bands: expected a table"),
        ("flow", 3, "f: expected a table"),
        ("objectives", [], "f: expected a table"),
    ],
)
def test_flow_paths_refuse_bad_shapes(top: str, tree: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        flow_paths(top, tree, "f")


def test_parse_flow_of_a_gateway_config() -> None:
    policy = parse_flow(FILE_TREE, {"interactive": {"priority": 1, "ttft_ms": 500}})
    assert policy.saturation == Saturation(max_waiting=8.0) and policy.waiting_room_s == 5.0
    assert isinstance(policy.waiting_room_s, float)  # an integer in the file is still seconds as float
    assert policy.band_limits[-1].max_requests == 64 and policy.bands.max_requests == 100
    assert policy.objectives["interactive"] == Objective("interactive", 1, 500.0)
    assert parse_flow(None, None) == FlowPolicy()


@pytest.mark.parametrize(
    ("flow", "objectives", "message"),
    [
        ({"saturation": {"max_waiting": -1}}, None, "flow.saturation.max_waiting: must be"),
        ({"models": {"org/m": {"max_kv_usage": 2}}}, None, "flow.models.org/m.max_kv_usage"),
        ({"bands": {"x": {}}}, None, "a band is named by its priority"),
        ({"fairness": "bytes"}, None, "flow.fairness: expected one of"),
        (None, {"batch": {"priority": "low"}}, "objectives.batch.priority: expected an integer"),
    ],
)
def test_parse_flow_names_the_config_key(flow: object, objectives: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_flow(flow, objectives)
