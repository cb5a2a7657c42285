"""The ext_proc under more load than it can decide: event-loop lag, latency and sheds against the number of
decisions in flight, with and without the ``[overload] max_decisions`` bound (extproc/overload).

One ext_proc (no Envoy) scrapes a few simulated replicas; the closed-loop load clients of
:mod:`load.bench.extproc_alone` play Envoy (one ``Process`` stream per request: headers, the body, read the
answer) at each concurrency of ``--concurrency``, so about that many decisions are in flight. Around each
run the ext_proc's own ``/metrics`` is read: the loop-lag histogram (``kvgate_extproc_loop_lag_seconds``,
its p99 over the run from the bucket deltas), the peak lag gauge and the sheds. Each bound of ``--bounds``
(0: none) gets its own ext_proc.

    python -m load.bench.overload --concurrency 16,64,256,1024 --bounds 0,256 --out results/overload.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from engines.gguf import ensure_model_dir, smollm2_gguf_path
from kvgate.dev.gateway_config import gateway_config
from kvgate.dev.options import DEFAULT_MODEL, StackOptions
from load.bench import machine, revision, summary, write_json
from load.bench.extproc_alone import SERVED, run_clients, start_extprocs, start_sims

_SAMPLE = re.compile(r"^(\w+)(?:\{(.*)\})? (\S+)$")


def scrape(url: str) -> dict[str, float]:
    """``name{labels}`` -> value of every sample at ``url``."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text: str = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            out[f"{match.group(1)}{{{match.group(2) or ''}}}"] = float(match.group(3))
    return out


def lag_p99(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The p99 loop lag (s) over the run: the smallest bucket bound holding 99 % of the wakes since
    ``before``."""
    name = "kvgate_extproc_loop_lag_seconds_bucket"
    buckets = []
    for key, value in after.items():
        if key.startswith(name + "{"):
            le = key.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), value - before.get(key, 0.0)))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    return next(le for le, n in buckets if n >= 0.99 * total)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m load.bench.overload", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--concurrency", default="16,64,256,1024", help="streams in flight, comma-separated")
    p.add_argument("--bounds", default="0,256", help="[overload] max_decisions values (0: none)")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--duration-s", type=float, default=5.0)
    p.add_argument("--replicas", type=int, default=4)
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    bounds = [int(x) for x in args.bounds.split(",")]
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        model_dir = str(ensure_model_dir(smollm2_gguf_path()))
        sim, replicas = start_sims(workdir, args.replicas, model_dir)
        stack.callback(sim.stop)
        engines = [
            {"id": f"sim-{i}", "address": a, "engine": "sim", "metrics_url": f"http://{a}/metrics"}
            for i, a in enumerate(replicas)
        ]
        base = gateway_config(
            StackOptions(replicas=args.replicas),
            models=[DEFAULT_MODEL],
            served={e["id"]: [DEFAULT_MODEL] for e in engines},
            engines=engines,
            smollm2_dir=model_dir,
            etcd=None,
            certs={},
            feeds_tls=False,
            secure=False,
        )
        for bound in bounds:
            config = {**base, "overload": {"max_decisions": bound}}
            extprocs, targets = start_extprocs(workdir, config, 1, None)
            try:
                ports = json.loads((workdir / "extproc-0.ready.json").read_text())
                metrics = f"http://127.0.0.1:{ports['metrics']}/metrics"
                for level in levels:
                    before = scrape(metrics)
                    got = run_clients(
                        targets, replicas, level, args.clients, 1, args.warmup_s, args.duration_s, False
                    )
                    after = scrape(metrics)
                    outcomes: dict[str, int] = {}
                    for client in got:
                        for outcome, n in client["outcomes"]["timed"].items():
                            outcomes[outcome] = outcomes.get(outcome, 0) + n
                    latency = summary([x for c in got for x in c["stream_us"]])
                    run = {
                        "max_decisions": bound,
                        "concurrency": level,
                        "rps": round(sum(len(c["stream_us"]) / c["timed_wall_s"] for c in got), 1),
                        "served": outcomes.get(SERVED, 0),
                        "not_served": sum(n for k, n in outcomes.items() if k != SERVED),
                        "outcomes": outcomes,
                        "stream_us": latency,
                        "loop_lag_p99_s": lag_p99(before, after),
                        "loop_lag_peak_s": after.get("kvgate_extproc_loop_lag_peak_seconds{}"),
                        "sheds": after.get("kvgate_extproc_overload_sheds_total{}", 0.0)
                        - before.get("kvgate_extproc_overload_sheds_total{}", 0.0),
                    }
                    runs.append(run)
                    print(
                        f"bound {bound} c={level}: {run['rps']} req/s, p50 {latency['p50']:.0f} p99 "
                        f"{latency['p99']:.0f} us, loop lag p99 {run['loop_lag_p99_s']} s peak "
                        f"{run['loop_lag_peak_s']}, shed {run['sheds']:.0f}, not served {run['not_served']}",
                        file=sys.stderr,
                    )
            finally:
                for c in extprocs:
                    c.stop()
    write_json(
        args.out,
        {
            "benchmark": "overload",
            "command": " ".join(["python -m load.bench.overload", *argv]),
            "machine": machine(),
            "revision": revision(),
            "parameters": vars(args) | {"out": str(args.out)},
            "runs": runs,
            "wall_s": round(time.monotonic() - started, 1),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
