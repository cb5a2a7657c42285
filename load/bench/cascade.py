"""SLM -> LLM cascade (issue 21): what a logprob-gated cascade saves against serving everything on the large
model, and what it costs the escalated requests in latency. One run, both targets on fresh fleets.

    python -m load.bench.cascade --out docs/bench/cascade/cascade-<rev>.json   # about two minutes here
    python -m load.bench.cascade --quick --out /tmp/cascade.json      # seconds; figures mean nothing

Fleet: simulated vLLM replicas (``load.sim``), ``small`` (a 1B-class model: every step-model cost divided
by ``cost_ratio``, see :data:`SIM_SOURCES`) and ``large`` (the simulator's 8B/H100 defaults), one GPU per
replica, behind kvgate (``kvgate up`` over ``--endpoint``s). Targets, by default on the same number of
GPUs (2):

* ``all-large``: ``all_large_replicas`` large replicas; every request names ``large``;
* ``cascade``: ``small_replicas`` small + ``large_replicas`` large replicas; every request names the
  virtual model ``auto`` (``{"cascade": {"steps": ["small", "large"], "threshold": THRESHOLD, "stat":
  STAT}}``).

Workload: Poisson arrivals (seeded) at ``rate_req_s`` for ``duration_s``, open loop, streamed with
``include_usage``; each prompt about ``prompt_tokens`` tokens, unique, and hard with probability
``hard_share`` (``[hard]`` in the prompt: the simulator's sampled-token logprobs lie in [-3, -1]) or easy
(``[easy]``: [-0.10, -0.01]); ``output_tokens`` out. So at the threshold the gate passes every easy answer
and escalates every hard one: the figures measure the mechanism's cost at a known escalation share, not
a gate's accuracy on real text.

Figures per target: cost per request = the engines' busy engine-seconds (``kvgate_sim_busy_seconds_total``:
the modelled duration of every step each engine ran, time scale applied, summed over engines; idle time is
not charged) / requests served, in the simulator's (time-scaled) seconds; ``work_engine_s``: the
batch-independent part of it, counted from tokens (each request's uncached prompt tokens x
``1/prefill_tokens_per_s`` + its output tokens x ``decode_ms_per_seq``, per model: what no batching
amortizes; the per-step ``step_base_ms`` is what batching shares); the share answered by each step
(``x-kvgate-cascade-step``); TTFT (first content chunk) p50/p90 of easy and hard requests. The added
latency of escalated requests is the cascade's hard-request TTFT less all-large's (p50 and p90): the
buffered small step they wait for first.

With ``--replay`` (``--stat first_k`` only) a streamed answer that passes on its first ``k`` tokens is
sent to ``small`` again with the same seed and streams from it (``replay``): easy requests' TTFT against
the buffered answer, for ``k`` more small-model tokens each.

With ``--preroute`` the cascade learns online which requests its gate escalates and sends those straight to
``large`` (``extproc/cascade/prior.py``); the run reports how many it sent (``preroutes``). ``--warm S``
sends S seconds of the same workload (other prompts) to each target first, unmeasured: the learner's steady
state instead of its cold start.

The JSON's ``cost_model`` holds the arithmetic (``extproc/cascade/cost.py``): both cost readings (per token,
busy time) for a perfect escalator, the buffered gate, a ``first_k`` gate and this run's policy, the
parameters with their sources, and a sweep halving and doubling each.

Goal: cascade cost per request <= 0.5 x all-large at the configured threshold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from engines.gguf import ensure_model_dir, smollm2_gguf_path
from extproc.cascade.cost import BUFFERED, PERFECT, Costs, Policy, busy_ratio, first_k, sweep, token_ratio
from kvgate.dev.procs import Child, http_get
from kvgate.dev.up import Stack, StackOptions
from load.bench import TIMING_SOURCES, finish, header, summary

log = logging.getLogger(__name__)

TARGETS = ("all-large", "cascade")
STEP_HEADER = "x-kvgate-cascade-step"
BUSY = "kvgate_sim_busy_seconds_total"
#: The simulator's parameters: what each means and where its value comes from.
SIM_SOURCES = {
    **TIMING_SOURCES,
    "prefill_tokens_per_s": "20,000 tokens/s for the large model: compute-bound prefill at ~30% of the"
    " H100's bf16 peak (load/sim/timing.py, load/sim/README.md)",
    "large_model": "the simulator's defaults as they stand: Llama-3.1-8B class, bf16, one H100",
    "cost_ratio": "8: the small model is a 1B-class model (e.g. Llama-3.2-1B) on the same GPU class. Both"
    " decode terms are memory-bound, so they scale with the bytes read per step, i.e. the parameter count"
    " (~16 GB vs ~2 GB of bf16 weights); prefill is compute-bound at ~2 x params FLOPs per token, so its"
    " throughput scales by the same factor. An assumption derived from parameter counts, not a"
    " measurement: real small models lose some of it to launch overheads that do not shrink",
    "time_scale": "every step stretched this many times (both models alike, so the cost ratio holds) so 2"
    " CPU cores can drive the fleet, Envoy and the ext_proc",
    "published_sources": "H100 SXM5: 3.35 TB/s HBM3, 989 TFLOPS dense bf16 (NVIDIA H100 datasheet,"
    " https://www.nvidia.com/en-us/data-center/h100/); Llama-3.1-8B: 8.03 B parameters, 16.1 GB in bf16"
    " (Meta's model card, https://huggingface.co/meta-llama/Llama-3.1-8B); Llama-3.2-1B: 1.23 B"
    " parameters, 2.47 GB in bf16 (https://huggingface.co/meta-llama/Llama-3.2-1B). Derived: step_base_ms"
    " = 16.1 GB / 3.35 TB/s = 4.8 ms + launch overhead (6 used); prefill = 2 x 8.03 GFLOP a token at 30 %"
    " of 989 TFLOPS = 18,500 tokens/s (20,000 used); the weight-bytes ratio 16.1 / 2.47 = 6.5 (cost_ratio"
    " 8 used: the sweep's 0.5x, 4, brackets it)",
    "logprobs": "the simulator's sampled-token logprobs follow [easy] / [hard] in the prompt"
    " (load/sim/README.md, Confidence): a stand-in for a real model's confidence",
}


@dataclass(frozen=True, slots=True)
class CascadeConfig:
    """One benchmark's fleet and workload (see the module docstring)."""

    all_large_replicas: int = 2
    small_replicas: int = 1
    large_replicas: int = 1
    cost_ratio: float = 8.0
    time_scale: float = 4.0
    step_base_ms: float = 6.0
    decode_ms_per_seq: float = 0.15
    prefill_tokens_per_s: float = 20_000.0
    threshold: float = -0.5
    stat: str = "mean"
    k: int | None = None
    rate_req_s: float = 3.0
    duration_s: float = 40.0
    hard_share: float = 0.3
    prompt_tokens: int = 256
    output_tokens: int = 64
    seed: int = 1
    preroute: bool = False
    #: ``replay`` (with ``first_k``): a streamed answer that passes on its first k tokens is sent again.
    replay: bool = False
    #: Seconds of warm-up arrivals (the same rate and mix, other prompts) sent first and not measured.
    warm_s: float = 0.0

    def sim_args(self, model: str) -> tuple[str, ...]:
        """The simulator's timing flags for ``model`` (``small``: every cost divided by the ratio)."""
        div = self.cost_ratio if model == "small" else 1.0
        return (
            "--time-scale", str(self.time_scale),
            "--step-base-ms", str(self.step_base_ms / div),
            "--decode-ms-per-seq", str(self.decode_ms_per_seq / div),
            "--prefill-tokens-per-s", str(self.prefill_tokens_per_s * div),
            "--log-level", "WARNING",
        )  # fmt: skip

    def policy(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"steps": ["small", "large"], "threshold": self.threshold, "stat": self.stat}
        if self.k is not None:
            spec["k"] = self.k
        if self.preroute:
            spec["preroute"] = {}  # the defaults: above 0.9, min_seen 10, explore 0.1
        if self.replay:
            spec["replay"] = True
        return {"models": {"auto": {"cascade": spec}}}

    def costs(self, prompt_tokens: float) -> Costs:
        """The cost model's parameters for this workload (``prompt_tokens``: as the engines counted them)."""
        return Costs(
            base_s=self.step_base_ms / 1e3,
            decode_s=self.decode_ms_per_seq / 1e3,
            prefill_s_per_token=1 / self.prefill_tokens_per_s,
            ratio=self.cost_ratio,
            prompt_tokens=prompt_tokens,
            output_tokens=self.output_tokens,
            hard_share=self.hard_share,
            time_scale=self.time_scale,
            lam=self.rate_req_s,
            all_large_replicas=self.all_large_replicas,
            small_replicas=self.small_replicas,
            large_replicas=self.large_replicas,
        )


def quick_config() -> CascadeConfig:
    return CascadeConfig(
        all_large_replicas=1, duration_s=3.0, rate_req_s=3.0, output_tokens=8, prompt_tokens=64
    )


@dataclass(frozen=True, slots=True)
class Request:
    """One request of the workload: when it is sent (seconds from the start), whether it is hard, its
    prompt."""

    at: float
    hard: bool
    prompt: str


def make_requests(config: CascadeConfig) -> list[Request]:
    """Poisson arrivals, each prompt unique (~``prompt_tokens`` tokens: about 5 a numbered word)."""
    rng = random.Random(config.seed)
    out: list[Request] = []
    t, i = 0.0, 0
    while True:
        t += rng.expovariate(config.rate_req_s)
        if t >= config.duration_s:
            return out
        hard = rng.random() < config.hard_share
        words = " ".join(f"r{i}w{j}" for j in range(max(1, config.prompt_tokens // 5)))
        out.append(Request(t, hard, f"[{'hard' if hard else 'easy'}] Question {i}: {words}"))
        i += 1


def warm_requests(config: CascadeConfig) -> list[Request]:
    """The warm-up phase: ``warm_s`` seconds of the workload under another seed, its prompts marked apart
    (no prefix shared with the measured ones)."""
    warm = replace(config, duration_s=config.warm_s, seed=config.seed + 1_000)
    marked = "Warm-up question"
    return [replace(r, prompt=r.prompt.replace("Question", marked, 1)) for r in make_requests(warm)]


@dataclass(slots=True)
class Record:
    hard: bool
    prompt_tokens: int = 0
    ok: bool = False
    status: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0
    step: str | None = None
    model: str | None = None
    completion_tokens: int = 0


async def _send(http: aiohttp.ClientSession, url: str, model: str, req: Request, max_tokens: int) -> Record:
    rec = Record(req.hard)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": req.prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    try:
        async with http.post(url, json=body) as resp:
            rec.status, rec.step = resp.status, resp.headers.get(STEP_HEADER)
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                rec.model = chunk.get("model", rec.model)
                choices = chunk.get("choices") or []
                if rec.ttft_s is None and choices and choices[0].get("delta", {}).get("content"):
                    rec.ttft_s = time.monotonic() - started
                if chunk.get("usage"):
                    rec.completion_tokens = chunk["usage"]["completion_tokens"]
                    rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
        rec.ok = rec.status == 200 and rec.ttft_s is not None
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("request failed: %s", type(exc).__name__)
    rec.total_s = time.monotonic() - started
    return rec


async def run_load(url: str, model: str, requests: Sequence[Request], config: CascadeConfig) -> list[Record]:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        start = time.monotonic()

        async def one(req: Request) -> Record:
            await asyncio.sleep(max(0.0, start + req.at - time.monotonic()))
            return await _send(http, url, model, req, config.output_tokens)

        return list(await asyncio.gather(*(one(r) for r in requests)))


def work_seconds(
    config: CascadeConfig, records: Sequence[Record], target: str, *, preroutes: int = 0, lone: bool = False
) -> float:
    """The batch-independent engine-seconds of ``records`` (module docstring): prompt tokens at the
    model's prefill rate plus output tokens at its per-sequence decode cost, time scale applied; in the
    cascade an escalated (hard) request pays the small model's (with a ``first_k`` gate only its first
    ``k`` output tokens) and then the large model's (no prefix cache is counted: an upper bound on the
    prompt part). ``lone``: the per-token reading instead (``extproc/cascade/cost.py`` ``C(P, n)``: the
    step base counted once per output token, as a lone request pays it); ``preroutes`` hard requests
    paid no small step (which of them does not matter: every request of the workload has nearly the
    same token counts). With ``replay`` a request answered by the small step also paid its cut first
    attempt's ``k`` tokens (the prompt once: cached for the replay)."""
    scale = config.time_scale

    def cost(model: str, r: Record, tokens: int) -> float:
        div = config.cost_ratio if model == "small" else 1.0
        prefill = r.prompt_tokens / (config.prefill_tokens_per_s * div)
        decode = tokens * config.decode_ms_per_seq / div / 1e3
        base = config.step_base_ms / div / 1e3 * tokens if lone else 0.0
        return scale * (prefill + decode + base)

    if target == "all-large":
        return sum(cost("large", r, r.completion_tokens) for r in records)
    total, skipped = 0.0, preroutes
    for r in records:
        if r.step == "2" and skipped > 0:
            skipped -= 1
            total += cost("large", r, r.completion_tokens)
            continue
        small = r.completion_tokens
        if r.step == "2" and config.stat == "first_k" and config.k is not None:
            small = min(small, config.k)  # cut after k tokens (a few more run before the engine notices)
        total += cost("small", r, small) + (cost("large", r, r.completion_tokens) if r.step == "2" else 0.0)
        if r.step == "1" and config.replay and config.k is not None:
            cut = min(r.completion_tokens, config.k)
            total += cost("small", replace(r, prompt_tokens=0), cut)  # the cut attempt's decode
    return total


def _busy(stack: Stack) -> dict[str, float]:
    """Per engine address: its busy engine-seconds so far."""
    out = {}
    for engine in stack.engines:
        got = http_get(f"http://{engine['address']}/metrics", timeout_s=5.0)
        text = got[1].decode() if got is not None and got[0] == 200 else ""
        out[engine["address"]] = sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(BUSY))
    return out


def _preroutes(stack: Stack) -> int:
    """Requests the ext_proc sent straight to the last step (``kvgate_cascade_preroutes_total``)."""
    port = stack.extproc_ports.get("metrics")
    got = None if port is None else http_get(f"http://127.0.0.1:{port}/metrics", timeout_s=5.0)
    text = got[1].decode() if got is not None and got[0] == 200 else ""
    name = "kvgate_cascade_preroutes_total"
    return int(sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name)))


def _ms(values: Sequence[float]) -> dict[str, float | int]:
    return summary([v * 1e3 for v in values])


def run_target(name: str, config: CascadeConfig, requests: list[Request], workdir: Path) -> dict[str, Any]:
    """Start ``name``'s fleet, send ``requests``, stop it; its row."""
    workdir.mkdir(parents=True, exist_ok=True)
    if name == "all-large":
        fleet = {"large": config.all_large_replicas}
    else:
        fleet = {"small": config.small_replicas, "large": config.large_replicas}
    sims: list[Child] = []
    started = time.monotonic()
    try:
        urls, served = [], {}
        model_dir = str(ensure_model_dir(smollm2_gguf_path()))  # the simulators' tokenizer (SmolLM2's)
        for model, replicas in fleet.items():
            ready = workdir / f"{model}.ready.json"
            ready.unlink(missing_ok=True)
            argv = [sys.executable, "-m", "load.sim.server", "--model", model, "--model-dir", model_dir]
            argv += ["--replicas", str(replicas), "--port", "0", "--ready-file", str(ready)]
            argv += config.sim_args(model)
            sims.append(child := Child(model, argv, workdir / f"{model}.log"))
            for replica in child.wait_for_json_file(ready, 120):
                urls.append(f"http://{replica['address']}")
                served[replica["address"]] = model
        policy = workdir / "policy.json"
        policy.write_text(json.dumps(config.policy()))
        options = StackOptions(
            port=0,
            model=None,
            endpoints=tuple(urls),
            workdir=workdir / "stack",
            overlay={"policy": {"file": str(policy)}},
        )
        with Stack(options) as stack:
            url = f"{stack.url}/v1/chat/completions"
            target_model = "large" if name == "all-large" else "auto"
            if config.warm_s > 0:  # a warm-up phase, not measured (the preroute learner learns in it)
                asyncio.run(run_load(url, target_model, warm_requests(config), config))
            before, preroutes_before = _busy(stack), _preroutes(stack)
            t0 = time.monotonic()
            records = asyncio.run(run_load(url, target_model, requests, config))
            wall = time.monotonic() - t0
            after = _busy(stack)
            preroutes = _preroutes(stack) - preroutes_before
    finally:
        for child in sims:
            child.stop()
    busy = {served[a]: 0.0 for a in after}
    for address, value in after.items():
        busy[served[address]] += value - before.get(address, 0.0)
    ok = [r for r in records if r.ok]
    steps: dict[str, int] = {}
    for r in ok:
        key = r.step or "-"
        steps[key] = steps.get(key, 0) + 1
    total_busy = sum(busy.values())
    work = work_seconds(config, ok, name)
    lone = work_seconds(config, ok, name, preroutes=preroutes, lone=True)
    return {
        "target": name,
        "sent": len(records),
        "served": len(ok),
        "errors": sorted({r.status for r in records if not r.ok}),
        "wall_s": round(wall, 2),
        "engine_seconds": {m: round(v, 3) for m, v in sorted(busy.items())},
        "replicas": fleet,
        "cost_per_request_engine_s": round(total_busy / len(ok), 5) if ok else None,
        "work_engine_s": round(work, 3),
        "work_per_request_engine_s": round(work / len(ok), 5) if ok else None,
        "answered_by_step": dict(sorted(steps.items())),
        "small_share": round(steps.get("1", 0) / len(ok), 3) if ok and name == "cascade" else 0.0,
        "models": sorted({r.model or "?" for r in ok}),
        "preroutes": preroutes,
        "lone_engine_s": round(lone, 3),
        "lone_per_request_engine_s": round(lone / len(ok), 5) if ok else None,
        "ttft_ms": {
            "all": _ms([r.ttft_s for r in ok if r.ttft_s is not None]),
            "easy": _ms([r.ttft_s for r in ok if r.ttft_s is not None and not r.hard]),
            "hard": _ms([r.ttft_s for r in ok if r.ttft_s is not None and r.hard]),
        },
        "latency_ms": _ms([r.total_s for r in ok]),
        "completion_tokens": sum(r.completion_tokens for r in ok),
        "prompt_tokens_mean": round(sum(r.prompt_tokens for r in ok) / len(ok), 1) if ok else None,
        "target_wall_s": round(time.monotonic() - started, 1),
    }


def goals(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The issue's goal, and the escalated requests' TTFT penalty (reported, no goal)."""
    large, cascade = rows.get("all-large", {}), rows.get("cascade", {})
    out: dict[str, dict[str, Any]] = {}
    wa, wc = large.get("work_per_request_engine_s"), cascade.get("work_per_request_engine_s")
    out["work_per_request_over_all_large"] = {
        "value": round(wc / wa, 3) if wa and wc is not None else None,
        "goal": None,
        "met": None,
        "note": "batch-independent work only (reported beside the goal, not instead of it)",
    }
    a, c = large.get("cost_per_request_engine_s"), cascade.get("cost_per_request_engine_s")
    if a and c is not None:
        out["cost_per_request_over_all_large"] = {
            "value": round(c / a, 3),
            "goal": "<= 0.5",
            "met": c / a <= 0.5,
        }
    else:
        out["cost_per_request_over_all_large"] = {"value": None, "goal": "<= 0.5", "met": None}
    penalty: dict[str, Any] = {"goal": None, "met": None}
    for kind in ("hard", "easy"):
        for pct in ("p50", "p90"):
            x = cascade.get("ttft_ms", {}).get(kind, {}).get(pct)
            y = large.get("ttft_ms", {}).get(kind, {}).get(pct)
            label = "escalated" if kind == "hard" else "small_answered"
            penalty[f"{label}_ttft_{pct}_added_ms"] = None if x is None or y is None else round(x - y, 1)
    out["ttft_penalty"] = penalty
    la, lc = large.get("lone_per_request_engine_s"), cascade.get("lone_per_request_engine_s")
    out["per_token_cost_over_all_large"] = {
        "value": round(lc / la, 3) if la and lc is not None else None,
        "goal": "<= 0.5 (the per-token reading of the same goal: reported beside it, not instead of it)",
        "met": None if not la or lc is None else lc / la <= 0.5,
    }
    return out


def cost_model(config: CascadeConfig, rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The arithmetic (``extproc/cascade/cost.py``) at this run's parameters: both readings for a perfect
    escalator, the buffered gate, a first_k gate and this run's policy (its measured preroute recall), and
    the sweep."""
    cascade = rows.get("cascade", {})
    costs = config.costs(cascade.get("prompt_tokens_mean") or config.prompt_tokens * 1.32)
    hard = max(1.0, costs.hard_share * (cascade.get("served") or 0))
    recall = min(1.0, (cascade.get("preroutes") or 0) / hard)
    cut_at = config.k if config.stat == "first_k" else None
    run = Policy(recall=recall, cut_at=cut_at, replay=config.replay and cut_at is not None)
    policies = {"perfect": PERFECT, "buffered": BUFFERED, "first_k_4": first_k(4), "this_run": run}

    def both(c: Costs) -> dict[str, dict[str, float]]:
        return {
            name: {"per_token": round(token_ratio(c, p), 3), "busy_time": round(busy_ratio(c, p), 3)}
            for name, p in policies.items()
        }

    return {
        "formulas": "extproc/cascade/README.md, 'What a cascade can save'",
        "params": asdict(costs),
        "sources": {
            **SIM_SOURCES,
            "prompt_tokens": "the engines' usage.prompt_tokens, mean over the cascade's requests",
            "hard_share": "the workload's share of [hard] prompts (the gate escalates exactly those)",
            "lam": "the workload's arrival rate (requests/s)",
        },
        "this_run_policy": {"recall": round(recall, 3), "cut_at": run.cut_at, "replay": run.replay},
        "ratios": both(costs),
        "sweep": [
            {"param": name, "factor": f, "value": getattr(c, name), "ratios": both(c)}
            for name, f, c in sweep(costs)
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m load.bench.cascade", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--out", type=Path, default=Path("results/cascade.json"), help="result JSON file")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (seconds, figures meaningless)")
    p.add_argument("--duration", type=float, help="seconds of arrivals")
    p.add_argument("--rate", type=float, help="arrivals per second")
    p.add_argument("--hard-share", type=float, help="share of hard prompts (0..1)")
    p.add_argument("--threshold", type=float, help="the gate's threshold (nats, <= 0)")
    p.add_argument("--stat", choices=("mean", "min", "first_k"), help="the gate's statistic (default mean)")
    p.add_argument("--k", type=int, help="tokens the first_k gate reads")
    p.add_argument("--seed", type=int, help="workload seed (default 1)")
    p.add_argument(
        "--all-large-replicas", type=int, help="large replicas of the all-large target (default 2)"
    )
    p.add_argument("--small-replicas", type=int, help="small replicas of the cascade (default 1)")
    p.add_argument("--large-replicas", type=int, help="large replicas of the cascade (default 1)")
    p.add_argument("--warm", type=float, help="seconds of unmeasured warm-up arrivals first (default 0)")
    p.add_argument(
        "--preroute", action="store_true", help="learn which requests escalate; send those straight to large"
    )
    p.add_argument(
        "--replay", action="store_true", help="first_k only: replay a passing answer so it streams (replay)"
    )
    args = p.parse_args(argv)
    if args.replay and (args.stat or "mean") != "first_k":
        p.error("--replay needs --stat first_k (and --k)")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = quick_config() if args.quick else CascadeConfig()
    for key, value in (
        ("duration_s", args.duration),
        ("rate_req_s", args.rate),
        ("hard_share", args.hard_share),
        ("threshold", args.threshold),
        ("stat", args.stat),
        ("k", args.k),
        ("seed", args.seed),
        ("all_large_replicas", args.all_large_replicas),
        ("small_replicas", args.small_replicas),
        ("large_replicas", args.large_replicas),
        ("preroute", args.preroute or None),
        ("replay", args.replay or None),
        ("warm_s", args.warm),
    ):
        if value is not None:
            config = replace(config, **{key: value})
    workdir = args.out.resolve().parent / f"{args.out.stem}-work"
    started = time.monotonic()
    requests = make_requests(config)
    result = header("cascade", argv, args.quick, config)
    result |= {
        "policy": config.policy(),
        "sim": {
            "args": {m: list(config.sim_args(m)) for m in ("small", "large")},
            "sources": SIM_SOURCES,
        },
        "requests": len(requests),
        "hard_requests": sum(r.hard for r in requests),
        "cost": "busy engine-seconds (kvgate_sim_busy_seconds_total summed over the target's engines) per"
        " request served; one GPU per replica, both models on the same GPU class; idle time not charged",
    }
    rows = {t: run_target(t, config, requests, workdir / t) for t in TARGETS}
    result["targets"] = rows
    result["goals"] = goals(rows)
    result["cost_model"] = cost_model(config, rows)
    return finish(result, args.out, started)


if __name__ == "__main__":
    raise SystemExit(main())
