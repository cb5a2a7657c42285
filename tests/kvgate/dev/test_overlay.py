"""`kvgate up --config FILE`: what merges over the generated gateway config, and what stays the launcher's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from contracts.errors import ConfigError
from kvgate.dev.overlay import check, load, merge

GENERATED: dict[str, Any] = {
    "extproc": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "max_body_bytes": 2048},
    "models": [{"name": "SmolLM2-135M-Instruct", "model_dir": "/m/smollm2"}],
    "endpoints": [{"id": "sim-0", "address": "127.0.0.1:9", "models": ["SmolLM2-135M-Instruct"]}],
    "auth": {"api_keys_file": "dev.json", "settle": "usage"},
    "tenants": [{"id": "dev", "models": ["*"]}],
}


def test_tables_merge_key_by_key_models_by_name_and_other_arrays_replace() -> None:
    overlay = {
        "extproc": {"max_body_bytes": 4096, "max_fallbacks": 0},
        "index": {"block_size": 32},
        "models": [
            {"name": "SmolLM2-135M-Instruct", "model_dir": "/mine"},
            {"name": "other", "gguf": "/other.gguf"},
        ],
        "auth": {"settle": "reservation"},
        "tenants": [{"id": "acme", "models": ["*"]}],
    }
    merged = merge(GENERATED, overlay)
    assert merged["extproc"] == {
        "listen": "127.0.0.1:0",
        "health_listen": "127.0.0.1:0",
        "max_body_bytes": 4096,
        "max_fallbacks": 0,
    }
    assert merged["index"] == {"block_size": 32}
    assert merged["models"] == overlay["models"]
    assert merged["auth"] == {"api_keys_file": "dev.json", "settle": "reservation"}
    assert merged["tenants"] == [{"id": "acme", "models": ["*"]}]
    assert merged["endpoints"] == GENERATED["endpoints"]
    assert GENERATED["extproc"]["max_body_bytes"] == 2048  # the inputs are not modified


def test_a_new_model_is_added_to_the_generated_ones() -> None:
    merged = merge(GENERATED, {"models": [{"name": "other", "gguf": "/other.gguf"}]})
    assert [m["name"] for m in merged["models"]] == ["SmolLM2-135M-Instruct", "other"]


@pytest.mark.parametrize(
    ("overlay", "named"),
    [
        ({"endpoints": []}, "endpoints"),
        ({"etcd": {"endpoints": ["10.0.0.1:2379"]}}, "etcd"),
        ({"feeds": {}}, "feeds"),
        ({"extproc": {"listen": "0.0.0.0:9002"}}, "extproc.listen"),
        ({"extproc": {"metrics_listen": "0.0.0.0:9090", "tls_cert": "c.pem"}}, "extproc.metrics_listen, "),
        ({"scrape": {"tls_ca": "ca.pem"}}, "scrape.tls_ca"),
    ],
)
def test_the_launchers_keys_are_refused(overlay: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match="set by kvgate up itself") as info:
        check(overlay, dev_auth=False)
    assert str(info.value).startswith(named)


def test_limits_and_policy_are_the_users() -> None:
    check({"extproc": {"max_body_bytes": 4096}, "scrape": {"interval_s": 0.5}, "policy": {}}, dev_auth=False)


@pytest.mark.parametrize("section", ["auth", "tenants"])
def test_auth_sections_clash_with_dev_auth(section: str) -> None:
    check({section: {}}, dev_auth=False)
    with pytest.raises(ConfigError, match=f"^{section}: --auth sets up its own"):
        check({section: {}}, dev_auth=True)


def test_load_validates_the_file_on_its_own(tmp_path: Path) -> None:
    good = tmp_path / "gateway.toml"
    good.write_text(
        '[extproc]\nmax_body_bytes = 4096\n[auth]\napi_keys_file = "keys.json"\n'
        '[[tenants]]\nid = "acme"\nmodels = ["*"]\n'
    )
    assert load(good, dev_auth=False) == {
        "extproc": {"max_body_bytes": 4096},
        "auth": {"api_keys_file": "keys.json"},
        "tenants": [{"id": "acme", "models": ["*"]}],
    }


@pytest.mark.parametrize(
    ("name", "text", "reason"),
    [
        ("bad.toml", "[extproc\n", "not valid TOML"),
        ("bad.json", "[1, 2]", "expected a table at the top, got list"),
        ("typo.toml", "[index]\nblok_size = 32\n", "index: unknown key(s) blok_size"),
        ("value.toml", "[index]\nblock_size = 0\n", "index.block_size: must be >= 1"),
        ("launcher.toml", '[extproc]\nlisten = "0.0.0.0:1"\n', "extproc.listen: set by kvgate up itself"),
        ("tenants.toml", '[[tenants]]\nid = "acme"\nmodels = ["*"]\n', "tenants: need an [auth] section"),
    ],
)
def test_load_refuses_a_bad_file(tmp_path: Path, name: str, text: str, reason: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load(path, dev_auth=False)
    assert reason in str(info.value)


def test_load_of_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load(tmp_path / "nope.toml", dev_auth=False)
