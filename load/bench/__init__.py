"""Benchmarks (not tests): each module is ``python -m load.bench.NAME --out FILE`` and writes JSON.

``decision``: the routing core's decision latency in-process. ``overhead``: Envoy + ext_proc latency and
CPU against direct-to-engine requests, in the same run. ``BENCHMARKS.md`` quotes their results with the
commands that produced them. This module holds what both share: machine facts, percentiles, JSON output.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

PERCENTILES = (50, 90, 99)


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU model and count, kernel, Python, load at the start."""
    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln), "")
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model or platform.processor(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "loadavg_at_start": list(os.getloadavg()),
    }


def percentile(ordered: Sequence[float], pct: float) -> float:
    """The ``pct``-th percentile of an ascending sequence (linear interpolation between ranks)."""
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(samples: Sequence[float], digits: int = 1) -> dict[str, float | int]:
    """``n``, ``p50``/``p90``/``p99``, ``max`` and ``mean`` of ``samples`` (same unit as the input)."""
    ordered = sorted(samples)
    out: dict[str, float | int] = {"n": len(ordered)}
    for pct in PERCENTILES:
        out[f"p{pct}"] = round(percentile(ordered, pct), digits)
    out["max"] = round(ordered[-1], digits) if ordered else float("nan")
    out["mean"] = round(sum(ordered) / len(ordered), digits) if ordered else float("nan")
    return out


def write_json(path: Path, result: Mapping[str, Any]) -> None:
    """Write ``result`` as indented JSON, creating the parent directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
