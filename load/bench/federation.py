"""Cross-cluster federation (issue 22): two simulated regions, a shared-prefix workload whose groups are
homed in one region or the other, federated kvgate against the same clusters isolated.

    python -m load.bench.federation --out results/federation.json      # several minutes on a 2-core VM
    python -m load.bench.federation --quick --out /tmp/federation.json  # a smoke run; figures mean nothing

Regions: two ``kvgate up`` stacks (:class:`~kvgate.dev.up.Stack`), each its own etcd, Envoy, gateway and
``replicas`` node agents running a simulated vLLM (``load.sim``, the H100/8B step model at time scale 1, so
prefill runs at ``prefill_tokens_per_s`` in real time). Targets, each on fresh stacks (no cache carries
over):

* ``isolated``: no links; every request is served in the region it was sent to;
* ``federated-<rtt>ms``: both regions linked both ways (etcd ``federation/<peer>``, mTLS); every request
  arriving on a region's federation listener is held ``rtt`` ms by Envoy's fault filter, standing in for
  the round trip between regions. The gateways' ``prefill_s_per_token`` is the simulator's
  (``1 / prefill_tokens_per_s``) and ``rtt_ms`` the injected delay.

Workload: first, each of ``groups`` shared prefixes (``prefix_tokens`` long) is served once in its home
region (A for even groups, B for odd), then Poisson arrivals (seeded) at ``rate_req_s`` for ``duration_s``,
open loop, streamed, each sent to region A or B at random: a ``shared_fraction`` of them are a group's
prefix + a unique suffix (``suffix_tokens``), the rest unshared prompts of the same length. Figures per
target: TTFT p50/p90/p99 (ms) of cross-region shared requests (sent to the region that is not the group's
home), same-region shared, and unshared; forwards and egress (requests, bytes) per region from the
gateways' metrics, against the egress budget.

With ``--repeats N`` every target runs N times, interleaved (all targets, then all again), each on fresh
stacks; ``targets`` holds per-figure medians over the repeats (a percentile's median, not a pooled
percentile), ``goals`` are judged on them, and ``repeats`` keeps each repeat's rows and goals.

Per request (each row's ``requests``): id, region sent to, kind, group, send time, TTFT, prompt and cached
tokens, the replica that answered (``x-kvgate-replica``) and the region it is in (``served``: a cross
request's home when its region forwarded every cross request it got, as the forward counter says; else
``null``). ``behind`` names the requests whose uncached prefill (``PREFILL_NEIGHBOUR_TOKENS`` or more) ran
on the same replica while this one waited for its first token: both windows (send to first token, as the
client saw them) overlap. Such a request waited on another's prefill, which a router of the first one
cannot avoid when that replica is the only one holding its prefix. ``ttft_ms.cross_clear`` is the TTFT
summary of the cross requests behind nothing; its p90 ratio is reported beside the goal, not instead.

Goals (``goals``): cross-region shared TTFT p90 at 20 ms at least 2x better than isolated; unshared TTFT
p90 never more than 5 % worse than isolated (at every RTT); egress within budget.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from certs.store import LeafFiles, dev_bundle
from contracts.etcd import EtcdSettings
from kvgate.dev.procs import http_get
from kvgate.dev.up import DEFAULT_MODEL, Stack, StackOptions
from load.bench import TIMING_SOURCES, finish, opening, ranking_holds_all, step_args, step_variants, summary
from load.client import LoadOptions, RequestRecord, run_load
from load.workloads import smollm2_text
from load.workloads.session import Session, Turn, poisson_arrivals
from runtime.etcd import connect

log = logging.getLogger(__name__)

REGIONS = ("a", "b")
SIM_SOURCES = {
    **TIMING_SOURCES,
    "prefill_tokens_per_s": "20,000 tokens/s: compute-bound prefill at ~30% of the H100's bf16 peak"
    " (load/sim/timing.py, load/sim/README.md)",
    "time_scale": "1: steps in real time, so the injected round trip and the prefill saved are on one clock",
}


@dataclass(frozen=True, slots=True)
class FederationBenchConfig:
    """One run's regions, links and workload (see the module docstring)."""

    replicas: int = 2
    rtts_ms: tuple[float, ...] = (20.0, 80.0)
    time_scale: float = 1.0
    prefill_tokens_per_s: float = 20_000.0
    step_base_ms: float = 6.0
    decode_ms_per_seq: float = 0.15
    #: Every link's injected round trip is ``rtts_ms`` times this (the sweep's third parameter).
    rtt_scale: float = 1.0
    egress_requests_per_s: float = 20.0
    egress_bytes_per_s: float = 2_000_000.0
    groups: int = 8
    prefix_tokens: int = 4000
    suffix_tokens: int = 64
    shared_fraction: float = 0.5
    output_tokens: int = 16
    rate_req_s: float = 2.0
    duration_s: float = 40.0
    drain_s: float = 60.0
    seed: int = 1

    def sim_args(self) -> tuple[str, ...]:
        return (
            "--time-scale", str(self.time_scale),
            *step_args(self),
            "--max-model-len", "8192",
            "--log-level", "WARNING",
        )  # fmt: skip


def quick_config() -> FederationBenchConfig:
    return FederationBenchConfig(
        replicas=1,
        rtts_ms=(20.0,),
        groups=2,
        prefix_tokens=2000,
        suffix_tokens=16,
        output_tokens=4,
        rate_req_s=3.0,
        duration_s=3.0,
        drain_s=30.0,
    )


@dataclass(frozen=True, slots=True)
class Request:
    """One measured request: where it is sent, its kind (``cross``, ``local``, ``unshared``)."""

    region: str
    kind: str
    session: Session


def make_workload(config: FederationBenchConfig) -> tuple[list[tuple[str, Session]], list[Request]]:
    """The warm-up (one request per group, to its home region) and the measured requests."""
    text = smollm2_text()
    rng = random.Random(f"{config.seed}-federation")
    prefixes = [text.block(config.prefix_tokens, f"federation-prefix-{i}") for i in range(config.groups)]
    warm = []
    for g, prefix in enumerate(prefixes):
        turn = Turn(({"role": "user", "content": prefix + text.words(config.suffix_tokens, rng)},), 1)
        warm.append((REGIONS[g % 2], Session(f"warm{g}", f"g{g}", 0.0, (), (turn,))))
    arrivals = poisson_arrivals(config.rate_req_s, config.duration_s, random.Random(f"{config.seed}-arr"))
    requests = []
    for i, start in enumerate(arrivals):
        region = rng.choice(REGIONS)
        if rng.random() < config.shared_fraction:
            g = rng.randrange(config.groups)
            content = prefixes[g] + text.words(config.suffix_tokens, rng)
            kind = "local" if REGIONS[g % 2] == region else "cross"
            key = f"g{g}"
        else:
            content = text.words(config.prefix_tokens + config.suffix_tokens, rng)
            kind, key = "unshared", f"u{i}"
        turn = Turn(({"role": "user", "content": content},), config.output_tokens)
        requests.append(Request(region, kind, Session(f"r{i}", key, start, (), (turn,))))
    return warm, requests


class RegionRoute:
    """Each session to the region the workload chose for it."""

    def __init__(self, urls: dict[str, str], regions: dict[str, str]) -> None:
        self._urls = urls
        self._regions = regions

    def pick(self, session: Session, turn: int) -> str:
        return self._urls[self._regions[session.id]]

    def done(self, url: str) -> None:
        pass


def _section(name: str, leaf: LeafFiles, config: FederationBenchConfig) -> dict[str, Any]:
    return {
        "cluster": name,
        "tls_cert": str(leaf.cert),
        "tls_key": str(leaf.key),
        "tls_ca": str(leaf.ca),
        "prefill_s_per_token": 1.0 / config.prefill_tokens_per_s,
    }


def _link(peer: Stack, name: str, rtt_ms: float, config: FederationBenchConfig) -> bytes:
    return json.dumps(
        {
            "ingress": f"127.0.0.1:{peer.federation_port}",
            "service": f"127.0.0.1:{peer.federation_service_port}",
            "identity": f"spiffe://kvgate.local/federation-{name}",
            "rtt_ms": rtt_ms,
            "egress_requests_per_s": config.egress_requests_per_s,
            "egress_bytes_per_s": config.egress_bytes_per_s,
        }
    ).encode()


async def _put(stack: Stack, key: str, value: bytes) -> None:
    assert stack.etcd is not None
    client = await connect(EtcdSettings(endpoints=(stack.etcd.address,)))
    try:
        kv = client.kv
        assert kv is not None
        await kv.put(f"/kvgate/{key}", value)
    finally:
        await client.close()


def _metrics(stack: Stack) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    got = http_get(f"http://127.0.0.1:{stack.extproc_ports['metrics']}/metrics")
    if got is None or got[0] != 200:
        return {}
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(got[1].decode())
        for s in family.samples
    }


def _sum(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def _by_label(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, label: str
) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, labels), v in samples.items():
        if n == name:
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + v
    return dict(sorted(out.items()))


def decision_times(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    """The gateway's own decision time (``kvgate_decision_seconds``: parse, tokenize, digest, lookup,
    schedule): its count, mean (ms) and how many took over 10 ms (the histogram's next-to-last bound)."""
    name = "kvgate_decision_seconds"
    count, total = _sum(samples, f"{name}_count"), _sum(samples, f"{name}_sum")
    within = sum(
        v for (n, labels), v in samples.items() if n == f"{name}_bucket" and dict(labels).get("le") == "0.01"
    )
    return {
        "count": count,
        "mean_ms": round(total / count * 1e3, 3) if count else 0.0,
        "over_10ms": count - within,
    }


_DIAGNOSTICS = (
    "kvgate_federation_peer_up",
    "kvgate_federation_noted_digests",
    "kvgate_federation_summary_entries",
    "kvgate_index_blocks",
)


def _wait(condition: Callable[[], bool], stacks: dict[str, Stack], timeout_s: float = 60.0) -> None:
    """Poll ``condition`` (every 0.1 s) until true; RuntimeError after ``timeout_s``, naming what each
    region's metrics said then."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            seen = {
                region: {name: _sum(samples, name) for name in _DIAGNOSTICS}
                for region, samples in ((r, _metrics(s)) for r, s in stacks.items())
            }
            raise RuntimeError(f"the regions did not exchange summaries in time: {seen}")
        time.sleep(0.1)


def _wait_linked(stacks: dict[str, Stack]) -> None:
    """Until each region holds a fresh summary of the other."""
    _wait(lambda: all(_sum(_metrics(s), "kvgate_federation_peer_up") >= 1 for s in stacks.values()), stacks)


def _start(
    workdir: Path, leaves: dict[str, LeafFiles], config: FederationBenchConfig, rtt_ms: float | None
) -> dict[str, Stack]:
    stacks: dict[str, Stack] = {}
    try:
        for name in REGIONS:
            options = StackOptions(
                port=0,
                agents=config.replicas,
                agent_args=config.sim_args(),
                workdir=workdir / name,
                overlay={"federation": _section(name, leaves[f"federation-{name}"], config)},
                federation_delay_ms=rtt_ms or 0.0,
            )
            stacks[name] = Stack(options).start()
        if rtt_ms is not None:
            a, b = stacks["a"], stacks["b"]

            async def link() -> None:
                await _put(a, "federation/b", _link(b, "b", rtt_ms, config))
                await _put(b, "federation/a", _link(a, "a", rtt_ms, config))

            asyncio.run(link())
            _wait_linked(stacks)
    except BaseException:
        for stack in stacks.values():
            stack.stop()
        raise
    return stacks


def _ms(records: Sequence[RequestRecord]) -> dict[str, float | int]:
    return summary([r.ttft_s * 1e3 for r in records if r.ok and r.ttft_s is not None])


PREFILL_NEIGHBOUR_TOKENS = 1024
"""Uncached prompt tokens from which another request's prefill counts as one a request may wait behind:
half the simulator's ``max_num_batched_tokens`` (2,048), i.e. at least ~50 ms of a step at 20,000 tokens/s."""


def request_rows(
    records: Sequence[RequestRecord], requests: Sequence[Request], forwarded_all: dict[str, bool] | None
) -> list[dict[str, Any]]:
    """One dict per answered request (see the module docstring). ``forwarded_all``: ``None`` when the
    regions are isolated (every request is served where it was sent), else per region whether it forwarded
    every cross request it was sent (its forward count equals its cross count)."""
    by_id = {r.session.id: r for r in requests}
    out = []
    for rec in records:
        req = by_id[rec.session]
        served: str | None = req.region
        if req.kind == "cross" and forwarded_all is not None:  # its home, or unknown: which went is not known
            served = REGIONS[int(req.session.key[1:]) % 2] if forwarded_all.get(req.region) else None
        out.append(
            {
                "id": rec.session,
                "region": req.region,
                "kind": req.kind,
                "key": req.session.key,
                "sent_ms": round(rec.sent_s * 1e3, 1),
                "ttft_ms": None if rec.ttft_s is None else round(rec.ttft_s * 1e3, 1),
                "ok": rec.ok,
                "prompt_tokens": rec.prompt_tokens,
                "cached_tokens": rec.cached_tokens,
                "replica": rec.replica,
                "served": served,
            }
        )
    return out


def mark_behind(rows: list[dict[str, Any]], min_tokens: int = PREFILL_NEIGHBOUR_TOKENS) -> None:
    """Set each row's ``behind``: the ids of the other requests on the same (region, replica) with at
    least ``min_tokens`` uncached prompt tokens whose send-to-first-token window overlaps its own.
    Rows without a known serving region, replica or TTFT get ``None``."""
    known = [
        r for r in rows if r["served"] is not None and r["replica"] is not None and r["ttft_ms"] is not None
    ]
    for r in rows:
        r["behind"] = None
    for r in known:
        start, first = r["sent_ms"], r["sent_ms"] + r["ttft_ms"]
        r["behind"] = [
            q["id"]
            for q in known
            if q is not r
            and (q["served"], q["replica"]) == (r["served"], r["replica"])
            and q["prompt_tokens"] - q["cached_tokens"] >= min_tokens
            and q["sent_ms"] < first
            and q["sent_ms"] + q["ttft_ms"] > start
        ]


def run_target(
    name: str,
    rtt_ms: float | None,
    config: FederationBenchConfig,
    warm: list[tuple[str, Session]],
    requests: list[Request],
    workdir: Path,
    leaves: dict[str, LeafFiles],
    progress: bool,
) -> dict[str, Any]:
    started = time.monotonic()
    stacks = _start(workdir / name, leaves, config, rtt_ms)
    urls = {n: s.url for n, s in stacks.items()}
    try:
        warm_route = RegionRoute(urls, {s.id: region for region, s in warm})
        quiet = LoadOptions(DEFAULT_MODEL, mode="open", duration_s=1.0, drain_s=120.0, progress=False)
        # one group at a time, so each is in its home region's summary before the measured run
        for _, session in warm:
            asyncio.run(run_load([replace(session, start_s=0.0)], warm_route, quiet))
        if rtt_ms is not None:  # each region's copy of the other's summary holds its warm groups
            _wait(
                lambda: all(
                    _sum(_metrics(s), "kvgate_federation_summary_entries") > 0 for s in stacks.values()
                ),
                stacks,
            )
        route = RegionRoute(urls, {r.session.id: r.region for r in requests})
        options = LoadOptions(
            DEFAULT_MODEL, duration_s=config.duration_s, drain_s=config.drain_s, progress=progress, label=name
        )
        result = asyncio.run(run_load([r.session for r in requests], route, options))
        samples = {n: _metrics(s) for n, s in stacks.items()}
    finally:
        for stack in stacks.values():
            stack.stop()
    by_id = {r.session.id: r for r in requests}
    records = result.records
    kinds: dict[str, list[RequestRecord]] = {"cross": [], "local": [], "unshared": []}
    for rec in records:
        kinds[by_id[rec.session].kind].append(rec)
    forwards = {n: _sum(s, "kvgate_federation_forwards_total") for n, s in samples.items()}
    cross_sent = {n: sum(1 for r in requests if r.kind == "cross" and r.region == n) for n in REGIONS}
    per_request = request_rows(
        records, requests, None if rtt_ms is None else {n: forwards.get(n) == cross_sent[n] for n in REGIONS}
    )
    mark_behind(per_request)
    clear = {r["id"] for r in per_request if r["kind"] == "cross" and r["behind"] == []}
    behind = sorted(
        (r for r in per_request if r["kind"] == "cross" and r["behind"]), key=lambda r: -(r["ttft_ms"] or 0)
    )
    errors = sum(1 for r in records if not r.ok)
    wall = result.wall_s
    row: dict[str, Any] = {
        "target": name,
        "rtt_ms": rtt_ms,
        "sent": len(requests),
        "errors": errors,
        "wall_s": round(wall, 2),
        "ttft_ms": {
            **{kind: _ms(recs) for kind, recs in kinds.items()},
            "cross_clear": _ms([r for r in kinds["cross"] if r.session in clear]),
        },
        # cross requests that waited on another request's uncached prefill at their replica, worst first
        "cross_behind": [{k: r[k] for k in ("id", "ttft_ms", "served", "replica", "behind")} for r in behind],
        "cached_tokens_mean": {
            kind: round(sum(r.cached_tokens for r in recs if r.ok) / max(1, sum(r.ok for r in recs)), 1)
            for kind, recs in kinds.items()
        },
        "forwards": forwards,
        "egress_requests": {
            n: _sum(s, "kvgate_federation_egress_requests_total") for n, s in samples.items()
        },
        "egress_bytes": {n: _sum(s, "kvgate_federation_egress_bytes_total") for n, s in samples.items()},
        # why each request was or was not forwarded, per region (extproc/federation/README.md: reasons)
        "decisions": {
            n: _by_label(s, "kvgate_federation_decisions_total", "reason") for n, s in samples.items()
        },
        "decision_ms": {n: decision_times(s) for n, s in samples.items()},
        # what became of the forwards, per region (Envoy's logs: served, slow, unreachable, ...)
        "forward_outcomes": {
            n: _by_label(s, "kvgate_federation_forward_outcomes_total", "outcome") for n, s in samples.items()
        },
    }
    if wall > 0:
        row["egress_requests_per_s"] = {n: round(v / wall, 3) for n, v in row["egress_requests"].items()}
        row["egress_bytes_per_s"] = {n: round(v / wall, 1) for n, v in row["egress_bytes"].items()}
    row["target_wall_s"] = round(time.monotonic() - started, 1)
    row["requests"] = per_request
    return row


def _p90(row: dict[str, Any], kind: str) -> float | None:
    stats = row.get("ttft_ms", {}).get(kind, {})
    return float(stats["p90"]) if stats.get("n") else None


def goals(rows: list[dict[str, Any]], config: FederationBenchConfig) -> dict[str, Any]:
    iso = next((r for r in rows if r["target"] == "isolated"), None)
    out: dict[str, Any] = {}
    if iso is None:
        return {"note": "isolated did not run"}
    for row in rows:
        if row["target"] == "isolated":
            continue
        rtt = int(row["rtt_ms"])
        cross_i, cross_f = _p90(iso, "cross"), _p90(row, "cross")
        if cross_i and cross_f:
            speedup = cross_i / cross_f
            entry: dict[str, Any] = {"value": round(speedup, 3), "goal": ">= 2" if rtt == 20 else "report"}
            entry["met"] = speedup >= 2 if rtt == 20 else None
            out[f"cross_shared_ttft_p90_isolated_over_federated_{rtt}ms"] = entry
        clear_i, clear_f = _p90(iso, "cross_clear"), _p90(row, "cross_clear")
        if clear_i and clear_f:  # beside the goal, never instead of it
            out[f"cross_clear_ttft_p90_isolated_over_federated_{rtt}ms"] = {
                "value": round(clear_i / clear_f, 3),
                "goal": "report",
                "met": None,
            }
        un_i, un_f = _p90(iso, "unshared"), _p90(row, "unshared")
        if un_i and un_f:
            ratio = un_f / un_i
            out[f"unshared_ttft_p90_federated_over_isolated_{rtt}ms"] = {
                "value": round(ratio, 3),
                "goal": "<= 1.05",
                "met": ratio <= 1.05,
            }
        within = all(
            v <= config.egress_requests_per_s for v in row.get("egress_requests_per_s", {}).values()
        ) and all(v <= config.egress_bytes_per_s for v in row.get("egress_bytes_per_s", {}).values())
        out[f"egress_within_budget_{rtt}ms"] = {"value": within, "goal": "true", "met": within}
    return out


def _median(values: Sequence[Any]) -> Any:
    """The median of numbers (the mean of the middle two for an even count; ``None`` if any is
    ``None``); of mappings, per key present in every one; of anything else, the first."""
    first = values[0]
    if isinstance(first, dict):
        keys = [k for k in first if all(isinstance(v, dict) and k in v for v in values)]
        return {k: _median([v[k] for v in values]) for k in keys}
    if isinstance(first, bool) or not isinstance(first, int | float):
        return first
    if any(not isinstance(v, int | float) for v in values):
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    if isinstance(median, float) and all(isinstance(v, int) for v in values) and median.is_integer():
        return int(median)  # counts stay counts
    return round(median, 3) if isinstance(median, float) else median


def median_rows(repeats: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per target (in the first repeat's order), the median of each figure over the repeats that ran it."""
    names = [row["target"] for row in repeats[0]]
    out = []
    for name in names:
        rows = [
            {k: v for k, v in row.items() if k not in ("requests", "cross_behind")}  # per repeat only
            for rows in repeats
            for row in rows
            if row["target"] == name
        ]
        out.append({**_median(rows), "repeats": len(rows)})
    return out


#: Runs one target: (name, round trip or ``None`` for isolated, config, workdir) -> its row.
RunTarget = Callable[[str, float | None, FederationBenchConfig, Path], dict[str, Any]]


def sweep(config: FederationBenchConfig, workdir: Path, run: RunTarget) -> list[dict[str, Any]]:
    """Each key parameter halved, then doubled (the prefill rate, the decode step, the injected round trip:
    :func:`load.bench.step_variants`); each variant runs ``isolated`` and one federated target at the first
    round trip (20 ms by default) scaled. ``ranking_holds``: federated cross-region shared TTFT p90 below
    isolated's; the goal ratios beside it."""
    out = []
    for i, (param, factor, varied) in enumerate(step_variants(config, "rtt_scale")):
        rtt = varied.rtts_ms[0] * varied.rtt_scale
        log.warning("sweep: %s x%g", param, factor)
        work = workdir / f"sweep-{i}"
        rows = [run("isolated", None, varied, work), run(f"federated-{rtt:g}ms", rtt, varied, work)]
        iso, fed = rows
        cross_i, cross_f = _p90(iso, "cross"), _p90(fed, "cross")
        un_i, un_f = _p90(iso, "unshared"), _p90(fed, "unshared")
        speedup = round(cross_i / cross_f, 3) if cross_i and cross_f else None
        out.append(
            {
                "parameter": param,
                "factor": factor,
                "rtt_ms": rtt,
                "sim_args": list(varied.sim_args()),
                "cross_shared_ttft_p90_isolated_over_federated": speedup,
                "unshared_ttft_p90_federated_over_isolated": (
                    round(un_f / un_i, 3) if un_i and un_f else None
                ),
                "ranking_holds": speedup is not None and speedup > 1.0,
                "targets": [{k: v for k, v in r.items() if k != "requests"} for r in rows],
            }
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m load.bench.federation", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--out", type=Path, default=Path("results/federation.json"), help="result JSON file")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (figures meaningless)")
    p.add_argument("--duration", type=float, help="seconds of arrivals")
    p.add_argument("--rate", type=float, help="arrivals per second")
    p.add_argument("--seed", type=int, help="workload seed (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every target, interleaved (isolated, federated, ..., then again); the table and the"
        " goals are per-figure medians, each repeat's rows are kept under 'repeats'",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="after the run, each key parameter halved and doubled (prefill rate, decode step, round trip),"
        " isolated and federated at the first round trip each time; 'ranking_holds': federated cross p90"
        " below isolated's",
    )
    p.add_argument("--sweep-only", action="store_true", help="the sweep alone, without the main run")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = quick_config() if args.quick else FederationBenchConfig()
    for key, value in (("duration_s", args.duration), ("rate_req_s", args.rate), ("seed", args.seed)):
        if value is not None:
            config = replace(config, **{key: value})
    workdir = args.out.resolve().parent / f"{args.out.stem}-work"
    workdir.mkdir(parents=True, exist_ok=True)
    leaves = dev_bundle(workdir / "pki", [f"federation-{r}" for r in REGIONS], dt.datetime.now(dt.UTC))
    started = time.monotonic()
    warm, requests = make_workload(config)
    result = opening("federation", argv, args.quick, config, SIM_SOURCES, len(requests))
    result["kinds"] = {k: sum(r.kind == k for r in requests) for k in ("cross", "local", "unshared")}
    progress = not args.no_progress
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    targets: list[tuple[str, float | None]] = [("isolated", None)]
    targets += [(f"federated-{int(rtt)}ms", rtt * config.rtt_scale) for rtt in config.rtts_ms]
    if not args.sweep_only:
        repeats: list[list[dict[str, Any]]] = []
        for i in range(args.repeats):
            work = workdir if args.repeats == 1 else workdir / f"repeat-{i + 1}"
            repeats.append(
                [run_target(n, rtt, config, warm, requests, work, leaves, progress) for n, rtt in targets]
            )
        if args.repeats == 1:
            result["targets"] = repeats[0]
        else:
            result["targets"] = median_rows(repeats)
            result["repeats"] = [{"targets": rows, "goals": goals(rows, config)} for rows in repeats]
        result["goals"] = goals(result["targets"], config)
    if args.sweep or args.sweep_only:
        result["sweep"] = sweep(
            config,
            workdir,
            lambda name, rtt, varied, work: run_target(
                name, rtt, varied, warm, requests, work, leaves, progress
            ),
        )
        result["sweep_ranking_holds_all"] = ranking_holds_all(result["sweep"])
    return finish(result, args.out, started)


if __name__ == "__main__":
    raise SystemExit(main())
