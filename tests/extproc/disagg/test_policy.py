"""A model's serving mode: parsing, validation in the policy store, and the built disaggregation policy."""

from __future__ import annotations

import orjson
import pytest

from contracts.errors import ConfigError
from extproc.control.policy import ModelRoute, PolicyStore, pd_policy
from extproc.disagg.policy import PdSpec, parse_pd
from extproc.scheduling.registry import DEFAULT_SCHEDULING, parse_scheduling

PROFILES = parse_scheduling(
    {
        "plugins": [{"type": "prefix"}, {"type": "queue"}, {"type": "healthy"}, {"type": "max-score"}],
        "profiles": [
            {"name": "decode", "plugins": [{"ref": "healthy"}, {"ref": "queue"}, {"ref": "max-score"}]},
            {"name": "prefill", "plugins": [{"ref": "prefix", "weight": 3}, {"ref": "max-score"}]},
        ],
    }
)


@pytest.mark.parametrize(
    ("mode", "uncached", "expected"),
    [
        ("aggregated", 10_000, False),
        ("disaggregated", 0, True),
        ("conditional", 511, False),
        ("conditional", 512, True),
    ],
)
def test_disaggregates(mode: str, uncached: int, expected: bool) -> None:
    assert PdSpec(mode, 512).disaggregates(uncached) is expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "expected an object"),
        ({"mode": "sometimes"}, "mode must be one of"),
        ({"mode": 1}, "mode: expected one of"),
        ({"min_uncached_tokens": -1}, ">= 0"),
        ({"min_uncached_tokens": 1.5}, "expected an integer"),
        ({"min_uncached_tokens": True}, "expected an integer"),
        ({"prefill_timeout_s": 0}, "(0, 600]"),
        ({"prefill_timeout_s": "5"}, "number of seconds"),
        ({"prefill_profile": ""}, "profile name"),
        ({"threshold": 5}, "unknown key(s) threshold"),
    ],
)
def test_bad_specs(value: object, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_pd(value, "models/m.disaggregation")
    assert message in str(caught.value)
    assert "models/m.disaggregation" in str(caught.value)


def test_spec_round_trip() -> None:
    spec = parse_pd({"mode": "conditional", "min_uncached_tokens": 64, "prefill_profile": "p"}, "w")
    assert spec == PdSpec("conditional", 64, "p", 30.0)
    assert parse_pd(spec.to_json(), "w") == spec


def _route(value: object) -> bytes:
    return orjson.dumps(value)


def test_store_validates_and_hot_swaps_routes() -> None:
    store = PolicyStore(PROFILES)
    good = {"profile": "decode", "disaggregation": {"mode": "conditional", "prefill_profile": "prefill"}}
    policy = store.put("models/m", _route(good))
    assert policy is not None
    assert policy.routes["m"] == ModelRoute((), "decode", PdSpec("conditional", 512, "prefill", 30.0))
    assert store.get("models/m") == {
        "labels": {},
        "profile": "decode",
        **{"disaggregation": PdSpec("conditional", 512, "prefill", 30.0).to_json()},
    }
    built = pd_policy(policy, max_fallbacks=None)
    assert built.routes["m"].prefill.name == "prefill"
    # an unknown prefill profile is refused; the last good route stays in force
    bad = {"disaggregation": {"mode": "disaggregated", "prefill_profile": "nope"}}
    assert store.put("models/m", _route(bad)) is None
    assert "prefill_profile" in store.rejected["models/m"]
    assert store.policy.routes["m"].disaggregation == PdSpec("conditional", 512, "prefill", 30.0)
    assert store.put("models/m", _route({"disaggregation": {"mode": "sometimes"}})) is None


def test_pd_policy_skips_aggregated_and_plain_routes() -> None:
    store = PolicyStore(DEFAULT_SCHEDULING)
    store.put("models/a", _route({"disaggregation": {"mode": "aggregated"}}))
    store.put("models/b", _route({"labels": {"pool": "x"}}))
    policy = store.put(
        "models/c", _route({"labels": {"pool": "x"}, "disaggregation": {"mode": "disaggregated"}})
    )
    assert policy is not None
    built = pd_policy(policy, max_fallbacks=1)
    assert set(built.routes) == {"c"}
    route = built.routes["c"]
    assert route.labels == (("pool", "x"),) and route.prefill.name == "default"


def test_a_timeout_too_large_for_a_float_is_refused_and_the_last_good_route_stays() -> None:
    """JSON integers have no bound: ``1`` and 400 zeros is an integer Python cannot make a float of; the
    store refuses it as any bad value (a ConfigError), never with an OverflowError out of ``put``."""
    with pytest.raises(ConfigError, match=r"\(0, 600\]"):
        parse_pd({"prefill_timeout_s": 10**400}, "models/m.disaggregation")
    store = PolicyStore(PROFILES)
    good = {"disaggregation": {"mode": "disaggregated"}}
    assert store.put("models/m", _route(good)) is not None
    huge = b'{"disaggregation": {"mode": "disaggregated", "prefill_timeout_s": 1' + b"0" * 400 + b"}}"
    assert store.put("models/m", huge) is None
    assert "prefill_timeout_s" in store.rejected["models/m"]
    assert store.policy.routes["m"].disaggregation == PdSpec("disaggregated")
