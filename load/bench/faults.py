"""Fault injection as a benchmark (issue 24 part 4): the fault suite's scenarios (``load/faults.py``, the
same ones ``tests/faults`` asserts on) with longer load windows, one JSON record.

Four stacks (:class:`kvgate.dev.up.Stack`, supervised as ``kvgate up`` runs them), one at a time:
four simulators and two ext_procs; three slower simulators (long streams) serving a model with
``migration = true``, and the same without it; three node agents with a local etcd. Under each,
:class:`~load.steady.SteadyLoad` (4 clients, every other request streamed) runs ``--warm`` seconds,
then one fault is injected, and the load goes on until full service is back and ``--after`` seconds
more. Per fault: requests sent, succeeded, failed by status
(``200 cut``: a stream cut after its 200; ``200 error event``: a stream that ended with an error event;
``no response``), hung (longer than every configured bound
plus slack), seconds to full service, and the scenario's facts (detection time, tries Envoy sent to the
failed engine after detection, migrations, ejections).

    python -m load.bench.faults --out results/faults.json             # ~25 s of load per fault
    python -m load.bench.faults --quick --out /tmp/faults.json        # short windows, 2 faults
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from kvgate.dev.up import Stack, StackOptions
from load import faults
from load.bench import CpuSample, machine, revision, write_json
from load.faults import FAST_RESTART, FaultRun, Windows

Scenario = Callable[[Stack, Windows], Awaitable[FaultRun]]
#: Each stack and the faults run under it, in order (a fault's name: its CLI name).
PLAN: dict[str, tuple[Callable[[Path], StackOptions], dict[str, Scenario]]] = {
    "sims": (
        faults.sims_options,
        {
            "kill-engine": faults.kill_engine,
            "kill-extproc": faults.kill_extproc,
            "stop-engine": faults.stop_engine,
            "stop-extproc": faults.stop_extproc,
            "reset-engine": faults.reset_engine,
        },
    ),
    "migrating": (
        faults.streaming_options,
        {
            "kill-engine-migration": faults.kill_streaming_engine,
            "reset-engine-migration": faults.reset_migrating_engine,
        },
    ),
    "plain": (
        lambda workdir: faults.streaming_options(workdir, migration=False),
        {"kill-engine-no-migration": faults.kill_streaming_engine},
    ),
    "agents": (
        faults.agents_options,
        {"kill-agent": faults.kill_agent, "kill-etcd": faults.kill_etcd, "drain": faults.drain_engine},
    ),
}
QUICK = ("kill-engine", "kill-etcd")


def _facts(run: FaultRun) -> dict[str, Any]:
    """The run's facts as JSON: monotonic times as seconds after the fault."""
    out: dict[str, Any] = {}
    for key, value in run.facts.items():
        if key in ("detected", "back", "resumed", "ejected") and isinstance(value, float):
            out[f"{key}_after_s"] = round(value - run.injected, 3)
        elif isinstance(value, float):
            out[key] = round(value, 3)
        else:
            out[key] = value
    return out


def _run_stack(name: str, workdir: Path, chosen: Sequence[str], w: Windows) -> list[dict[str, Any]]:
    make, scenarios = PLAN[name]
    todo = [(fault, scenarios[fault]) for fault in scenarios if fault in chosen]
    if not todo:
        return []
    results: list[dict[str, Any]] = []

    async def run(stack: Stack) -> None:
        for fault, scenario in todo:
            print(f"faults: {fault} ...", file=sys.stderr, flush=True)
            before = CpuSample.take()
            done = await scenario(stack, w)
            results.append(
                {
                    "name": fault,
                    "stack": name,
                    **done.record.as_dict(),
                    "facts": _facts(done),
                    "other_cores": before.other_cores(CpuSample.take()),
                    "loadavg_1m": os.getloadavg()[0],
                }
            )

    with Stack(make(workdir / name)) as stack:
        stack.supervise(FAST_RESTART)
        asyncio.run(run(stack))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load.bench.faults", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--warm", type=float, default=10.0, help="seconds of load before each fault")
    parser.add_argument("--after", type=float, default=15.0, help="seconds of load after service is back")
    parser.add_argument("--stopped", type=float, default=5.0, help="seconds a stopped process stays stopped")
    parser.add_argument("--only", nargs="+", metavar="FAULT", help="run only these faults")
    parser.add_argument("--quick", action="store_true", help="short windows, two faults: the JSON shape only")
    parser.add_argument("--workdir", type=Path, help="where the stacks run (default: a new temp directory)")
    args = parser.parse_args(argv)
    every = [f for _, scenarios in PLAN.values() for f in scenarios]
    chosen = args.only or (QUICK if args.quick else every)
    unknown = sorted(set(chosen) - set(every))
    if unknown:
        parser.error(f"unknown fault(s) {unknown}; known: {every}")
    w = Windows(warm=1.5, after=1.0) if args.quick else Windows(args.warm, args.after, args.stopped)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvgate-faults-"))
    started, cpu = time.monotonic(), CpuSample.take()
    result: dict[str, Any] = {
        "benchmark": "faults",
        "command": " ".join(["python -m load.bench.faults", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(),
        "revision": revision(),
        "parameters": {
            "warm_s": w.warm,
            "after_s": w.after,
            "stopped_s": w.stopped,
            "clients": 4,
            "bounds_s": {
                "first_byte": faults.FIRST_BYTE_S,
                "idle": faults.IDLE_S,
                "request": faults.REQUEST_S,
                "hang": faults.HANG_S,
            },
        },
        "faults": [],
    }

    for name in PLAN:
        result["faults"] += _run_stack(name, workdir, chosen, w)
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["other_cores"] = cpu.other_cores(CpuSample.take())
    result["loadavg_at_end"] = list(os.getloadavg())
    write_json(args.out, result)
    for f in result["faults"]:
        failed = ", ".join(f"{k}: {v}" for k, v in f["failed"].items()) or "0"
        print(
            f"{f['name']:24} sent {f['sent']:5} ok {f['succeeded']:5} failed {failed:20} hung {f['hung']} "
            f"recovery {f['recovery_s']:.2f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
