"""Smoke run of ``python -m load.bench.faults --quick``: two faults (an engine SIGKILLed, etcd SIGKILLed)
under load through real stacks, and the documented JSON shape. A benchmark is not a test: the bounds are
asserted by ``tests/faults``; here only that each record is complete and counts add up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from load.bench import faults

RECORD = {
    "name",
    "stack",
    "fault",
    "sent",
    "succeeded",
    "failed",
    "hung",
    "recovery_s",
    "facts",
    "other_cores",
}


@pytest.mark.e2e
def test_faults_quick(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    assert faults.main(["--quick", "--out", str(out), "--workdir", str(tmp_path / "run")]) == 0
    result = json.loads(out.read_text())
    assert {"benchmark", "command", "machine", "revision", "parameters", "faults", "other_cores"} <= set(
        result
    )
    assert result["benchmark"] == "faults" and "--quick" in result["command"]
    assert [f["name"] for f in result["faults"]] == list(faults.QUICK)
    for f in result["faults"]:
        assert set(f) >= RECORD
        assert f["sent"] > 0 and f["succeeded"] + sum(f["failed"].values()) == f["sent"]
        assert f["recovery_s"] > 0


def test_unknown_faults_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        faults.main(["--only", "kill-everything", "--out", str(tmp_path / "x.json")])
