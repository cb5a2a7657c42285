"""The burst room's pure core: config validation, the rule, the token bucket; the flow/burst policy."""

from __future__ import annotations

from typing import Any

import pytest

from contracts.errors import ConfigError
from extproc.burst.core import (
    BURST_KINDS,
    NO_BUDGET,
    SENT,
    Burster,
    TokenBucket,
    burst_body,
    parse_burst,
    wants_burst,
)
from extproc.config import parse_config
from extproc.flow.policy import FlowPolicy, apply_flow, parse_flow

GOOD: dict[str, Any] = {
    "name": "hosted",
    "host": "api.example.com",
    "api_key_file": "/run/keys/hosted",
    "models": {"local-a": "remote-a", "local-b": "remote-b"},
}


def test_a_good_endpoint_parses_with_its_defaults() -> None:
    (e,) = parse_burst([GOOD])
    assert (e.name, e.host, e.port, e.ca_file, e.cluster) == (
        "hosted",
        "api.example.com",
        443,
        None,
        "kvgate_burst_hosted",
    )
    assert dict(e.models) == {"local-a": "remote-a", "local-b": "remote-b"}
    assert parse_burst(None) == ()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"engine": "vllm"}, "openai_compat"),
        ({"name": "Bad Name"}, "name"),
        ({"host": "10.0.0.1"}, "DNS name"),
        ({"host": "bad_host!"}, "DNS name"),
        ({"port": 0}, "port"),
        ({"port": 70000}, "port"),
        ({"models": {}}, "models"),
        ({"models": {"a": ""}}, "models"),
        ({"api_key_file": None}, "api_key_file"),
        ({"ca_file": ""}, "ca_file"),
        ({"api_key": "sk-inline"}, "api_key"),  # keys live in files, never in the config
    ],
)
def test_bad_endpoints_are_refused(change: dict[str, Any], message: str) -> None:
    raw = {**GOOD, **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        parse_burst([raw])


def test_names_are_unique_and_a_model_bursts_to_one_endpoint() -> None:
    with pytest.raises(ConfigError, match="duplicate"):
        parse_burst([GOOD, {**GOOD, "models": {"x": "y"}}])
    with pytest.raises(ConfigError, match="local-a"):
        parse_burst([GOOD, {**GOOD, "name": "other"}])


def test_the_gateway_config_reads_and_refuses_burst_tables() -> None:
    assert parse_config({"burst": [GOOD]}).burst[0].name == "hosted"
    with pytest.raises(ConfigError, match=r"burst\[0\]\.host"):
        parse_config({"burst": [{**GOOD, "host": "1.2.3.4"}]})


def test_the_rule() -> None:
    assert not wants_burst(False, None, True)  # room locally: never
    assert not wants_burst(False, 0.1, True)
    assert wants_burst(True, None, False)  # no deadline: whenever it would be queued
    assert not wants_burst(True, 0.5, False)  # a deadline the local fleet may still make: it waits
    assert wants_burst(True, 0.5, True)  # predicted to miss it even routed now


def test_the_bucket_starts_full_and_refills_per_minute() -> None:
    bucket = TokenBucket()
    assert [bucket.take(2, 0.0) for _ in range(3)] == [True, True, False]
    assert not bucket.take(2, 29.0)  # 29 s x 2/60 = 0.97 token
    assert bucket.take(2, 30.5)
    assert bucket.level(2, 1000.0) == 2  # capped at a minute's budget
    assert bucket.level(0, 1000.0) == 0 and not bucket.take(0, 1000.0)  # budget 0: nothing
    assert TokenBucket().level(0.5, 0.0) == 1  # a budget under one a minute still holds one


def test_level_changes_nothing() -> None:
    bucket = TokenBucket()
    bucket.take(1, 0.0)
    bucket.level(1, 120.0)
    assert bucket.at == 0.0 and bucket.tokens == 0.0


def test_a_raised_budget_does_not_count_the_pause_before_it_at_the_new_rate() -> None:
    """1 a minute, spent at t=0; raised to 600 at t=59: the 59 s before count at 1/min (0.98 token), so
    nothing is sent at once; from then on 10 a second."""
    burster = Burster(parse_burst([GOOD]))
    target = burster.target("local-a")
    assert target is not None
    burster.rerate(1, 0.0)
    assert burster.take(target, 1, 0.0) and not burster.take(target, 1, 0.0)
    burster.rerate(600, 59.0)
    assert burster.left(600, 59.0)["hosted"] < 1
    assert sum(burster.take(target, 600, 59.0) for _ in range(600)) == 0
    assert sum(burster.take(target, 600, 60.0) for _ in range(600)) == 10  # one second at 10/s
    # Not told (take sees the new budget first): the pause counts at the old rate up to that request.
    quiet = Burster(parse_burst([GOOD]))
    assert quiet.take(target, 1, 0.0)
    assert sum(quiet.take(target, 600, 59.0) for _ in range(600)) == 0


def test_a_lowered_budget_keeps_only_the_tokens_left_capped() -> None:
    bucket = TokenBucket()
    assert bucket.take(600, 0.0)
    bucket.rerate(2, 1.0)
    assert bucket.level(2, 1.0) == 2


def test_the_burster_counts_outcomes() -> None:
    burster = Burster(parse_burst([GOOD]))
    target = burster.target("local-a")
    assert target is not None and burster.target("other") is None
    assert [burster.take(target, 1, 0.0) for _ in range(2)] == [True, False]
    assert burster.counts == {("hosted", SENT): 1, ("hosted", NO_BUDGET): 1}
    assert burster.left(1, 30.0) == {"hosted": 0.5}


def test_the_budget_left_writes_nothing() -> None:
    """The metrics read it from their scrape thread while the loop may iterate the buckets (a rerate):
    an endpoint never sent to gets no bucket from a read, only the full budget it would have."""
    burster = Burster(parse_burst([GOOD]))
    assert burster.left(6, 0.0) == {"hosted": 6.0}
    assert burster.buckets == {}


def test_flow_burst_policy_is_validated() -> None:
    assert parse_flow({"burst": {"max_per_minute": 30}}, None).burst_per_minute == 30
    assert FlowPolicy().burst_per_minute == 0
    for bad in ({"max_per_minute": -1}, {"max_per_minute": "many"}, {"per_hour": 3}, 5, {}):
        with pytest.raises(ConfigError, match="flow/burst"):
            apply_flow(FlowPolicy(), {"flow/burst": bad})


def test_the_burst_body_drops_what_bills_or_reaches_the_gateways_account() -> None:
    client = {
        "model": "local-a",
        "prompt": "p",
        "service_tier": "priority",
        "store": True,
        "conversation": "conv_1",
        "previous_response_id": "resp_1",
        "metadata": {"a": "b"},
        "priority": -100,
        "cache_salt": "s",
        "user": "u",
        "safety_identifier": "i",
        "max_tokens": 5,
    }
    completion = burst_body("completion", client, "hosted")
    assert completion == {"model": "hosted", "prompt": "p", "max_tokens": 5}  # no store there: dropped
    assert burst_body("chat", client, "hosted") == {
        "model": "hosted",
        "prompt": "p",
        "store": False,
        "max_tokens": 5,
    }
    assert burst_body("responses", client, "hosted") == {"model": "hosted", "store": False, "max_tokens": 5}
    assert burst_body("embedding", {"model": "m", "input": "x", "user": "u"}, "h") == {
        "model": "h",
        "input": "x",
    }
    assert client["store"] is True  # the client's body is not changed
    assert {"chat", "completion", "embedding"} == BURST_KINDS
