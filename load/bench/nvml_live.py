"""NVML power readings on a real GPU, read the way the agent reads them: idle, under load, cooling down.

The agent's NVML power source (``[[power]] kind = "nvml"``) reads :class:`agent.telemetry.GpuTelemetry`
and sums the node's GPUs into one sample (:func:`agent.power.reading.from_gpus`). CI has no GPU and runs
that path against a fake ``pynvml``; this bench runs it against the driver on the lent GPU machine.

Phases: ``--idle-s`` with nothing running, ``--load-s`` while a child process multiplies bf16 matrices
on every GPU (PyTorch, ``python -m load.bench.nvml_live load``), then ``--cool-s`` after it stopped.
Every ``1 / --hz`` seconds one :meth:`GpuTelemetry.read` is timed and its sample kept, with NVML's
own energy counter as the agent reads it (``nvmlDeviceGetTotalEnergyConsumption``, mJ since the driver
loaded, summed over the GPUs into the sample's ``energy_j``). Per phase: median and peak watts, the
enforced limit, clocks, temperature, the share of samples throttled, and the energy two ways: the
readings integrated (trapezoids, the way the energy bench turns readings into J/token) and the counter's
difference; their ratio says how far integrated instantaneous readings are from the counter at this rate.

    python -m load.bench.nvml_live --out results/nvml-live.json [--idle-s 8 --load-s 20 --cool-s 6 --hz 10]

Without a usable GPU it writes nothing and exits 1 with the reason (NVML's or the missing binding's).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.power.reading import from_gpus
from agent.telemetry import GpuTelemetry
from load.bench import machine

PHASES = ("idle", "load", "cool")


def integrate_j(times_s: Sequence[float], watts: Sequence[float]) -> float:
    """Energy in J of readings ``watts`` taken at ``times_s`` (trapezoids; 0 with fewer than two)."""
    pairs = zip(times_s, watts, strict=True)
    return sum((t1 - t0) * (w0 + w1) / 2.0 for (t0, w0), (t1, w1) in itertools.pairwise(pairs))


def summarize(samples: Sequence[dict[str, Any]], phase: str) -> dict[str, Any]:
    """One phase's figures from its samples (each: ``t``, ``watts``, ``limit_w``, ``sm_clock_mhz``,
    ``temperature_c``, ``throttled``, ``utilization``, ``counter_j``, ``read_us``)."""
    mine = [s for s in samples if s["phase"] == phase and s["watts"] is not None]
    if len(mine) < 2:
        return {"samples": len(mine)}
    times = [s["t"] for s in mine]
    watts = [s["watts"] for s in mine]
    integrated = integrate_j(times, watts)
    counters = [s["counter_j"] for s in mine]
    counter_j = None if None in counters else counters[-1] - counters[0]

    def median(key: str) -> float | None:
        values = [s[key] for s in mine if s[key] is not None]
        return statistics.median(values) if values else None

    throttled = [s["throttled"] for s in mine if s["throttled"] is not None]
    temps = [s["temperature_c"] for s in mine if s["temperature_c"] is not None]
    return {
        "samples": len(mine),
        "seconds": round(times[-1] - times[0], 3),
        "watts_median": round(statistics.median(watts), 1),
        "watts_max": round(max(watts), 1),
        "limit_w": median("limit_w"),
        "sm_clock_mhz_median": median("sm_clock_mhz"),
        "temperature_c_max": max(temps, default=None),
        "utilization_median": median("utilization"),
        "throttled_share": round(sum(throttled) / len(throttled), 3) if throttled else None,
        "energy_integrated_j": round(integrated, 1),
        "energy_counter_j": None if counter_j is None else round(counter_j, 1),
        "integrated_over_counter": round(integrated / counter_j, 3) if counter_j else None,
        "read_us_median": round(statistics.median(s["read_us"] for s in mine), 1),
    }


def _sample(telemetry: GpuTelemetry, phase: str, start: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    gpus = telemetry.read()
    read_us = (time.perf_counter() - t0) * 1e6
    node = from_gpus(gpus)
    utils = [g.utilization for g in gpus if g.utilization is not None]
    return {
        "phase": phase,
        "t": round(t0 - start, 4),
        "watts": node.watts,
        "limit_w": node.limit_w,
        "sm_clock_mhz": node.sm_clock_mhz,
        "temperature_c": node.temperature_c,
        "throttled": node.throttled,
        "utilization": sum(utils) / len(utils) if utils else None,
        "counter_j": node.energy_j,
        "read_us": round(read_us, 1),
    }


def load_main(argv: Sequence[str]) -> int:
    """The load child: bf16 matrix products on every GPU for ``--seconds`` (needs PyTorch and CUDA)."""
    p = argparse.ArgumentParser(prog="python -m load.bench.nvml_live load")
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--n", type=int, default=8192, help="square matrix size")
    args = p.parse_args(argv)
    torch: Any = importlib.import_module("torch")  # only on the GPU machine; not a kvgate dependency

    mats = []
    for i in range(torch.cuda.device_count()):
        a = torch.randn(args.n, args.n, device=f"cuda:{i}", dtype=torch.bfloat16)
        mats.append((a, torch.randn_like(a)))
        torch.matmul(*mats[-1])
    torch.cuda.synchronize()
    print("ready", flush=True)  # the parent times the load phase from here, not from CUDA's start
    products = 0
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        for a, b in mats:
            torch.matmul(a, b)
        products += 1
        if products % 20 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    print(json.dumps({"products_per_gpu": products, "n": args.n}), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["load"]:
        return load_main(argv[1:])
    doc = (__doc__ or "").split("\n")[0]
    p = argparse.ArgumentParser(prog="python -m load.bench.nvml_live", description=doc)
    p.add_argument("--out", type=Path, required=True, help="JSON results file")
    p.add_argument("--idle-s", type=float, default=8.0)
    p.add_argument("--load-s", type=float, default=20.0)
    p.add_argument("--cool-s", type=float, default=6.0)
    p.add_argument("--hz", type=float, default=10.0, help="reads per second")
    args = p.parse_args(argv)
    telemetry = GpuTelemetry()
    names = [gpu.name for gpu in telemetry.read()]
    if not names:
        print("nvml_live: no GPU telemetry (NVML unusable or no GPU; the agent logs why)", file=sys.stderr)
        return 1
    start = time.perf_counter()
    samples: list[dict[str, Any]] = []
    child: subprocess.Popen[str] | None = None
    load_out = ""
    try:
        for phase, seconds in zip(PHASES, (args.idle_s, args.load_s, args.cool_s), strict=True):
            if phase == "load":
                child = subprocess.Popen(
                    [sys.executable, "-m", "load.bench.nvml_live", "load", "--seconds", str(seconds)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                assert child.stdout is not None
                if child.stdout.readline().strip() != "ready":
                    raise RuntimeError("the load child did not start (PyTorch with CUDA needed)")
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                samples.append(_sample(telemetry, phase, start))
                time.sleep(1.0 / args.hz)
            if child is not None and phase == "load":
                load_out, _ = child.communicate(timeout=120)
                child = None
    finally:
        if child is not None:
            child.kill()
            child.wait()
        telemetry.close()
    result: dict[str, Any] = {
        "bench": "nvml_live",
        "command": "python -m load.bench.nvml_live " + " ".join(argv),
        "machine": machine(),
        "gpus": names,
        "params": vars(args) | {"out": str(args.out)},
        "load": json.loads(load_out) if load_out.strip() else None,
        "phases": {phase: summarize(samples, phase) for phase in PHASES},
        "samples": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for phase in PHASES:
        print(phase, json.dumps(result["phases"][phase]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
