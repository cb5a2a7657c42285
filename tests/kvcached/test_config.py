"""kvcached config: the documented example parses; mistakes are errors naming the key."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

import kvcached.config
from contracts.kvcached import MESSAGE_SLACK
from kvcached.config import (
    MAX_CONCURRENT_RPCS_DEFAULT,
    KvcachedConfig,
    QuicSettings,
    StaticPeer,
    TlsFiles,
    load_kvcached_config,
    parse_kvcached_config,
)
from kvcached.errors import KvcachedConfigError
from kvcached.peers import REQUEST_CHARGE_BYTES, buffer_bytes_default, response_charge_max


def _example() -> str:
    doc = kvcached.config.__doc__ or ""
    block = doc.split("Example (every key)::", 1)[1]
    lines = [line[4:] if line.startswith("    ") else line for line in block.splitlines()]
    return "\n".join(lines)


def test_docstring_example_parses() -> None:
    cfg = parse_kvcached_config(tomllib.loads(_example()))
    assert cfg.node == "node-a"
    assert cfg.listen_unix == "/run/kvgate/kvcached.sock"
    assert cfg.listen_tcp == "127.0.0.1:0"
    assert cfg.ram_bytes == 1 << 30
    assert cfg.ssd_path == Path("/var/lib/kvgate/kvcached")
    assert cfg.ssd_bytes == 64 << 30
    assert cfg.max_block_bytes == 64 << 20
    assert cfg.max_concurrent_rpcs == 64
    assert cfg.write_through is False
    assert cfg.tls == TlsFiles(
        Path("/etc/kvgate/kvcached.pem"), Path("/etc/kvgate/kvcached.key"), Path("/etc/kvgate/ca.pem")
    )
    assert cfg.quic == QuicSettings("127.0.0.1:0", 64, 1.25e9, 2.0, 8, 1200, 1 << 30)
    assert cfg.peers == (StaticPeer("node-b", "10.0.0.8:4433"),)
    assert cfg.etcd_raw is not None and list(cfg.etcd_raw["endpoints"]) == ["127.0.0.1:2379"]
    with pytest.raises(TypeError):
        cfg.etcd_raw["x"] = 1  # type: ignore[index]


def test_minimal_defaults() -> None:
    cfg = parse_kvcached_config({"kvcached": {"ram_bytes": 1024, "listen_unix": "/tmp/k.sock"}})
    assert cfg == KvcachedConfig(node=cfg.node, ram_bytes=1024, listen_unix="/tmp/k.sock")
    assert cfg.ssd_path is None and cfg.quic is None and cfg.tls is None and cfg.etcd_raw is None


_TLS = {"cert": "c.pem", "key": "c.key", "ca": "ca.pem"}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"kvcached": {"ram_bytes": 1, "listen_unix": "s", "colour": 1}}, "kvcached: unknown key(s) colour"),
        ({"kvcached": {"ram_bytes": 1, "listen_unix": "s"}, "extra": {}}, "config: unknown key(s) extra"),
        ({"kvcached": {"listen_unix": "s"}}, "kvcached.ram_bytes: required"),
        ({"kvcached": {"ram_bytes": "1", "listen_unix": "s"}}, "kvcached.ram_bytes: expected int"),
        ({"kvcached": {"ram_bytes": 0, "listen_unix": "s"}}, "kvcached.ram_bytes: must be >= 1"),
        ({"kvcached": {"ram_bytes": 1}}, "set listen_unix, listen_tcp or both"),
        ({"kvcached": {"ram_bytes": 1, "listen_tcp": "127.0.0.1:0"}}, "mTLS only: set [kvcached.tls]"),
        ({"kvcached": {"ram_bytes": 1, "listen_unix": "s"}, "quic": {}}, "quic: peer fetch is mTLS only"),
        ({"kvcached": {"ram_bytes": 1, "listen_unix": "s", "feed_listen": "nope"}}, "kvcached.feed_listen"),
        ({"kvcached": {"ram_bytes": 1, "listen_unix": "s", "ssd_path": "/x"}}, "kvcached.ssd_bytes"),
        ({"kvcached": {"ram_bytes": 1, "listen_unix": "s", "write_through": True}}, "needs an SSD tier"),
        ({"kvcached": {"ram_bytes": 1, "listen_unix": "s", "write_through": 1}}, "expected bool"),
        ({"kvcached": {"ram_bytes": 1, "listen_unix": "s", "node": "a/b"}}, "kvcached.node"),
        (
            {"kvcached": {"ram_bytes": 1, "listen_unix": "s", "max_concurrent_rpcs": 0}},
            "kvcached.max_concurrent_rpcs: must be >= 1",
        ),
        (
            {"kvcached": {"ram_bytes": 1, "listen_unix": "s", "max_concurrent_rpcs": 1.5}},
            "kvcached.max_concurrent_rpcs: expected int",
        ),
        ({"kvcached": {"ram_bytes": 1, "listen_unix": "s", "tls": {"cert": "c"}}}, "kvcached.tls: set all"),
        (
            {"kvcached": {"ram_bytes": 1, "listen_unix": "s", "tls": _TLS}, "quic": {"timeout_s": 0}},
            "quic.timeout_s",
        ),
        (
            {
                "kvcached": {"ram_bytes": 1, "listen_unix": "s", "tls": _TLS},
                "quic": {"max_datagram_size": 1199},
            },
            "quic.max_datagram_size",
        ),
        (
            {
                "kvcached": {"ram_bytes": 1, "listen_unix": "s", "tls": _TLS},
                "quic": {"max_datagram_size": 65001},
            },
            "quic.max_datagram_size must be at most 65000",
        ),
        (
            {"kvcached": {"ram_bytes": 1, "listen_unix": "s", "tls": _TLS}, "quic": {"port": 1}},
            "quic: unknown key(s) port",
        ),
        ({"kvcached": {"ram_bytes": 1, "listen_unix": "s"}, "peers": [{"node": "b"}]}, "peers[0].address"),
        (
            {"kvcached": {"ram_bytes": 1, "listen_unix": "s"}, "peers": [{"node": "b", "address": "x"}]},
            "peers[0].address: expected host:port",
        ),
        (
            {"kvcached": {"ram_bytes": 1, "listen_unix": "s"}, "peers": [{"node": "b", "address": "h:0"}]},
            "peers[0].address: port 0 cannot be dialed",
        ),
        (
            {
                "kvcached": {"ram_bytes": 1, "listen_unix": "s"},
                "remote": {"peers": [{"cluster": "eu", "address": "h:0"}]},
            },
            "remote.peers[0].address: port 0 cannot be dialed",
        ),
        ({"kvcached": {"ram_bytes": 1, "listen_unix": "s"}, "etcd": 3}, "etcd: expected a table"),
    ],
)
def test_errors_name_the_key(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(KvcachedConfigError, match=re.escape(message)):
        parse_kvcached_config(doc)


def test_max_concurrent_rpcs_default_and_set() -> None:
    """The local API's cap per listener: 64 by default (~4 GiB of 64 MiB messages), any value >= 1."""
    base = {"ram_bytes": 1, "listen_unix": "s"}
    assert parse_kvcached_config({"kvcached": base}).max_concurrent_rpcs == MAX_CONCURRENT_RPCS_DEFAULT == 64
    assert 64 * ((64 << 20) + MESSAGE_SLACK) <= 4200 << 20  # the docstring's "~4 GiB"
    assert 64 * ((2 << 20) + MESSAGE_SLACK) <= 200 << 20  # and "~200 MiB" with 2 MiB blocks
    cfg = parse_kvcached_config({"kvcached": {**base, "max_concurrent_rpcs": 1}})
    assert cfg.max_concurrent_rpcs == 1


def test_quic_buffer_bytes_must_hold_one_response_of_the_largest_block() -> None:
    """``quic.buffer_bytes`` absent: the daemon's default (``buffer_bytes_default``); set: at least one
    response of a ``max_block_bytes`` block and its request, which rises with ``max_block_bytes``."""
    base: dict[str, Any] = {"ram_bytes": 1, "listen_unix": "s", "tls": _TLS, "max_block_bytes": 1 << 20}
    assert parse_kvcached_config({"kvcached": base, "quic": {}}).quic == QuicSettings()
    assert buffer_bytes_default(64 << 20) == 1 << 30
    assert buffer_bytes_default(1 << 30) == 2 * (response_charge_max(1 << 30) + REQUEST_CHARGE_BYTES)
    least = response_charge_max(1 << 20) + REQUEST_CHARGE_BYTES
    cfg = parse_kvcached_config({"kvcached": base, "quic": {"buffer_bytes": least}})
    assert cfg.quic is not None and cfg.quic.buffer_bytes == least
    with pytest.raises(KvcachedConfigError, match=re.escape(f"quic.buffer_bytes: must be >= {least}")):
        parse_kvcached_config({"kvcached": base, "quic": {"buffer_bytes": least - 1}})
    bigger = {**base, "max_block_bytes": 8 << 20}
    with pytest.raises(KvcachedConfigError, match=re.escape("quic.buffer_bytes: must be >=")):
        parse_kvcached_config({"kvcached": bigger, "quic": {"buffer_bytes": least}})


def test_load_from_file(tmp_path: Path) -> None:
    path = tmp_path / "kvcached.toml"
    path.write_text(_example())
    assert load_kvcached_config(path).node == "node-a"
    path.write_text("[kvcached\n")
    with pytest.raises(KvcachedConfigError, match="not valid TOML"):
        load_kvcached_config(path)
    with pytest.raises(KvcachedConfigError, match="cannot read"):
        load_kvcached_config(tmp_path / "missing.toml")
    with pytest.raises(ValueError):  # KvcachedConfigError is also a ValueError
        load_kvcached_config(tmp_path / "missing.toml")
