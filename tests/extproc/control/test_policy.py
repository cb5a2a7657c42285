"""extproc.control.policy: the schema of every path kind, refusals that keep the last good value, and the file
source (TOML/JSON tree) giving the same policy as the same values in etcd."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import etcd3aio
import pytest

from contracts.errors import ConfigError
from contracts.etcd import encode_value, policy_key, policy_path, split_key
from contracts.events import EndpointId
from engines.endpoint import Endpoint
from extproc.control.policy import (
    KNOWN_PATHS,
    ModelRoute,
    Policy,
    PolicyStore,
    flatten_policy,
    load_policy_file,
    policy_tree,
    write_policy_file,
)
from extproc.flow.policy import BandLimits, FlowPolicy, Objective, Saturation
from extproc.scheduling.filters import LoadThresholdParams
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile, parse_scheduling

pytest_plugins = ("tests.etcd_fixtures",)

TWO_PROFILES = parse_scheduling(
    {
        "plugins": [{"type": t} for t in ("prefix", "queue", "max-score", "healthy", "load-threshold")],
        "profiles": [
            {"name": "default", "plugins": [{"ref": "prefix", "weight": 3}, {"ref": "max-score"}]},
            {"name": "batch", "plugins": [{"ref": "queue"}, {"ref": "max-score"}]},
        ],
    }
)


def _put(store: PolicyStore, path: str, value: object) -> Policy | None:
    return store.put(path, json.dumps(value).encode())


def _params(policy: Policy, plugin: str) -> object:
    return policy.scheduling.plugin(plugin).params


# -- accepted values, one per path kind -----------------------------------------------------------------


def test_global_weight_applies_to_every_profile() -> None:
    store = PolicyStore(TWO_PROFILES)
    policy = _put(store, "weights/prefix", 5)
    assert policy is not None
    assert policy.weight("prefix") == 5.0
    assert policy.weight("prefix", "batch") == 5.0  # added to the profile that lacked it
    build_profile(policy.scheduling, "batch")  # still a valid profile


def test_profile_weight_wins_over_global() -> None:
    store = PolicyStore(TWO_PROFILES)
    _put(store, "weights/queue", 2)
    policy = _put(store, "profiles/batch/weights/queue", 0.5)
    assert policy is not None
    assert (policy.weight("queue"), policy.weight("queue", "batch")) == (2.0, 0.5)


def test_weight_zero_turns_a_scorer_off() -> None:
    policy = _put(PolicyStore(), "weights/prefix", 0)
    assert policy is not None
    assert "prefix" not in {s.name for s, _ in build_profile(policy.scheduling).scorers}


def test_plugin_param_keeps_the_other_params() -> None:
    store = PolicyStore()
    policy = _put(store, "plugins/load-threshold/max_waiting", 16)
    assert policy is not None
    assert _params(policy, "load-threshold") == LoadThresholdParams(max_waiting=16.0)
    policy = _put(store, "plugins/load-threshold/max_in_flight_ratio", None)
    assert policy is not None
    expected = LoadThresholdParams(max_waiting=16.0, max_in_flight_ratio=None)
    assert _params(policy, "load-threshold") == expected


def test_index_values() -> None:
    store = PolicyStore(block_size=16, speculative_ttl_s=10.0)
    _put(store, "index/block_size", 32)
    policy = _put(store, "index/speculative_ttl_s", 2.5)
    assert policy is not None
    assert (policy.block_size, policy.speculative_ttl_s) == (32, 2.5)


def test_model_route() -> None:
    store = PolicyStore(TWO_PROFILES)
    policy = _put(store, "models/org/llama-3", {"labels": {"pool": "a"}, "profile": "batch"})
    assert policy is not None
    route = policy.routes["org/llama-3"]
    assert route == ModelRoute((("pool", "a"),), "batch")
    labels = (("pool", "a"), ("z", "1"))
    endpoint = Endpoint(EndpointId("e"), "h:1", frozenset({"org/llama-3"}), labels=labels)
    assert route.matches(endpoint)
    assert not route.matches(Endpoint(EndpointId("f"), "h:2", frozenset({"org/llama-3"})))
    assert _put(store, "models/plain", {}) is not None
    assert store.policy.routes["plain"] == ModelRoute()


def test_flow_and_objectives() -> None:
    store = PolicyStore()
    policy = _put(store, "flow/saturation", {"max_waiting": 8})
    assert policy is not None and policy.flow.saturation == Saturation(max_waiting=8.0)
    policy = _put(store, "objectives/interactive", {"priority": 2, "ttft_ms": 500})
    assert policy is not None
    assert policy.flow.objectives["interactive"] == Objective("interactive", 2, 500.0)
    assert policy.flow.saturation == Saturation(max_waiting=8.0)  # the other flow value stays
    policy = _put(store, "flow/bands/-1", {"max_requests": 4})
    assert policy is not None and policy.flow.band_limits[-1] == BandLimits(max_requests=4)
    assert policy.scheduling == DEFAULT_SCHEDULING  # flow paths leave scheduling alone
    assert store.get("flow/saturation") == {"max_waiting": 8.0, "max_in_flight": None, "max_kv_usage": None}
    assert store.get("objectives/interactive") == {"priority": 2, "ttft_ms": 500.0, "tpot_ms": None}
    assert store.get("objectives/undefined") is None and store.get("flow/models/m") is None
    assert store.get("flow/bands/7") == store.get("flow/bands/default")  # no bounds of its own
    assert store.get("flow/bands/-1") == {
        "max_requests": 4,
        "max_bytes": 256 << 20,
        "max_wait_s": 60.0,
        "headroom": 0.0,
    }
    policy = store.delete("objectives/interactive")
    assert policy is not None and "interactive" not in policy.flow.objectives
    assert "flow/" in KNOWN_PATHS and "objectives/<name>" in KNOWN_PATHS


def test_flow_defaults_from_the_store_base() -> None:
    base = FlowPolicy(waiting_room_s=5.0, objectives={"batch": Objective("batch", -1)})
    store = PolicyStore(flow=base)
    assert store.policy.flow == base and store.get("flow/waiting_room_s") == 5.0
    policy = _put(store, "flow/fairness", "requests")
    assert policy is not None
    assert policy.flow.waiting_room_s == 5.0 and policy.flow.fairness == "requests"
    assert policy.flow.objectives["batch"].priority == -1
    assert store.delete("flow/fairness") == store.base


def test_same_value_again_is_no_change() -> None:
    store = PolicyStore()
    assert _put(store, "weights/prefix", 3.0) is None  # equal to the default: the policy is unchanged
    assert store.overrides == {"weights/prefix": 3.0}
    assert _put(store, "weights/prefix", 4) is not None
    assert _put(store, "weights/prefix", 4.0) is None


# -- refused values -------------------------------------------------------------------------------------

REFUSED = [
    ("weights/prefix", b"{oops", "not valid JSON"),
    ("weights/prefix", b"true", "expected a number, got bool"),
    ("weights/prefix", b'"3"', "expected a number, got str"),
    ("weights/prefix", b"-1", "must be finite and >= 0"),
    ("weights/prefix", b"Infinity", "must be finite"),
    ("weights/nope", b"1", "no scorer named 'nope'"),
    ("weights/healthy", b"1", "no scorer named 'healthy'"),  # a filter takes no weight
    ("profiles/nope/weights/prefix", b"1", "no profile named 'nope'"),
    ("plugins/nope/x", b"1", "no plugin named 'nope'"),
    ("plugins/healthy/x", b"1", "takes no params"),
    ("plugins/load-threshold/max_wait", b"1", "has no param 'max_wait'"),
    ("plugins/load-threshold/max_waiting", b'"16"', "expected float"),
    ("plugins/load-threshold/max_waiting", b"-2", "max_waiting must be >= 0"),
    ("plugins/prefix/max_blocks", b"1.5", "expected int"),
    ("plugins/max-score/max_fallbacks", b"null", "expected int"),
    ("index/block_size", b"0", "must be finite and >= 1"),
    ("index/block_size", b"16.0", "expected an integer"),
    ("index/speculative_ttl_s", b"0", "must be finite and >= 0.001"),
    ("index/ttl_s", b"1", "unknown policy path"),
    ("models/m", b"[]", "expected an object"),
    ("models/m", b'{"labels": {"pool": 1}}', "string labels"),
    ("models/m", b'{"labels": {}, "fallback": []}', "unknown key(s) fallback"),
    ("models/m", b'{"labels": {}, "cascade": []}', "labels cannot go with it"),
    ("models/m", b'{"profile": "nope"}', "no profile named 'nope'"),
    ("models/", b"{}", "unknown policy path"),
    ("weight/prefix", b"1", "unknown policy path"),
    ("tenants/acme", b"{}", "unknown policy path"),
    ("flow/saturation", b'{"max_waiting": -1}', "max_waiting: must be finite and >= 0"),
    ("flow/saturation", b'{"max_kv_usage": 2}', "a fraction of the KV cache"),
    ("flow/models/org/m", b'{"roles": {"encode": {}}}', "unknown role 'encode'"),
    ("flow/bands/default", b'{"max_requests": 0}', "must be finite and >= 1"),
    ("flow/bands/high", b"{}", "a band is named by its priority"),
    ("flow/fairness", b'"bytes"', "expected one of tokens, requests"),
    ("flow/retry_after_s", b"0", "must be finite and >= 1"),
    ("flow/waiting_room_s", b"-1", "must be finite and >= 0"),
    ("flow/queue", b"1", "unknown policy path"),
    ("objectives/x", b'{"priority": "high"}', "priority: expected an integer"),
    ("objectives/x", b'{"ttft_ms": 0}', "must be finite and >= 1"),
    ("objectives/", b"{}", "unknown policy path"),
]


@pytest.mark.parametrize(("path", "raw", "message"), REFUSED)
def test_refused_values_keep_the_default(path: str, raw: bytes, message: str) -> None:
    store = PolicyStore()
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        store.validate(path, raw)
    assert path in str(info.value)
    assert store.put(path, raw) is None
    assert message in store.rejected[path]
    assert store.policy == store.base
    assert store.overrides == {}


def test_refused_value_keeps_the_last_good_one() -> None:
    store = PolicyStore()
    _put(store, "weights/prefix", 5)
    _put(store, "plugins/load-threshold/max_waiting", 12)
    good = store.policy
    assert store.put("weights/prefix", b'"heavy"') is None
    assert store.put("plugins/load-threshold/max_waiting", b"-1") is None
    assert store.policy is good
    assert store.get("weights/prefix") == 5.0
    assert set(store.rejected) == {"weights/prefix", "plugins/load-threshold/max_waiting"}
    assert _put(store, "weights/prefix", 6) is not None  # a good value clears the refusal
    assert "weights/prefix" not in store.rejected


def test_refused_flow_value_keeps_the_last_good_one() -> None:
    store = PolicyStore()
    _put(store, "flow/saturation", {"max_waiting": 8})
    _put(store, "objectives/chat", {"priority": 1})
    good = store.policy
    assert store.put("flow/saturation", b'{"max_waiting": "many"}') is None
    assert store.put("objectives/chat", b'{"priority": 1.5}') is None
    assert store.policy is good
    assert store.get("flow/saturation") == {"max_waiting": 8.0, "max_in_flight": None, "max_kv_usage": None}
    assert store.get("objectives/chat") == {"priority": 1, "ttft_ms": None, "tpot_ms": None}
    assert set(store.rejected) == {"flow/saturation", "objectives/chat"}


def test_delete_returns_to_the_default() -> None:
    store = PolicyStore()
    _put(store, "weights/prefix", 5)
    policy = store.delete("weights/prefix")
    assert policy is not None and policy.weight("prefix") == 3.0
    assert store.delete("weights/prefix") is None
    assert store.delete("never/set") is None


def test_load_is_all_or_nothing() -> None:
    store = PolicyStore()
    _put(store, "weights/queue", 7)
    with pytest.raises(ConfigError, match="weights/prefix"):
        store.load({"weights/in-flight": b"2", "weights/prefix": b"-3"})
    assert store.overrides == {"weights/queue": 7}
    policy = store.load({"weights/in-flight": b"2"})
    assert policy.weight("in-flight") == 2.0 and policy.weight("queue") == 2.0


def test_effective_lists_every_path() -> None:
    store = PolicyStore()
    _put(store, "weights/prefix", 4)
    _put(store, "models/m", {"labels": {"a": "b"}})
    effective = store.effective()
    assert effective["weights/prefix"] == 4.0
    assert effective["weights/kv-utilization"] == 0.0  # configured, unused by the default profile
    assert effective["plugins/load-threshold/max_waiting"] == 8.0
    assert effective["plugins/max-score/max_fallbacks"] == 2
    assert effective["index/block_size"] == 16 and effective["index/speculative_ttl_s"] == 10.0
    assert effective["models/m"] == {"labels": {"a": "b"}, "profile": None}
    assert effective["flow/fairness"] == "tokens" and effective["flow/retry_after_s"] == 1
    assert effective["flow/bands/default"] == store.get("flow/bands/default")
    assert effective["flow/bands/default"] == {
        "max_requests": 1024,
        "max_bytes": 1 << 28,
        "max_wait_s": 60.0,
        "headroom": 0.0,
    }
    assert not any(p.startswith("objectives/") for p in effective)  # none defined
    assert not any(p.startswith("profiles/") for p in effective)
    assert list(effective) == sorted(effective)
    assert all(store.get(path) == value for path, value in effective.items())
    assert store.get("models/unrouted") is None


def test_effective_with_several_profiles() -> None:
    effective = PolicyStore(TWO_PROFILES).effective()
    assert effective["profiles/batch/weights/queue"] == 1.0
    assert effective["profiles/default/weights/prefix"] == 3.0
    assert effective["profiles/batch/weights/prefix"] == 0.0


def test_from_config() -> None:
    from extproc.config import parse_config

    config = parse_config(
        {
            "index": {"block_size": 32, "speculative_ttl_s": 4},
            "flow": {"saturation": {"max_waiting": 4}},
            "objectives": {"chat": {"priority": 1}},
        }
    )
    store = PolicyStore.from_config(config)
    assert (store.policy.block_size, store.policy.speculative_ttl_s) == (32, 4.0)
    assert store.policy.scheduling == DEFAULT_SCHEDULING
    assert store.policy.flow == config.flow and store.get("flow/saturation") == {
        "max_waiting": 4.0,
        "max_in_flight": None,
        "max_kv_usage": None,
    }
    assert store.get("objectives/chat") == {"priority": 1, "ttft_ms": None, "tpot_ms": None}


# -- the file source ------------------------------------------------------------------------------------

POLICY_TOML = """
[weights]
prefix = 3.5
queue = 1

[profiles.batch.weights]
queue = 0.5

[plugins.load-threshold]
max_waiting = 16

[index]
block_size = 32
speculative_ttl_s = 5

[models."org/llama-3"]
labels = { pool = "a" }
profile = "batch"

[flow]
waiting_room_s = 5
fairness = "requests"

[flow.saturation]
max_waiting = 8

[flow.models."org/llama-3".roles.prefill]
max_in_flight = 4

[flow.bands.-1]
max_requests = 64

[flow.bands.default]
max_wait_s = 30

[objectives.interactive]
priority = 1
ttft_ms = 500

[objectives."team/batch"]
priority = -1
"""

FLAT = {
    "weights/prefix": 3.5,
    "weights/queue": 1,
    "profiles/batch/weights/queue": 0.5,
    "plugins/load-threshold/max_waiting": 16,
    "index/block_size": 32,
    "index/speculative_ttl_s": 5,
    "models/org/llama-3": {"labels": {"pool": "a"}, "profile": "batch"},
    "flow/waiting_room_s": 5,
    "flow/fairness": "requests",
    "flow/saturation": {"max_waiting": 8},
    "flow/models/org/llama-3": {"roles": {"prefill": {"max_in_flight": 4}}},
    "flow/bands/-1": {"max_requests": 64},
    "flow/bands/default": {"max_wait_s": 30},
    "objectives/interactive": {"priority": 1, "ttft_ms": 500},
    "objectives/team/batch": {"priority": -1},
}


def test_flatten_and_tree_are_inverse() -> None:
    tree = tomllib.loads(POLICY_TOML)
    assert flatten_policy(tree, "f") == FLAT
    assert flatten_policy(policy_tree(FLAT), "f") == FLAT


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"weight": {}}, "unknown table 'weight'"),
        ({"weights": 3}, "expected a table"),
        ({"plugins": {"load-threshold": 16}}, "plugins.load-threshold: expected a table"),
        ({"profiles": {"batch": 1}}, "profiles.batch: expected a table"),
        ({"flow": {"queue": 1}}, "flow: unknown key 'queue'"),
        ({"flow": {"models": 1}}, "flow.models: expected a table"),
        ({"objectives": 1}, "objectives: expected a table"),
        ([], "expected a table"),
    ],
)
def test_flatten_refuses_bad_shapes(tree: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        flatten_policy(tree, "f")


def test_file_paths_are_checked_like_etcd_paths() -> None:
    paths = flatten_policy({"profiles": {"batch": {"plugins": {"queue": 1}}}}, "f")
    assert paths == {"profiles/batch/plugins/queue": 1}
    with pytest.raises(ConfigError, match="unknown policy path 'profiles/batch/plugins/queue'"):
        PolicyStore(TWO_PROFILES).load({p: encode_value(v) for p, v in paths.items()})


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_policy_file_round_trip(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"policy{suffix}"
    items = {p: encode_value(v) for p, v in FLAT.items()}
    items['models/odd "name"'] = encode_value({"labels": {"k.x": "v\u00e9\x7f"}})
    write_policy_file(path, items)
    assert load_policy_file(path) == items
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def test_toml_cannot_hold_null(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    with pytest.raises(ConfigError, match=r"use a \.json policy file"):
        write_policy_file(path, {"plugins/load-threshold/max_kv_usage": b"null"})
    assert not path.exists()
    write_policy_file(tmp_path / "policy.json", {"plugins/load-threshold/max_kv_usage": b"null"})


def test_load_policy_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_policy_file(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[weights\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_policy_file(bad)


async def test_file_source_equals_etcd_source(
    tmp_path: Path, etcd_client: etcd3aio.Etcd3Client, etcd_prefix: str
) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(POLICY_TOML)
    from_file = PolicyStore(TWO_PROFILES)
    from_file.load(load_policy_file(path))

    assert etcd_client.kv is not None
    for item, value in FLAT.items():
        await etcd_client.kv.put(policy_key(etcd_prefix, item), encode_value(value))
    response = await etcd_client.kv.get(etcd_prefix, etcd3aio.prefix_range_end(etcd_prefix))
    from_etcd = PolicyStore(TWO_PROFILES)
    for kv in response.kvs:
        parsed = split_key(etcd_prefix, kv.key)
        assert parsed is not None
        item_path = policy_path(*parsed)
        assert item_path is not None
        from_etcd.put(item_path, bytes(kv.value))
    assert from_etcd.rejected == {}
    assert from_etcd.policy == from_file.policy
    assert from_etcd.effective() == from_file.effective()
