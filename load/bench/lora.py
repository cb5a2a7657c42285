"""LoRA adapter churn (issue 21): requests for many adapters over replicas with few adapter slots.

    python -m load.bench.lora --out docs/bench/lora/lora-<rev>.json     # ~10 minutes on a 2-core VM
    python -m load.bench.lora --quick --out /tmp/lora.json              # seconds; figures mean nothing

Fleet, fresh for every target (so no adapter or prefix carries over): ``replicas`` simulated vLLM
replicas (``load.sim``, one process), each serving ``adapters`` LoRA adapters by name with
``max_loras`` GPU slots (LRU eviction of idle adapters; a load costs ``lora_load_ms`` added to the step
that admits the request, load/sim/README.md "LoRA adapters"), the H100/8B step model stretched
``time_scale`` times. Targets:

* ``kvgate``: Envoy + the ext_proc over the replicas (static endpoints naming the adapters, metrics
  scraped: ``vllm:lora_requests_info``), default scheduling profile (its ``lora`` scorer);
* ``round-robin`` / ``least-loaded``: plain Envoy (``ROUND_ROBIN`` / ``LEAST_REQUEST``);
* ``sglang-router`` / ``vllm-router``: the peers with ``--policy cache_aware`` (load/bench/peers.py),
  skipped with the reason when they cannot be installed or started here.

Workload: Poisson arrivals (seeded) at ``rate_req_s`` for ``duration_s``, open loop, streamed chat; each
request names adapter ``a<k>``, ``k`` drawn from a Zipf law of exponent ``zipf_s`` over the adapters, a
unique prompt of ``prompt_tokens`` tokens and ``output_tokens`` out. Per target: adapter loads per 1,000
requests (the replicas' ``kvgate_sim_lora_loads_total`` summed after the run over requests served), TTFT
p50/p90/p99 (ms), output tok/s (completion tokens over the run's wall time), errors.

Goals: kvgate's adapter loads per 1,000 requests at most 1/3 of every peer's (round robin, least
loaded, sglang-router, vllm-router) and its TTFT p90 lower than every peer's.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engines.gguf import ensure_model_dir, smollm2_gguf_path
from kvgate.dev.procs import ChildFailed
from kvgate.dev.up import DEFAULT_MODEL
from load.bench import TIMING_SOURCES, chosen_targets, counts, finish, opening, skipped, summary
from load.bench import targets as tg
from load.client import LoadOptions, RequestRecord, RunResult, run_load
from load.workloads import smollm2_text
from load.workloads.session import Session, Turn, poisson_arrivals

log = logging.getLogger(__name__)

TARGETS = ("kvgate", "round-robin", "least-loaded", "sglang-router", "vllm-router")
PEERS = TARGETS[1:]
#: The simulator's parameters: what each means and where its value comes from.
SIM_SOURCES = {
    **TIMING_SOURCES,
    "prefill_tokens_per_s": "20,000 tokens/s: compute-bound prefill at ~30% of the H100's bf16 peak"
    " (load/sim/timing.py, load/sim/README.md)",
    "lora_load_ms": "25 ms per adapter swapped into a GPU slot: a rank-16 adapter of an 8B model (~84 MB"
    " bf16) copied from host memory over PCIe Gen5 (~50 GB/s, ~2 ms) plus vLLM's per-adapter setup; an"
    " estimate stated in load/sim/timing.py, not a measurement",
    "max_loras": "adapter GPU slots per replica (vLLM --max-loras): the issue's 4",
    "time_scale": "every step (and adapter load) stretched this many times so 2 CPU cores can drive the"
    " fleet and a router",
}


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """One benchmark's fleet and workload (see the module docstring)."""

    replicas: int = 8
    adapters: int = 32
    max_loras: int = 4
    zipf_s: float = 1.0
    lora_load_ms: float = 25.0
    time_scale: float = 2.0
    max_num_seqs: int = 64
    kv_blocks: int = 4096
    max_model_len: int = 4096
    rate_req_s: float = 8.0
    duration_s: float = 60.0
    drain_s: float = 90.0
    prompt_tokens: int = 256
    output_tokens: int = 48
    seed: int = 1

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return tuple(f"a{k:02d}" for k in range(self.adapters))

    def sim_args(self) -> tuple[str, ...]:
        return (
            "--time-scale", str(self.time_scale),
            "--max-num-seqs", str(self.max_num_seqs),
            "--lora-modules", *self.adapter_names,
            "--max-loras", str(self.max_loras),
            "--lora-load-ms", str(self.lora_load_ms),
        )  # fmt: skip


def quick_config() -> LoraConfig:
    """The smoke run: 2 fast replicas, 6 adapters in 2 slots, a few seconds of arrivals."""
    return LoraConfig(
        replicas=2,
        adapters=6,
        max_loras=2,
        time_scale=0.2,
        rate_req_s=4.0,
        duration_s=2.0,
        drain_s=30.0,
        prompt_tokens=32,
        output_tokens=4,
    )


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of ranks 1..n: ``k^-s``, normalised."""
    raw = [k**-s for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def make_sessions(config: LoraConfig) -> list[Session]:
    """One single-turn session per Poisson arrival, for an adapter drawn by Zipf popularity."""
    rng = random.Random(f"{config.seed}-lora")
    text = smollm2_text()
    names = config.adapter_names
    weights = zipf_weights(len(names), config.zipf_s)
    arrivals = poisson_arrivals(
        config.rate_req_s, config.duration_s, random.Random(f"{config.seed}-arrivals")
    )
    sessions = []
    for i, start in enumerate(arrivals):
        adapter = rng.choices(names, weights)[0]
        turn = Turn(
            ({"role": "user", "content": text.words(config.prompt_tokens, rng)},), config.output_tokens
        )
        sessions.append(Session(f"r{i}", adapter, start, (), (turn,), model=adapter))
    return sessions


def adapter_loads(addresses: Sequence[str]) -> int:
    """Adapters the replicas loaded so far (``kvgate_sim_lora_loads_total``, summed)."""
    total = 0.0
    for address in addresses:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("kvgate_sim_lora_loads_total"):
                    total += float(line.split()[-1])
    return int(total)


def target_metrics(result: RunResult, sent: int, loads: int) -> dict[str, Any]:
    records: Sequence[RequestRecord] = result.records
    ok = [r for r in records if r.ok]
    wall = result.wall_s
    return {
        "sent": sent,
        "served": len(ok),
        "errors": counts(r.status for r in records if not r.ok),
        "adapter_loads": loads,
        "adapter_loads_per_1000": round(1000 * loads / len(ok), 1) if ok else None,
        "wall_s": round(wall, 2),
        "ttft_ms": summary([r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]),
        "output_tok_s": round(sum(r.completion_tokens for r in ok) / wall, 1) if wall > 0 else 0.0,
    }


def run_target(
    name: str, config: LoraConfig, sessions: list[Session], workdir: Path, progress: bool
) -> dict[str, Any]:
    """A fresh fleet, target ``name`` over it, ``sessions`` sent; its row (``skipped`` if it cannot run)."""
    started = time.monotonic()
    spec = tg.FleetSpec(config.replicas, config.kv_blocks, config.max_model_len, config.sim_args())
    model_dir = ensure_model_dir(smollm2_gguf_path())
    fleet = tg.Fleet(spec, DEFAULT_MODEL, model_dir, workdir / name / "fleet")
    try:
        try:
            running = tg.start(
                name, fleet, DEFAULT_MODEL, model_dir, workdir / name, adapters=config.adapter_names
            )
        except (tg.TargetUnavailable, ChildFailed) as exc:
            return skipped(name, exc, log)
        options = LoadOptions(
            DEFAULT_MODEL, duration_s=config.duration_s, drain_s=config.drain_s, progress=progress
        )
        try:
            result = asyncio.run(run_load(sessions, running.route, options))
        finally:
            running.stop()
        row = {"target": name, **target_metrics(result, len(sessions), adapter_loads(fleet.addresses))}
    finally:
        fleet.stop()
    row["target_wall_s"] = round(time.monotonic() - started, 1)
    return row


def goals(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each goal ``{value, goal, met}`` per peer (``met`` ``None``: not evaluated, with ``reason``)."""
    out: dict[str, dict[str, Any]] = {}
    mine = rows.get("kvgate", {})
    for peer in PEERS:
        row = rows.get(peer, {})
        if "skipped" in row or "skipped" in mine or not row or not mine:
            why = row.get("skipped") or mine.get("skipped") or "not run"
            out[f"loads_vs_{peer}"] = {"value": None, "goal": "<= 1/3", "met": None, "reason": why}
            out[f"ttft_p90_vs_{peer}"] = {"value": None, "goal": "< 1", "met": None, "reason": why}
            continue
        a, b = mine["adapter_loads_per_1000"], row["adapter_loads_per_1000"]
        ratio = None if a is None or not b else round(a / b, 3)
        out[f"loads_vs_{peer}"] = {
            "value": ratio,
            "goal": "<= 1/3",
            "met": None if ratio is None else ratio <= 1 / 3,
        }
        ta, tb = mine["ttft_ms"].get("p90"), row["ttft_ms"].get("p90")
        t_ratio = None if not ta or not tb else round(ta / tb, 3)
        out[f"ttft_p90_vs_{peer}"] = {
            "value": t_ratio,
            "goal": "< 1",
            "met": None if t_ratio is None else t_ratio < 1,
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m load.bench.lora", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/lora.json"), help="result JSON file")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (seconds, figures meaningless)")
    p.add_argument("--targets", help=f"comma-separated subset of {','.join(TARGETS)}")
    p.add_argument("--duration", type=float, help="seconds of arrivals")
    p.add_argument("--rate", type=float, help="arrivals per second")
    p.add_argument("--seed", type=int, help="workload seed (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = quick_config() if args.quick else LoraConfig()
    for key, value in (("duration_s", args.duration), ("rate_req_s", args.rate), ("seed", args.seed)):
        if value is not None:
            config = replace(config, **{key: value})
    targets = chosen_targets(p, args.targets, TARGETS)
    workdir = args.out.resolve().parent / f"{args.out.stem}-work"
    started = time.monotonic()
    sessions = make_sessions(config)
    result = opening("lora", argv, args.quick, config, SIM_SOURCES, len(sessions))
    rows = {t: run_target(t, config, sessions, workdir, not args.no_progress) for t in targets}
    result["targets"] = rows
    result["skipped"] = {t: r["skipped"] for t, r in rows.items() if "skipped" in r}
    result["goals"] = goals(rows)
    return finish(result, args.out, started)


if __name__ == "__main__":
    raise SystemExit(main())
