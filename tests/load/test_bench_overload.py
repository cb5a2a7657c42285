"""``load.bench.overload``: a small run against one ext_proc without a bound and with one, through the load
clients of ``load.bench.extproc_alone``. Benchmarks are not tests: no figure is asserted beyond "requests
were served", and a request not served was shed (``[overload] max_decisions``)."""

from __future__ import annotations

import json
from pathlib import Path

from load.bench import overload
from load.bench.extproc_alone import ANSWERED_BEFORE_BODY


def test_a_small_run_reports_each_bound(tmp_path: Path) -> None:
    out = tmp_path / "overload.json"
    argv = ["--concurrency", "4", "--bounds", "0,2", "--clients", "1", "--replicas", "2"]
    assert overload.main([*argv, "--warmup-s", "0.2", "--duration-s", "0.5", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"benchmark", "command", "machine", "revision", "parameters", "runs"} <= result.keys()
    runs = {run["max_decisions"]: run for run in result["runs"]}
    assert set(runs) == {0, 2} and all(run["concurrency"] == 4 for run in runs.values())
    for run in runs.values():
        assert run["served"] > 0 and run["rps"] > 0 and run["stream_us"]["n"] == run["served"]
        # A shed answers at the headers; a stream that ends before its body is written is one of those.
        assert set(run["outcomes"]) <= {"served", "rejected_503", ANSWERED_BEFORE_BODY}, run["outcomes"]
        assert run["outcomes"].get(ANSWERED_BEFORE_BODY, 0) <= run["sheds"], run
        assert run["loop_lag_p99_s"] is not None  # the lag timer woke during the run
    assert runs[0]["not_served"] == 0 and runs[0]["sheds"] == 0  # no bound: nothing shed
