from __future__ import annotations

import json
import textwrap
import tomllib
from pathlib import Path

import pytest

from contracts.errors import ConfigError
from extproc import config as config_module
from extproc.config import (
    DEFAULT_MAX_BODY_BYTES,
    ModelConfig,
    SlotRestoreConfig,
    TokenizerConfig,
    default_max_body_bytes,
    load_config,
    parse_config,
)
from extproc.flow.policy import FlowPolicy, Objective, Saturation
from extproc.models.tokenizer import CacheLimits

ENDPOINT = {"id": "a", "address": "127.0.0.1:8000", "models": ["m"], "labels": {"zone": "z1"}}
MODEL_SPEC = {"name": "m", "gguf": "x"}


def test_defaults_and_endpoint() -> None:
    config = parse_config({"endpoints": [ENDPOINT], "models": [{"name": "m", "gguf": "smollm2"}]})
    assert config.extproc.listen == "127.0.0.1:9002" and config.index.block_size == 16
    assert config.extproc.gc == "deferred"
    assert parse_config({"extproc": {"gc": "python"}}).extproc.gc == "python"
    assert config.extproc.offload_rest_chars == 1024
    assert parse_config({"extproc": {"offload_rest_chars": 0}}).extproc.offload_rest_chars == 0  # always
    assert config.index.working_set_s == 20.0
    assert parse_config({"index": {"working_set_s": 0}}).index.working_set_s == 0.0  # off: occupancy
    (endpoint,) = config.endpoints
    assert endpoint.labels == (("zone", "z1"),) and endpoint.models == frozenset({"m"})
    assert config.scheduling.profiles[0].name == "default"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"bogus": 1}, "unknown key(s) bogus"),
        ({"extproc": {"listen": "nohost"}}, "extproc.listen"),
        ({"extproc": {"max_body_bytes": "big"}}, "extproc.max_body_bytes: expected int"),
        ({"extproc": {"conformance": 1}}, "expected bool"),
        ({"extproc": {"gc": "off"}}, "extproc.gc: expected one of deferred, python, got 'off'"),
        ({"extproc": {"offload_rest_chars": -1}}, "extproc.offload_rest_chars: must be >= 0, got -1"),
        ({"extproc": {"offload_rest_chars": "4k"}}, "extproc.offload_rest_chars: expected int"),
        ({"scrape": {"interval_s": -1}}, "scrape.interval_s"),
        ({"index": {"block_size": 0}}, "index.block_size"),
        ({"index": {"block_size": True}}, "got bool"),
        ({"index": {"working_set_s": -1}}, "index.working_set_s: must be a finite number >= 0"),
        ({"index": {"capacity_blocks": 0}}, "index.capacity_blocks: must be >= 1"),
        ({"index": {"chain_memo_entries": 0}}, "index.chain_memo_entries: must be >= 1"),
        ({"tokenizer": {"segment_cache_entries": 0}}, "tokenizer.segment_cache_entries: must be >= 1"),
        ({"tokenizer": {"segment_cache_tokens": "many"}}, "tokenizer.segment_cache_tokens: expected int"),
        ({"tokenizer": {"max_entries": 5}}, "tokenizer: unknown key(s) max_entries"),
        ({"endpoints": [{**ENDPOINT, "engine": "tgi"}]}, "endpoints[0].engine"),
        ({"endpoints": [{**ENDPOINT, "models": []}]}, "endpoints[0].models"),
        ({"endpoints": [ENDPOINT, ENDPOINT]}, "duplicate id"),
        ({"endpoints": [{**ENDPOINT, "labels": {"zone": 3}}]}, "labels.zone"),
        ({"models": [{"name": "m"}]}, "exactly one of model_dir or gguf"),
        ({"models": [{"name": "m", "gguf": "x", "extra": 1}]}, "unknown key(s) extra"),
        (
            {"models": [{"name": "m", "gguf": "x", "max_model_len": 0}]},
            "models[0].max_model_len: must be >= 1",
        ),
        ({"models": [{"name": "m", "gguf": "x", "max_model_len": "8k"}]}, "max_model_len: expected int"),
        ({"extproc": {"max_body_bytes": 100}}, "extproc.max_body_bytes: must be >= 1024"),
        ({"scheduling": {"plugins": [{"type": "nope"}], "profiles": []}}, "nope"),
        ({"slot_restore": {"min_blocks": 0}}, "slot_restore.min_blocks: must be >= 1"),
        ({"slot_restore": {"timeout_s": 0}}, "slot_restore.timeout_s: must be a finite number >= 0.001"),
        ({"slot_restore": {"timeout_s": 61}}, "slot_restore.timeout_s: must be <= 60.0"),
        ({"slot_restore": {"enabled": "yes"}}, "slot_restore.enabled: expected bool"),
        ({"slot_restore": {"min_block": 3}}, "slot_restore: unknown key(s) min_block"),
        ({"endpoints": [{**ENDPOINT, "slot_restore": "ftp://h/x"}]}, "slot_restore: expected an http"),
        ({"endpoints": [{**ENDPOINT, "slot_restore": "http://:80/x"}]}, "endpoints[0].slot_restore"),
        ({"endpoints": [{**ENDPOINT, "slot_restore": "http://h:0/x"}]}, "endpoints[0].slot_restore"),
        ({"endpoints": [{**ENDPOINT, "slot_restore": "http://h:port/x"}]}, "endpoints[0].slot_restore"),
        ({"endpoints": [{**ENDPOINT, "slot_restore": 7}]}, "endpoints[0].slot_restore: expected str"),
        ({"endpoints": [{**ENDPOINT, "slot_restore": "wss://h/x"}]}, "slot_restore: expected an http"),
        ({"endpoints": [{**ENDPOINT, "slot_restore": "https:///x"}]}, "endpoints[0].slot_restore"),
        ({"flow": {"saturation": {"max_waiting": -1}}}, "flow.saturation.max_waiting: must be finite"),
        ({"flow": {"saturation": {"max_kv_usage": 1.5}}}, "flow.saturation.max_kv_usage: a fraction"),
        ({"flow": {"bands": {"default": {"max_requests": 0}}}}, "flow.bands.default.max_requests"),
        ({"flow": {"bands": {"high": {}}}}, "flow.bands.high: a band is named by its priority"),
        ({"flow": {"fairness": "bytes"}}, "flow.fairness: expected one of tokens, requests"),
        ({"flow": {"retry_after_s": 0}}, "flow.retry_after_s: must be finite and >= 1"),
        ({"flow": {"queue": 1}}, "flow: unknown key 'queue'"),
        ({"flow": 3}, "flow: expected a table"),
        ({"objectives": {"chat": {"priority": "high"}}}, "objectives.chat.priority: expected an integer"),
        ({"objectives": {"chat": {"ttft": 5}}}, "objectives.chat: unknown key(s) ttft"),
    ],
)
def test_rejections_name_the_key(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"models": [{**MODEL_SPEC, "idle_timeout_s": 1e12}]},
            "models[0].idle_timeout_s: must be <= 315576000000",
        ),
        ({"models": [{**MODEL_SPEC, "request_timeout_s": 1e300}]}, "models[0].request_timeout_s: must be <="),
        (
            {"models": [{**MODEL_SPEC, "first_byte_timeout_s": 4e11}]},
            "models[0].first_byte_timeout_s: must be <=",
        ),
        ({"timeouts": {"request_s": 1e12}}, "timeouts.request_s: must be <= 315576000000"),
        ({"timeouts": {"first_byte_s": 1e12}}, "timeouts.first_byte_s: must be <= 315576000000"),
    ],
)
def test_a_timeout_longer_than_envoy_takes_is_refused(raw: dict[str, object], message: str) -> None:
    """``kvgate envoy-config --gateway-config`` renders ``idle_timeout_s`` into a route's ``idle_timeout``
    (a protobuf Duration, at most 315576000000 s): a longer one rendered a config Envoy refuses to load
    ("duration out of range"); it is refused where the config is read, the key named, and so is a longer
    request or first-byte bound (sent to Envoy as milliseconds), whose ``0`` already means none."""
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    assert message in str(err.value)
    fine = parse_config({"models": [{**MODEL_SPEC, "idle_timeout_s": 315_576_000_000}]})
    assert fine.models[0].idle_timeout_s == 315_576_000_000.0


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"scrape": {"interval_s": 10**400}}, "config.scrape.interval_s: must be a finite number"),
        ({"timeouts": {"request_s": 10**400}}, "config.timeouts.request_s: must be a finite number"),
        ({"overload": {"lag_interval_s": 10**400}}, "config.overload.lag_interval_s: must be a finite"),
        ({"extproc": {"max_body_bytes": 10**400}}, "config.extproc.max_body_bytes: must be <= "),
        ({"drift": {"window": 2**63}}, "config.drift.window: must be <= 9223372036854775807"),
        (
            {"tenants": [{"id": "t", "models": ["m"], "tokens": {"per_minute": 10**400}}]},
            "tenants[0].tokens.per_minute",
        ),
    ],
)
def test_an_integer_too_large_is_refused_naming_the_key(raw: dict[str, object], message: str) -> None:
    """JSON (and tomllib) read integers of any size: one past any float was an OverflowError (a
    traceback at start, not the config error ``kvgate extproc`` reports), and one past 64 bits was
    taken, to overflow later in float arithmetic (a tenant's token rate, ``per_minute / 60``)."""
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("extproc", "message"),
    [
        (
            {"health_listen": "127.0.0.1:9002"},
            "extproc.health_listen: 127.0.0.1:9002 is also extproc.listen's",
        ),
        (
            {"metrics_listen": "127.0.0.1:9003"},
            "extproc.metrics_listen: 127.0.0.1:9003 is also extproc.health",
        ),
        ({"listen": "0.0.0.0:9090"}, "extproc.metrics_listen: 127.0.0.1:9090 is also extproc.listen's"),
    ],
)
def test_the_ext_proc_health_and_metrics_ports_must_differ(extproc: dict[str, str], message: str) -> None:
    """gRPC binds with SO_REUSEPORT: an ext_proc and a health server on one port both started and split
    Envoy's connections between them (ext_proc streams reaching the health server fail)."""
    with pytest.raises(ConfigError) as err:
        parse_config({"extproc": extproc})
    assert message in str(err.value)
    apart = parse_config({"extproc": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0"}})
    assert apart.extproc.listen == apart.extproc.health_listen  # port 0: each its own free port
    parse_config({"extproc": {"listen": "10.0.0.1:9002", "health_listen": "127.0.0.1:9002"}})


def test_cache_bounds_default_and_configured() -> None:
    """The ext_proc's bounded caches keep their documented defaults unless configured."""
    default = parse_config({})
    assert default.index.capacity_blocks == 200_000 and default.index.chain_memo_entries == 200_000
    limits = CacheLimits()  # the tokenizer's own defaults
    assert (
        (default.tokenizer.segment_cache_entries, default.tokenizer.segment_cache_tokens)
        == (
            limits.max_entries,
            limits.max_tokens,
        )
        == (100_000, 4_000_000)
    )
    small = parse_config(
        {
            "index": {"capacity_blocks": 512, "chain_memo_entries": 1024},
            "tokenizer": {"segment_cache_entries": 256, "segment_cache_tokens": 4096},
        }
    )
    assert small.index.capacity_blocks == 512 and small.index.chain_memo_entries == 1024
    assert small.tokenizer == TokenizerConfig(segment_cache_entries=256, segment_cache_tokens=4096)


def test_flow_and_objectives_sections() -> None:
    assert parse_config({}).flow == FlowPolicy()
    config = parse_config(
        {
            "flow": {
                "waiting_room_s": 5,
                "saturation": {"max_waiting": 8},
                "models": {"org/m": {"roles": {"prefill": {"max_in_flight": 2}}}},
                "bands": {"-1": {"max_requests": 64}},
            },
            "objectives": {"interactive": {"priority": 1, "ttft_ms": 500}},
        }
    )
    flow = config.flow
    assert flow.waiting_room_s == 5.0 and flow.saturation == Saturation(max_waiting=8.0)
    assert flow.saturation_for("org/m", "prefill") == Saturation(max_in_flight=2.0)
    assert flow.band_limits[-1].max_requests == 64
    assert flow.objectives["interactive"] == Objective("interactive", 1, 500.0)
    doc = config_module.__doc__ or ""
    start = doc.index("    [flow]")
    example = tomllib.loads(textwrap.dedent(doc[start : doc.index("\n\n", start)]))
    documented = parse_config(example).flow  # the sample in the module docstring is a valid config
    assert documented.objectives["interactive"].ttft_ms == 500.0 and documented.saturation.checked


def test_slot_restore_section() -> None:
    config = parse_config({})
    assert config.slot_restore == SlotRestoreConfig(enabled=True, min_blocks=32, timeout_s=2.0)
    config = parse_config({"slot_restore": {"enabled": False, "min_blocks": 64, "timeout_s": 0.5}})
    assert config.slot_restore == SlotRestoreConfig(False, 64, 0.5)
    for url in (
        "http://10.0.0.7:7400/slots/restore-chain",
        "https://node-a.internal:7400/slots/restore-chain",
    ):
        (endpoint,) = parse_config({"endpoints": [{**ENDPOINT, "slot_restore": url}]}).endpoints
        assert endpoint.slot_restore == url  # https: agents with [agent.tls] (mTLS with [feeds])
    doc = config_module.__doc__ or ""
    start = doc.index("    [slot_restore]")
    example = tomllib.loads(textwrap.dedent(doc[start : doc.index("\n\n", start)]))
    assert parse_config(example).slot_restore == SlotRestoreConfig()  # the documented defaults


def test_load_toml_and_json(tmp_path: Path) -> None:
    toml = tmp_path / "g.toml"
    toml.write_text(
        '[extproc]\nlisten = "127.0.0.1:1234"\n[[endpoints]]\naddress = "10.0.0.1:80"\nmodels = ["m"]\n'
    )
    assert load_config(toml).endpoints[0].id == "10.0.0.1:80"
    js = tmp_path / "g.json"
    js.write_text(json.dumps({"endpoints": [ENDPOINT]}))
    assert load_config(js).endpoints[0].id == "a"
    bad = tmp_path / "bad.toml"
    bad.write_text("[extproc\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")


def test_context_length_and_body_limit_keys() -> None:
    config = parse_config({"models": [{"name": "m", "gguf": "smollm2", "max_model_len": 4096}]})
    assert config.models == (ModelConfig("m", gguf="smollm2", max_model_len=4096),)
    assert config.extproc.max_body_bytes is None  # not set: derived from the models (extproc.server)
    assert parse_config({"extproc": {"max_body_bytes": 2048}}).extproc.max_body_bytes == 2048


MIB = 1024 * 1024


@pytest.mark.parametrize(
    ("windows", "limit"),
    [
        ([], DEFAULT_MAX_BODY_BYTES),  # no model known: byte-digest routing
        ([None], DEFAULT_MAX_BODY_BYTES),
        ([(8192, 81)], 8192 * 81 * 6 + MIB),  # SmolLM2-135M-Instruct: 5,029,888
        ([(8192, 81), (2048, 20)], 8192 * 81 * 6 + MIB),  # the largest window
        ([(2048, 20), (8192, 81)], 8192 * 81 * 6 + MIB),
        ([(8192, 81), None], DEFAULT_MAX_BODY_BYTES),  # one model without a known window
        ([(131072, 256)], DEFAULT_MAX_BODY_BYTES),  # never above the former default
        ([(1, 1)], 6 + MIB),
    ],
)
def test_default_body_limit_follows_the_largest_context(
    windows: list[tuple[int, int] | None], limit: int
) -> None:
    assert default_max_body_bytes(windows) == limit
    assert DEFAULT_MAX_BODY_BYTES == 32 * MIB


def test_allowed_peers_default_to_envoy_and_are_checked() -> None:
    """``[extproc] tls_allowed_peers``: who may call the ext_proc port under TLS (Envoy's identity unless
    set); an empty or non-string list is refused."""
    assert parse_config({}).extproc.tls_allowed_peers == ("spiffe://kvgate.local/envoy-edge",)
    gateways = ["spiffe://kvgate.local/envoy-edge", "spiffe://kvgate.local/envoy-eu"]
    assert parse_config({"extproc": {"tls_allowed_peers": gateways}}).extproc.tls_allowed_peers == tuple(
        gateways
    )
    for bad in ([], [""], [3]):
        with pytest.raises(ConfigError, match="tls_allowed_peers"):
            parse_config({"extproc": {"tls_allowed_peers": bad}})


@pytest.mark.parametrize("address", ["host.example:8000", "localhost:8000"])
def test_a_static_endpoint_named_by_host_is_refused(address: str) -> None:
    """EDS serves ip:port only: a name was accepted, then never routed to (left out of every assignment)."""
    raw = {
        "endpoints": [{"address": "10.0.0.1:8000", "models": ["m"]}, {"address": address, "models": ["m"]}]
    }
    with pytest.raises(ConfigError, match=rf"endpoints\[1\]\.address: an IP address .* got '{address}'"):
        parse_config(raw)


def test_a_static_endpoint_by_ip_literal_is_taken() -> None:
    raw = {
        "endpoints": [
            {"address": "[fd00::1]:8000", "models": ["m"]},
            {"address": "10.0.0.1:80", "models": ["m"]},
        ]
    }
    assert [e.address for e in parse_config(raw).endpoints] == ["[fd00::1]:8000", "10.0.0.1:80"]
