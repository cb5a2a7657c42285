"""The gateway config ``kvgate up`` writes: the same for every ext_proc, each copy pinned to its ports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from extproc.config import parse_config
from kvgate.dev.gateway_config import gateway_config, pin_listeners
from kvgate.dev.options import DEFAULT_MODEL, StackOptions

ENGINES = [{"id": "sim-0", "address": "127.0.0.1:8001", "engine": "sim"}]


def config_for(tmp_path: Path, **options: Any) -> dict[str, object]:
    return gateway_config(
        StackOptions(**options),
        models=(DEFAULT_MODEL,),
        served={"sim-0": [DEFAULT_MODEL]},
        engines=ENGINES,
        smollm2_dir=str(tmp_path),
        etcd=None,
        certs={},
        feeds_tls=False,
        secure=False,
    )


def test_each_extproc_copy_listens_where_its_first_run_did(tmp_path: Path) -> None:
    config = config_for(tmp_path, extproc={"max_body_bytes": 1024})
    assert config["extproc"] == {
        "listen": "127.0.0.1:0",
        "health_listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
        "max_body_bytes": 1024,
    }
    path = tmp_path / "extproc-1.json"
    pin_listeners(path, config, {"extproc": 41001, "health": 41002, "metrics": 41003})
    pinned = json.loads(path.read_text())
    assert pinned["extproc"] == {
        "listen": "127.0.0.1:41001",
        "health_listen": "127.0.0.1:41002",
        "metrics_listen": "127.0.0.1:41003",
        "max_body_bytes": 1024,
    }
    assert {k: v for k, v in pinned.items() if k != "extproc"} == {
        k: v for k, v in config.items() if k != "extproc"
    }
    assert parse_config(pinned).extproc.listen == "127.0.0.1:41001"
