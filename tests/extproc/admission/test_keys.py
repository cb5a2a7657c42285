"""API keys: hashing at rest, validation of the key file, live revocation, and ``kvgate apikey``."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from extproc.admission.keys import (
    PREFIX,
    ApiKey,
    KeyFile,
    KeyFileError,
    KeyStore,
    hash_key,
    new_key,
    parse_keys,
    read_keys,
    write_keys,
)
from kvgate import apikey


def test_keys_are_random_prefixed_and_hashed() -> None:
    a, b = new_key(), new_key()
    assert a != b and a.startswith(PREFIX) and len(a) >= len(PREFIX) + 43
    assert hash_key(a) == "sha256$" + hashlib.sha256(a.encode()).hexdigest()
    assert a not in hash_key(a)


def test_store_looks_up_by_hash_and_ignores_revoked() -> None:
    good, revoked = new_key(), new_key()
    store = KeyStore(
        [ApiKey("k1", "acme", hash_key(good), 1), ApiKey("k2", "acme", hash_key(revoked), 1, revoked=2)]
    )
    assert store.lookup(good) == ApiKey("k1", "acme", hash_key(good), 1)
    assert store.lookup(revoked) is None
    assert store.lookup(good + "x") is None
    assert store.lookup(hash_key(good)) is None  # the stored hash is not a credential
    assert store.valid == 1


HASH = "sha256$" + "a" * 64
RECORD = {"id": "k1", "tenant": "acme", "hash": HASH, "created": 1}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "expected an object"),
        ({"version": 2, "keys": []}, "unsupported version"),
        ({"keys": {}}, "keys: expected a list"),
        ({"keys": [], "extra": 1}, "expected an object"),
        ({"keys": ["k"]}, "keys[0]: expected an object"),
        ({"keys": [{**RECORD, "secret": "x"}]}, "keys[0]: unknown key(s) secret"),
        ({"keys": [{**RECORD, "tenant": ""}]}, "keys[0].tenant"),
        ({"keys": [{**RECORD, "hash": "plain-key"}]}, "keys[0].hash: expected sha256$"),
        ({"keys": [{**RECORD, "hash": "sha256$" + "A" * 64}]}, "keys[0].hash"),
        ({"keys": [{**RECORD, "hash": "md5$" + "a" * 64}]}, "keys[0].hash"),
        ({"keys": [{**RECORD, "revoked": "yes"}]}, "keys[0].revoked: expected unix seconds"),
        ({"keys": [{**RECORD, "created": True}]}, "keys[0].created"),
        ({"keys": [RECORD, RECORD]}, "keys: duplicate id"),
    ],
)
def test_bad_key_files_are_refused(raw: Any, message: str) -> None:
    with pytest.raises(KeyFileError) as err:
        parse_keys(raw)
    assert message in str(err.value)


def test_write_is_private_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    records = [ApiKey("k1", "acme", HASH, 5, "ci"), ApiKey("k2", "beta", "sha256$" + "b" * 64, 6, None, 9)]
    write_keys(path, records)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_keys(path).keys == tuple(records)
    assert read_keys(tmp_path / "missing.json").keys == ()


def test_key_file_sees_changes_at_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    path = tmp_path / "keys.json"
    key, other = new_key(), new_key()
    write_keys(path, [ApiKey("k1", "acme", hash_key(key), 1)])
    keys = KeyFile(path)
    assert keys.lookup(key) is not None and keys.lookup(other) is None
    write_keys(
        path, [ApiKey("k1", "acme", hash_key(key), 1, revoked=2), ApiKey("k2", "b", hash_key(other), 3)]
    )
    assert keys.lookup(key) is None  # revoked: refused on the very next lookup
    assert keys.lookup(other) is not None
    path.write_text("{broken")  # a bad file is ignored; the last good set stays
    assert keys.lookup(other) is not None and keys.lookup(key) is None
    os.remove(path)  # no file: no valid key
    assert keys.lookup(other) is None
    assert "rejected" in caplog.text and "missing" in caplog.text
    assert key not in caplog.text and other not in caplog.text and hash_key(key) not in caplog.text


def test_cli_create_revoke_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys.json"
    assert apikey.main(["create", "--tenant", "acme", "--name", "ci", "--file", str(path)]) == 0
    out, err = capsys.readouterr()
    key = out.strip()
    assert key.startswith(PREFIX) and key not in err
    stored = json.loads(path.read_text())
    assert key not in path.read_text() and stored["keys"][0]["hash"] == hash_key(key)
    key_id = stored["keys"][0]["id"]
    keys = KeyFile(path)
    assert keys.lookup(key) is not None
    assert apikey.main(["list", "--file", str(path)]) == 0
    listing = capsys.readouterr().out
    assert key_id in listing and "valid" in listing and "sha256" not in listing
    assert apikey.main(["revoke", key_id, "--file", str(path)]) == 0
    assert keys.lookup(key) is None
    assert apikey.main(["revoke", "key_nope", "--file", str(path)]) == 1
    assert apikey.main(["create", "--tenant", "bad tenant", "--file", str(path)]) == 1


def test_cli_checks_tenant_against_config(tmp_path: Path) -> None:
    config = tmp_path / "gateway.json"
    config.write_text(
        json.dumps({"auth": {"api_keys_file": "k"}, "tenants": [{"id": "acme", "models": ["*"]}]})
    )
    path = tmp_path / "keys.json"
    assert apikey.main(["create", "--tenant", "beta", "--config", str(config), "--file", str(path)]) == 1
    assert not path.exists()
    assert apikey.main(["create", "--tenant", "acme", "--config", str(config), "--file", str(path)]) == 0
