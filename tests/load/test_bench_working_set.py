"""Smoke run of ``python -m load.bench.working_set``: it runs, on this tree and on a ``--tree``, and writes
the documented JSON shape. A benchmark is not a test: no figure is asserted, only that the timed calls
measured what the docstring says (nothing left the window while timing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from load.bench import working_set

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tree", [None, ROOT])
def test_working_set_runs(tmp_path: Path, tree: Path | None) -> None:
    out = tmp_path / "ws.json"
    argv = ["--out", str(out), "--fleets", "4,16", "--number", "20", "--repeats", "2"]
    assert working_set.main(argv + ([] if tree is None else ["--tree", str(tree)])) == 0
    result = json.loads(out.read_text())
    assert {"benchmark", "command", "machine", "revision", "driver_revision", "fleets"} <= result.keys()
    assert result["extproc_from"] == str(ROOT / "extproc")
    assert [cell["endpoints"] for cell in result["fleets"]] == [4, 16]
    for cell in result["fleets"]:
        assert set(cell["us_per_call"]) == {"sizes", "pop", "record", "index_record"}
        assert all(us > 0 for us in cell["us_per_call"].values())
        window = cell["blocks_in_window"]
        assert window["before"] == window["after"] > 0
        assert cell["clock_moved_s"] < result["window_s"] / 2


def test_working_set_refuses_a_tree_without_extproc(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        working_set.main(["--out", str(tmp_path / "x.json"), "--tree", str(tmp_path)])
