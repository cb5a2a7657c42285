"""Several ext_procs' status documents as one view: the workers of a host (``[extproc] workers``, ``kvgate
up --extprocs N``) or the picker's replicas (Kubernetes), each of which serves only what it sees.

Pure: :func:`combine` takes ``(source, Status)`` pairs (a source is where the view came from, e.g. its
URL) and returns the merged :class:`~extproc.status.snapshot.Status`, a line per thing the views
disagree on, and what each view said in brief. Every worker follows the same feeds, etcd and engines,
so what describes an engine or the fleet is one thing seen several times; what a worker does with its
own streams is its own and adds up:

    per endpoint (by id)
      state            the worst any view reports (unhealthy > draining > ejected > ready): a request
                       may reach any worker, so one that will not route there matters
      healthy          all views; draining: any view; ejected_for_s: the longest
      load             the largest estimate (each already counts its siblings' in-flight requests)
      running, waiting, kv_usage   the newest view's reading (by ``at``) among those that have one
      in_flight, outstanding       summed (each worker's own streams)
      routed_share     sum of routed_recent / sum over the fleet of it (a view from a gateway without
                       routed_recent, older than this field, counts 0)
      index_blocks     the largest (each worker keeps its own index of the same feeds); precise: any
    index          mode precise if any; blocks and each store's tier: the largest; feeds by address:
                   connected only if every view is, endpoints united, age and staleness the largest,
                   the first last_error
    policy         the first view's values; a path whose value differs between views is a disagreement;
                   overridden and refused paths united
    queues         summed per (model, priority); queued summed
    drift          per (model, endpoint, source), tripped if any view's alarm is:
                   responses: every ext_proc hears every completion (kvgate/envoy/resilience.py), so each
                   view's window holds the same answers: samples, observed, ratio and error of the view
                   with the most samples (not summed: that would count each answer once per view);
                   counters: each view compares what it routed itself: samples and observed summed,
                   ratio and error the samples-weighted mean (the exact figure needs each window's
                   token sums, not served)

Disagreements named: an endpoint's state, an endpoint one view lacks, a feed connected at one view and
lost at another, the index mode, a policy value. Nothing here holds more than the documents do (no
prompt, token or credential).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from extproc.drift.monitor import COUNTERS
from extproc.status.snapshot import (
    DriftStatus,
    EndpointStatus,
    FeedStatus,
    IndexStatus,
    PolicyStatus,
    QueueStatus,
    Status,
)

#: Endpoint states from worst to best (:func:`extproc.status.snapshot.endpoint_state`).
STATE_ORDER = ("unhealthy", "draining", "ejected", "ready")

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class ViewSummary:
    """What one view said, in brief: endpoints ready of known, its own open streams, requests it holds,
    index blocks, feeds connected of known; ``error``: why there is no view (unreachable, not a status
    document), then every figure is 0."""

    source: str
    at: float = 0.0
    ready: int = 0
    endpoints: int = 0
    in_flight: int = 0
    queued: int = 0
    blocks: int = 0
    feeds_connected: int = 0
    feeds: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class Combined:
    """The merged status (``None`` when no view answered), one line per disagreement, and every
    source's summary in the order given."""

    status: Status | None
    disagreements: tuple[str, ...]
    views: tuple[ViewSummary, ...]


def summary(source: str, status: Status) -> ViewSummary:
    feeds = status.index.feeds
    return ViewSummary(
        source=source,
        at=status.at,
        ready=sum(e.state == "ready" for e in status.endpoints),
        endpoints=len(status.endpoints),
        in_flight=sum(e.in_flight for e in status.endpoints),
        queued=status.queued,
        blocks=status.index.blocks,
        feeds_connected=sum(f.connected for f in feeds),
        feeds=len(feeds),
    )


def combine(views: Sequence[tuple[str, Status]], failed: Sequence[tuple[str, str]] = ()) -> Combined:
    """One view of ``views`` (source, status) (module docstring); ``failed``: (source, why) of the
    ones that gave none, listed in the summaries."""
    summaries = tuple(summary(s, v) for s, v in views) + tuple(ViewSummary(s, error=e) for s, e in failed)
    if not views:
        return Combined(None, (), summaries)
    notes: list[str] = []
    newest_first = sorted(views, key=lambda sv: -sv[1].at)
    endpoints = _endpoints(views, newest_first, notes)
    index = _index(views, notes)
    policy = _policy(views, notes)
    queues = _queues(views)
    first = views[0][1]
    return Combined(
        Status(
            at=max(v.at for _, v in views),
            models=tuple(sorted({m for _, v in views for m in v.models})),
            endpoints=endpoints,
            index=index,
            policy=policy,
            queues=queues,
            schema=first.schema,
            queued=sum(q.queued for q in queues),
            drift=_drift(views),
        ),
        tuple(notes),
        summaries,
    )


def _by(
    items: Sequence[tuple[str, Sequence[_T]]], key: Callable[[_T], Any]
) -> dict[Any, list[tuple[str, _T]]]:
    out: dict[Any, list[tuple[str, _T]]] = {}
    for source, values in items:
        for value in values:
            out.setdefault(key(value), []).append((source, value))
    return out


def _states(seen: list[tuple[str, str]]) -> str:
    return ", ".join(f"{state} at {source}" for source, state in seen)


def _endpoints(
    views: Sequence[tuple[str, Status]], newest_first: Sequence[tuple[str, Status]], notes: list[str]
) -> tuple[EndpointStatus, ...]:
    grouped = _by([(s, v.endpoints) for s, v in views], lambda e: e.id)
    reading = {}
    for _, view in reversed(newest_first):  # oldest first: the newest reading is written last
        for e in view.endpoints:
            if e.running is not None or e.kv_usage is not None or e.waiting is not None:
                reading[e.id] = (e.running, e.waiting, e.kv_usage)
    total_recent = sum(e.routed_recent for _, v in views for e in v.endpoints)
    out = []
    for endpoint_id in sorted(grouped):
        seen = grouped[endpoint_id]
        states = [(s, e.state) for s, e in seen]
        if len({state for _, state in states}) > 1:
            notes.append(f"endpoint {endpoint_id}: {_states(states)}")
        missing = [s for s, _ in views if s not in {src for src, _ in seen}]
        if missing:
            notes.append(f"endpoint {endpoint_id}: unknown to {', '.join(missing)}")
        es = [e for _, e in seen]
        first = es[0]
        recent = sum(e.routed_recent for e in es)
        running, waiting, kv_usage = reading.get(endpoint_id, (None, None, None))
        out.append(
            EndpointStatus(
                id=first.id,
                address=first.address,
                models=first.models,
                role=first.role,
                engine=first.engine,
                node=first.node,
                state=min((e.state for e in es), key=_state_rank),
                healthy=all(e.healthy for e in es),
                draining=any(e.draining for e in es),
                ejected_for_s=max(e.ejected_for_s for e in es),
                load=max(e.load for e in es),
                running=running,
                waiting=waiting,
                kv_usage=kv_usage,
                in_flight=sum(e.in_flight for e in es),
                outstanding=sum(e.outstanding for e in es),
                routed_share=recent / total_recent if total_recent > 0 else 0.0,
                index_blocks=max(e.index_blocks for e in es),
                precise=any(e.precise for e in es),
                routed_recent=recent,
            )
        )
    return tuple(out)


def _state_rank(state: str) -> int:
    return STATE_ORDER.index(state) if state in STATE_ORDER else 0


def _largest(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _index(views: Sequence[tuple[str, Status]], notes: list[str]) -> IndexStatus:
    modes = [(s, v.index.mode) for s, v in views]
    if len({m for _, m in modes}) > 1:
        notes.append(f"index mode: {_states(modes)}")
    stores: dict[str, dict[str, int]] = {}
    for _, view in views:
        for store, tiers in view.index.stores.items():
            merged = stores.setdefault(store, {})
            for tier, blocks in tiers.items():
                merged[tier] = max(merged.get(tier, 0), blocks)
    feeds = []
    for address, seen in sorted(_by([(s, v.index.feeds) for s, v in views], lambda f: f.address).items()):
        fs = [f for _, f in seen]
        if len({f.connected for f in fs}) > 1:
            states = [(s, "connected" if f.connected else "lost") for s, f in seen]
            notes.append(f"feed {address}: {_states(states)}")
        feeds.append(
            FeedStatus(
                address=address,
                connected=all(f.connected for f in fs),
                endpoints=tuple(sorted({e for f in fs for e in f.endpoints})),
                age_s=_largest([f.age_s for f in fs]),
                staleness_s=_largest([f.staleness_s for f in fs]),
                last_error=next((f.last_error for f in fs if f.last_error), ""),
            )
        )
    return IndexStatus(
        mode="precise" if any(m == "precise" for _, m in modes) else modes[0][1],
        blocks=max(v.index.blocks for _, v in views),
        stores={k: dict(sorted(v.items())) for k, v in sorted(stores.items())},
        feeds=tuple(feeds),
    )


def _policy(views: Sequence[tuple[str, Status]], notes: list[str]) -> PolicyStatus:
    values = dict(views[0][1].policy.values)
    for path in sorted({p for _, v in views for p in v.policy.values}):
        seen = [(s, v.policy.values[path]) for s, v in views if path in v.policy.values]
        if len(seen) < len(views) or any(value != seen[0][1] for _, value in seen):
            shown = [(s, json.dumps(value, separators=(",", ":"), sort_keys=True)) for s, value in seen]
            notes.append(f"policy {path}: {_states(shown)}")
        values.setdefault(path, seen[0][1])
    rejected: dict[str, str] = {}
    for _, view in views:
        for path, reason in view.policy.rejected.items():
            rejected.setdefault(path, reason)
    return PolicyStatus(
        values=values,
        overridden=tuple(sorted({p for _, v in views for p in v.policy.overridden})),
        rejected=dict(sorted(rejected.items())),
    )


def _queues(views: Sequence[tuple[str, Status]]) -> tuple[QueueStatus, ...]:
    held: dict[tuple[str, int], int] = {}
    for _, view in views:
        for q in view.queues:
            held[(q.model, q.priority)] = held.get((q.model, q.priority), 0) + q.queued
    return tuple(
        QueueStatus(m, p, n) for (m, p), n in sorted(held.items(), key=lambda i: (i[0][0], -i[0][1]))
    )


def _weighted(pairs: Sequence[tuple[float | None, int]]) -> float | None:
    present = [(v, n) for v, n in pairs if v is not None and n > 0]
    total = sum(n for _, n in present)
    return sum(v * n for v, n in present) / total if total else None


def _drift(views: Sequence[tuple[str, Status]]) -> tuple[DriftStatus, ...]:
    grouped = _by([(s, v.drift) for s, v in views], lambda d: (d.model, d.endpoint, d.source))
    out = []
    for (model, endpoint, source), seen in sorted(grouped.items()):
        ds = [d for _, d in seen]
        tripped = any(d.tripped for d in ds)
        if source == COUNTERS:  # each view's own routed requests: they add up
            samples, observed = sum(d.samples for d in ds), sum(d.observed for d in ds)
            ratio = _weighted([(d.ratio, d.samples) for d in ds])
            error = _weighted([(d.error, d.samples) for d in ds])
        else:  # every view heard the same completions: the fullest window, not their sum
            widest = max(ds, key=lambda d: (d.samples, d.observed))
            samples, ratio, error = widest.samples, widest.ratio, widest.error
            observed = max(d.observed for d in ds)
        out.append(
            DriftStatus(
                model=model,
                endpoint=endpoint,
                samples=samples,
                ratio=ratio,
                error=error,
                tripped=tripped,
                observed=observed,
                source=source,
            )
        )
    return tuple(out)
