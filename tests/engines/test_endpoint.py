"""engines.endpoint: the endpoint record's codec (etcd ``endpoints/<id>`` values)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from contracts.errors import ConfigError
from contracts.events import EndpointId
from engines.endpoint import Endpoint, decode_endpoint, encode_endpoint

FULL = Endpoint(
    id=EndpointId("node1-gpu0"),
    address="10.0.0.7:8000",
    models=frozenset({"m1", "m2"}),
    engine="sglang",
    metrics_url="http://10.0.0.7:8000/metrics",
    labels=(("pool", "a"), ("zone", "z1")),
    role="prefill",
    node="node1",
    feed="10.0.0.7:5557",
    kv_events=True,
    block_size=16,
    capacity_blocks=40000,
)


MINIMAL = Endpoint(id=EndpointId("e"), address="127.0.0.1:1", models=frozenset({"m"}))


@pytest.mark.parametrize("endpoint", [FULL, MINIMAL], ids=["full", "minimal"])
def test_codec_round_trip(endpoint: Endpoint) -> None:
    value = encode_endpoint(endpoint)
    assert decode_endpoint(endpoint.id, value) == endpoint
    assert set(json.loads(value)) == {
        "id", "address", "models", "engine", "role", "node", "feed", "kv_events", "metrics_url",
        "block_size", "capacity_blocks", "labels", "schema", "digest",
    }  # fmt: skip


def test_codec_slot_restore_round_trip() -> None:
    url = "http://10.0.0.7:7400/slots/restore-chain"
    endpoint = dataclasses.replace(FULL, engine="llama_cpp", slot_restore=url)
    value = encode_endpoint(endpoint)
    assert json.loads(value)["slot_restore"] == url
    assert decode_endpoint(endpoint.id, value) == endpoint
    assert "slot_restore" not in json.loads(encode_endpoint(FULL))  # absent when not offered
    assert decode_endpoint(FULL.id, _with(slot_restore=None)).slot_restore is None
    with pytest.raises(ConfigError, match="slot_restore: expected an http"):
        decode_endpoint(FULL.id, _with(slot_restore="unix:/run/agent.sock"))


def test_codec_bootstrap_port_round_trip() -> None:
    endpoint = dataclasses.replace(FULL, bootstrap_port=8998)
    value = encode_endpoint(endpoint)
    assert json.loads(value)["bootstrap_port"] == 8998
    assert decode_endpoint(endpoint.id, value) == endpoint
    assert "bootstrap_port" not in json.loads(encode_endpoint(FULL))  # absent when none
    for bad in (0, 70000, "8998"):
        with pytest.raises(ConfigError, match="bootstrap_port"):
            decode_endpoint(FULL.id, _with(bootstrap_port=bad))


def test_decode_accepts_defaults() -> None:
    endpoint = decode_endpoint("e", b'{"id": "e", "address": "h:1", "models": ["m"]}')
    assert (endpoint.engine, endpoint.role, endpoint.kv_events) == ("vllm", "both", False)
    assert endpoint.feed is None and endpoint.labels == ()


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("[FD00:0::1]:8000", "[fd00::1]:8000"),
        ("[fd00:0000:0000:0000:0000:0000:0000:0002]:8000", "[fd00::2]:8000"),
        ("[10.0.0.2]:8000", "10.0.0.2:8000"),
        ("[::FFFF:10.0.0.2]:8000", "[::ffff:10.0.0.2]:8000"),  # inet_ntop's form
        ("10.0.0.2:8000", "10.0.0.2:8000"),
        ("engine.local:8000", "engine.local:8000"),
    ],
)
def test_an_address_is_kept_as_envoy_names_its_host(given: str, canonical: str) -> None:
    """EDS, the failed-try log and ``override_host`` name a host as Envoy prints its socket: an endpoint
    registered under another spelling of an IP would be matched by none of them."""
    endpoint = decode_endpoint(FULL.id, _with(address=given))
    assert endpoint.address == canonical


def _with(**changes: object) -> bytes:
    doc = json.loads(encode_endpoint(FULL))
    for key, value in changes.items():
        if value is _DROP:
            del doc[key]
        else:
            doc[key] = value
    return json.dumps(doc).encode()


_DROP = object()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1]", "expected a table"),
        (_with(id="other"), "does not match the key"),
        (_with(address=_DROP), "address: required"),
        (_with(address="10.0.0.7"), "expected host:port"),
        (_with(models=[]), "non-empty list of model names"),
        (_with(models=["ok", 3]), "non-empty list of model names"),
        (_with(engine="tgi"), "engine: expected one of"),
        (_with(role="both-ways"), "role: expected one of"),
        (_with(feed="nowhere"), "feed: expected host:port"),
        (_with(kv_events="yes"), "kv_events: expected bool"),
        (_with(block_size=0), "block_size: must be >= 1"),
        (_with(block_size="16"), "block_size: expected int"),
        (_with(capacity_blocks=True), "capacity_blocks: expected int, got bool"),
        (_with(labels={"pool": 1}), "labels.pool: expected str"),
        (_with(metrics_url=5), "metrics_url: expected str"),
        (_with(extra=1), "unknown key"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_decode_refuses(value: bytes, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        decode_endpoint("node1-gpu0", value)
    assert str(info.value).startswith("endpoints/node1-gpu0")


def test_codec_priority_order_round_trip() -> None:
    for order in ("low_first", "high_first"):
        endpoint = dataclasses.replace(FULL, priority_order=order)
        value = encode_endpoint(endpoint)
        assert json.loads(value)["priority_order"] == order
        assert decode_endpoint(endpoint.id, value) == endpoint
    assert "priority_order" not in json.loads(encode_endpoint(FULL))  # absent when not declared
    with pytest.raises(ConfigError, match="priority_order: expected one of low_first, high_first"):
        decode_endpoint(FULL.id, _with(priority_order="fcfs"))
