"""Routing benchmark results: per-run metrics, the issue's goals, a markdown table and one plot per metric.

Metric meanings (``summarize``): latencies in seconds, client side, over successful requests; ``ttft``
time to first streamed token; ``itl`` gaps between streamed chunks; ``e2e`` send to last token;
``output_tok_s`` completion tokens of successful requests / run wall time (first send to last token);
``hit_ratio`` the fleet's prefix-cache hits, sum(cached_tokens) / sum(prompt_tokens) from the engines'
``usage``; ``replica_requests`` requests served per replica (``x-kvgate-replica``), and
``max_over_mean`` the busiest replica's count over the mean across all replicas (1.0 = perfectly even);
``key_moves`` the share of requests that went to another replica than the last earlier request with the
same oracle key (shared-prefix group, agent session; warm-up requests count as earlier ones): 0 = every
key stays on one replica (what prefix affinity aims at), higher = keys split or moved, each move
recomputing the prefix and duplicating it in a second cache.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from load.bench import SUCCESS_GOAL, percentile, success_goal
from load.client import RequestRecord, RunResult

PLOTTED = (
    ("ttft_p90_s", "TTFT p90 (s)"),
    ("ttft_p50_s", "TTFT p50 (s)"),
    ("itl_p90_s", "ITL p90 (s)"),
    ("e2e_p90_s", "end-to-end latency p90 (s)"),
    ("output_tok_s", "output tokens/s"),
    ("hit_ratio", "prefix-cache hit ratio"),
    ("max_over_mean", "busiest replica / mean (requests)"),
    ("key_moves", "requests sent off their key's last replica (share)"),
)


def _pcts(samples: Sequence[float], name: str) -> dict[str, float]:
    ordered = sorted(samples)
    return {f"{name}_p{p}_s": round(percentile(ordered, p), 4) for p in (50, 90, 99)}


def summarize(result: RunResult, replica_ids: Sequence[str], warmup_s: float = 0.0) -> dict[str, Any]:
    """The metrics of one run (see the module docstring) over the requests sent after ``warmup_s``;
    the wall time is then from ``warmup_s`` to the last of those requests' last token."""
    moves, followers = _key_moves(result.records, warmup_s)
    records = [r for r in result.records if r.sent_s >= warmup_s]
    failed_in_warmup = sum(1 for r in result.records if r.sent_s < warmup_s and not r.ok)
    if warmup_s > 0:
        ends = [r.sent_s + (r.e2e_s or 0.0) for r in records]
        result = RunResult(
            records, max(ends, default=warmup_s) - warmup_s, result.sessions_started, result.sessions_aborted
        )
    ok = [r for r in records if r.ok]
    statuses: dict[str, int] = {}
    for r in records:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    per_replica = {rid: 0 for rid in replica_ids}
    for r in ok:
        if r.replica is not None:
            per_replica[r.replica] = per_replica.get(r.replica, 0) + 1
    mean = sum(per_replica.values()) / len(per_replica) if per_replica else 0.0
    prompt = sum(r.prompt_tokens for r in ok)
    out_tokens = sum(r.completion_tokens for r in ok)
    return {
        "warmup_s": warmup_s,
        "requests": len(records),
        "ok": len(ok),
        "success": round(len(ok) / len(records), 4) if records else 0.0,
        "statuses": statuses,
        "sessions": result.sessions_started,
        "sessions_aborted": result.sessions_aborted,
        "failed_in_warmup": failed_in_warmup,
        "wall_s": round(result.wall_s, 2),
        "request_rate": round(len(records) / result.wall_s, 2) if result.wall_s else 0.0,
        **_pcts([r.ttft_s for r in ok if r.ttft_s is not None], "ttft"),
        **_pcts([g for r in ok for g in r.chunk_gaps_s], "itl"),
        **_pcts([r.e2e_s for r in ok if r.e2e_s is not None], "e2e"),
        "output_tok_s": round(out_tokens / result.wall_s, 1) if result.wall_s else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "hit_ratio": round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt else 0.0,
        "replica_requests": per_replica,
        "max_over_mean": round(max(per_replica.values()) / mean, 3) if mean else 0.0,
        "key_moves": round(moves / followers, 4) if followers else 0.0,
    }


def _key_moves(records: Sequence[RequestRecord], warmup_s: float) -> tuple[int, int]:
    """``(moves, followers)``: of the successful requests sent at or after ``warmup_s`` that have an
    earlier successful request with the same key (``followers``), how many went to another replica than
    the latest such one."""
    last: dict[str, str] = {}
    moves = followers = 0
    for r in sorted(records, key=lambda r: r.sent_s):
        replica = r.replica
        if not r.ok or replica is None:
            continue
        before = last.get(r.key)
        if before is not None and r.sent_s >= warmup_s:
            followers += 1
            moves += before != replica
        last[r.key] = replica
    return moves, followers


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def goals(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The issue's goals, quoted from this run's results at each workload's highest load.

    Output throughput is compared in the closed loop (``shared-prefix-closed``) when the run has it: a
    saturated fleet's output/s is its capacity under each router. In the open loop every router that keeps
    up delivers the arrival rate, so the ratio there only reflects the last requests' tail; it is kept as
    ``shared_prefix_open_loop_output_tok_s_vs_best_peer`` (no goal), and is the goal's source only for a
    run without the closed loop.
    """
    out: dict[str, Any] = {}

    def top(workload: str) -> dict[str, Mapping[str, Any]]:
        mine = [r for r in runs if r["workload"] == workload and r.get("metrics")]
        if not mine:
            return {}
        load = max(r["load"] for r in mine)
        return {r["target"]: r["metrics"] for r in mine if r["load"] == load}

    sp = top("shared-prefix")
    closed = top("shared-prefix-closed")
    ag = top("agentic")
    peers = {t: m for t, m in sp.items() if t in ("sglang-router", "vllm-router")}
    closed_peers = {t: m for t, m in closed.items() if t in ("sglang-router", "vllm-router")}
    closed_load = max(
        (r["load"] for r in runs if r["workload"] == "shared-prefix-closed" and r.get("metrics")), default=0
    )
    # Goals for each kvgate mode: the approximate index (keys as named) and the precise one ("_precise").
    for target, suffix in (("kvgate", ""), ("kvgate-precise", "_precise")):
        kv = sp.get(target)
        if kv is not None and peers:
            # A peer that served nothing has no TTFT (NaN), and min() over a NaN depends on the order.
            timed = {t: m for t, m in peers.items() if not math.isnan(m["ttft_p90_s"])} or peers
            best_ttft = min(timed.items(), key=lambda kv_: kv_[1]["ttft_p90_s"])
            best_tput = max(peers.items(), key=lambda kv_: kv_[1]["output_tok_s"])
            ratio = _ratio(kv["ttft_p90_s"], best_ttft[1]["ttft_p90_s"])
            out["shared_prefix_ttft_p90_vs_best_peer" + suffix] = {
                "value": ratio,
                "best_peer": best_ttft[0],
                "goal": "<= 0.5",
                "met": ratio <= 0.5,
            }
            ratio = _ratio(kv["output_tok_s"], best_tput[1]["output_tok_s"])
            if closed_peers and target in closed:
                out["shared_prefix_open_loop_output_tok_s_vs_best_peer" + suffix] = {
                    "value": ratio,
                    "best_peer": best_tput[0],
                }
            else:
                out["shared_prefix_output_tok_s_vs_best_peer" + suffix] = {
                    "value": ratio,
                    "best_peer": best_tput[0],
                    "measured": "open loop",
                    "goal": ">= 1.2",
                    "met": ratio >= 1.2,
                }
        if target in closed and closed_peers:
            best = max(closed_peers.items(), key=lambda kv_: kv_[1]["output_tok_s"])
            ratio = _ratio(closed[target]["output_tok_s"], best[1]["output_tok_s"])
            out["shared_prefix_output_tok_s_vs_best_peer" + suffix] = {
                "value": ratio,
                "best_peer": best[0],
                "measured": f"closed loop, {closed_load:g} concurrent sessions",
                "goal": ">= 1.2",
                "met": ratio >= 1.2,
            }
        if kv is not None and "round-robin" in sp:
            ratio = _ratio(sp["round-robin"]["ttft_p90_s"], kv["ttft_p90_s"])
            out["shared_prefix_round_robin_ttft_p90_over_kvgate" + suffix] = {
                "value": ratio,
                "goal": ">= 10",
                "met": ratio >= 10,
            }
        if target in ag and "oracle" in ag:
            ratio = _ratio(ag[target]["hit_ratio"], ag["oracle"]["hit_ratio"])
            met = ratio >= 0.9
            out["agentic_hit_ratio_vs_oracle" + suffix] = {"value": ratio, "goal": ">= 0.9", "met": met}
        if target in ag:
            value = ag[target]["max_over_mean"]
            out["agentic_busiest_replica_over_mean" + suffix] = {
                "value": value,
                "goal": "<= 1.5",
                "met": value <= 1.5,
            }
    measured = [r for r in runs if r.get("metrics")]
    failed = [
        f"{r['workload']}@{r['load']}/{r['target']}"
        for r in measured
        if r["metrics"]["success"] < 1.0
        or r["metrics"]["sessions_aborted"]
        or r["metrics"].get("failed_in_warmup", 0)
    ]
    out[SUCCESS_GOAL] = success_goal(failed)
    return out


def merge_repeats(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, load, target) from rows that ran ``repeat`` 0..N-1 times: each numeric
    metric is the median over the repeats that were measured (``metrics_runs`` keeps each one's value),
    and ``replica_requests`` is the first repeat's (a count per replica, not a sample). A target skipped
    in every repeat stays skipped; success counts are summed, so one failed request shows."""
    groups: dict[tuple[str, float, str], list[Mapping[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["workload"], r["load"], r["target"]), []).append(r)
    out: list[dict[str, Any]] = []
    for rows in groups.values():
        merged = {k: v for k, v in rows[0].items() if k not in ("metrics", "repeat", "run_s", "skipped")}
        measured = [r["metrics"] for r in rows if r.get("metrics")]
        merged["repeats"] = len(rows)
        if not measured:
            merged["skipped"] = rows[0].get("skipped", "not measured")
            out.append(merged)
            continue
        metrics: dict[str, Any] = {}
        runs_of: dict[str, list[float]] = {}
        for key, first in measured[0].items():
            if key in ("ok", "requests", "sessions_aborted", "failed_in_warmup"):
                metrics[key] = sum(m.get(key, 0) for m in measured)
            elif key == "statuses":
                metrics[key] = {}
                for m in measured:
                    for status, n in m[key].items():
                        metrics[key][status] = metrics[key].get(status, 0) + n
            elif isinstance(first, int | float) and not isinstance(first, bool):
                values = [float(m[key]) for m in measured if key in m]
                metrics[key] = round(percentile(sorted(values), 50), 4)
                runs_of[key] = values
            else:
                metrics[key] = first
        if "ok" in metrics and metrics.get("requests"):
            metrics["success"] = metrics["ok"] / metrics["requests"]
        merged["metrics"] = metrics
        merged["metrics_runs"] = runs_of
        out.append(merged)
    return out


def summary(result: Mapping[str, Any], name: str, date: str) -> dict[str, Any]:
    """The figures a BENCHMARKS.md table quotes and ``python -m load.bench.plots`` draws, from the result
    of ``load.bench.routing.run`` (its ``routing.json``); written next to it as ``routing-summary.json``.

    Shape (``docs/bench/*.json`` holds quoted runs in it)::

        benchmark  "routing-summary"
        name       the run's name (its output directory's); images are named after it
        source     where the figures come from
        command, commit, changed, date (UTC day, YYYY-MM-DD), machine (dict), wall_s, repeats
        rows       per (workload, load, target): workload, load, load_unit, target, and either
                   metrics {key: {"median": x, "rounds": [x, ...]}} or skipped (why)
        goals      report.goals' names: value, goal, met, best_peer/measured where it has them, and
                   rounds (each round's value) when the run had several

    ``median`` is the number the tables quote (``merge_repeats``' median); ``rounds`` each round's own
    value, in round order, of the rounds that measured the target (one value for a single run).
    Metrics are ``PLOTTED``'s keys, as ``summarize`` defines them. A record transcribed from a table
    holds the columns the table quotes, leaves ``rounds`` out where it quoted only the median, and adds
    ``benchmarks_section``: the BENCHMARKS.md heading it was transcribed from.
    """
    repeats = int(result.get("repeats", 1))
    rows_in = result["merged"] if "merged" in result else result["runs"]
    rows: list[dict[str, Any]] = []
    for r in rows_in:
        row: dict[str, Any] = {k: r[k] for k in ("workload", "load", "load_unit", "target")}
        m = r.get("metrics")
        if m is None:
            row["skipped"] = r.get("skipped", "not measured")
        else:
            per_round = r.get("metrics_runs", {})
            row["metrics"] = {
                key: {"median": m[key], "rounds": list(per_round.get(key, [m[key]]))} for key, _ in PLOTTED
            }
        rows.append(row)
    by_round: Sequence[Mapping[str, Any]] = result.get("goals_by_round", [])
    goals_out: dict[str, Any] = {}
    for goal_name, goal in result["goals"].items():
        entry = dict(goal)
        if by_round and all(goal_name in g for g in by_round):
            entry["rounds"] = [g[goal_name]["value"] for g in by_round]
        goals_out[goal_name] = entry
    revision = result.get("revision", {})
    return {
        "benchmark": "routing-summary",
        "name": name,
        "source": "written by kvgate bench routing; routing.json beside it holds every run",
        "command": result.get("command", ""),
        "commit": revision.get("commit", ""),
        "changed": revision.get("changed", []),
        "date": date,
        "machine": result.get("machine", {}),
        "wall_s": result.get("wall_s"),
        "repeats": repeats,
        "rows": rows,
        "goals": goals_out,
    }


def markdown_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """One row per (workload, load, target); skipped targets say why."""
    head = (
        "| workload | load | target | TTFT p50 / p90 / p99 (s) | ITL p90 (s) | e2e p90 (s) | out tok/s "
        "| hit ratio | busiest/mean | key moves | success |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in runs:
        m = r.get("metrics")
        where = f"| {r['workload']} | {r['load_label']} | {r['target']} |"
        if m is None:
            rows.append(f"{where} skipped: {r.get('skipped', '?')} ||||||||")
            continue
        ttft = f"{m['ttft_p50_s']:.3f} / {m['ttft_p90_s']:.3f} / {m['ttft_p99_s']:.3f}"
        rows.append(
            f"{where} {ttft} | {m['itl_p90_s']:.3f} | {m['e2e_p90_s']:.2f} | {m['output_tok_s']:.0f} "
            f"| {m['hit_ratio']:.3f} | {m['max_over_mean']:.2f} | {m['key_moves']:.3f} "
            f"| {m['ok']}/{m['requests']} |"
        )
    return head + "\n".join(rows) + "\n"


def plot(runs: Sequence[Mapping[str, Any]], out_dir: Path) -> list[Path]:
    """One PNG per (workload, metric): load on x, the metric on y, one line per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    for workload in dict.fromkeys(r["workload"] for r in runs):
        mine = [r for r in runs if r["workload"] == workload and r.get("metrics")]
        targets = list(dict.fromkeys(r["target"] for r in mine))
        unit = next((r["load_unit"] for r in mine), "load")
        for key, label in PLOTTED:
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            for target in targets:
                points = sorted((r["load"], r["metrics"][key]) for r in mine if r["target"] == target)
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=target)
            ax.set_xlabel(unit)
            ax.set_ylabel(label)
            ax.set_title(f"{workload}: {label}")
            if key.endswith("_s") and key != "output_tok_s":
                ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = out_dir / f"{workload}-{key}.png"
            fig.savefig(path, dpi=90)
            plt.close(fig)
            written.append(path)
    return written
