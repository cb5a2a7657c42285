"""Smoke run of ``python -m load.bench.kvcached_peers --quick``: it runs and writes the documented JSON.

A benchmark is not a test: nothing here asserts a figure, only that both transports were measured.
"""

from __future__ import annotations

import json
from pathlib import Path

from load.bench import kvcached_peers


def test_kvcached_peers_quick(tmp_path: Path) -> None:
    out = tmp_path / "kvcached_peers.json"
    assert kvcached_peers.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"benchmark", "command", "machine", "revision", "parameters", "goals"} <= result.keys()
    assert result["parameters"]["quick"] is True
    for transport in ("quic", "quic_9000", "quic_64k", "tcp"):
        single = result["single_1mib_ms"][transport]
        assert single["n"] == result["parameters"]["calls"]
        assert 0 < single["p50"] <= single["p99"]
        assert result["bulk_gb_per_s"][transport]["median"] > 0
    assert set(result["goals"]) == {"quic_1mib_p99_ms", "quic_9000_1mib_p99_ms", "quic_64k_1mib_p99_ms"}
