"""contracts.etcd: settings, the key schema and policy paths (pure)."""

from __future__ import annotations

import pytest

from contracts.errors import ConfigError
from contracts.etcd import (
    EtcdSettings,
    drain_key,
    endpoint_key,
    parse_etcd_settings,
    policy_key,
    policy_path,
    split_key,
)


def test_settings_defaults() -> None:
    assert parse_etcd_settings({}, "etcd") == EtcdSettings()


def test_settings_full() -> None:
    raw = {
        "endpoints": ["10.0.0.1:2379", "10.0.0.2:2379"],
        "prefix": "/team/",
        "tls_ca": "ca.pem",
        "tls_cert": "c.pem",
        "tls_key": "k.pem",
        "tls_server_name": "etcd.local",
        "timeout_s": 0.5,
    }
    settings = parse_etcd_settings(raw, "etcd")
    assert settings.endpoints == ("10.0.0.1:2379", "10.0.0.2:2379")
    assert (settings.prefix, settings.tls_server_name, settings.timeout_s) == ("/team/", "etcd.local", 0.5)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"endpoint": ["a:1"]}, "unknown key(s) endpoint"),
        ({"endpoints": []}, "non-empty list"),
        ({"endpoints": ["nohost"]}, "expected host:port"),
        ({"endpoints": "a:1"}, "expected list"),
        ({"prefix": "/kvgate"}, "must end with '/'"),
        ({"tls_cert": "c.pem", "tls_ca": "ca.pem"}, "set all of tls_cert, tls_key"),
        ({"tls_cert": "c.pem", "tls_key": "k.pem"}, "needs tls_ca"),
        ({"timeout_s": 0}, "must be a finite number"),
        ("x", "expected a table"),
    ],
)
def test_settings_refused(raw: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_etcd_settings(raw, "etcd")


def test_keys() -> None:
    assert endpoint_key("/kvgate/", "vllm-0") == "/kvgate/endpoints/vllm-0"
    assert drain_key("/p/", "x") == "/p/drain/x"
    assert policy_key("/kvgate/", "weights/prefix") == "/kvgate/policy/weights/prefix"
    assert policy_key("/kvgate/", "models/org/model") == "/kvgate/models/org/model"
    assert policy_key("/kvgate/", "objectives/team/chat") == "/kvgate/objectives/team/chat"
    assert policy_key("/kvgate/", "flow/saturation") == "/kvgate/policy/flow/saturation"
    assert policy_key("/kvgate/", "flow/models/org/m") == "/kvgate/policy/flow/models/org/m"
    with pytest.raises(ConfigError):
        endpoint_key("/kvgate/", "")


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("/kvgate/endpoints/a", ("endpoints", "a")),
        (b"/kvgate/policy/weights/prefix", ("policy", "weights/prefix")),
        ("/kvgate/models/org/m", ("models", "org/m")),
        ("/other/endpoints/a", None),
        ("/kvgate/endpoints/", None),
        ("/kvgate/endpoints", None),
    ],
)
def test_split_key(key: str | bytes, expected: tuple[str, str] | None) -> None:
    assert split_key("/kvgate/", key) == expected


def test_policy_path() -> None:
    assert policy_path("policy", "weights/prefix") == "weights/prefix"
    assert policy_path("models", "org/m") == "models/org/m"
    assert policy_path("policy", "models/x") is None  # would shadow the models/ family
    assert policy_path("objectives", "team/chat") == "objectives/team/chat"
    assert policy_path("policy", "objectives/x") is None  # would shadow the objectives/ family
    assert policy_path("policy", "flow/models/org/m") == "flow/models/org/m"
    assert policy_path("drain", "x") is None
