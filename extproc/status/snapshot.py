"""What ``kvgate status`` and the gateway's status page show, taken from the live objects in one go.

Pure: :func:`snapshot` reads the fleet, the prefix index, flow control's queues, the policy store and the
feeds' views at a ``now`` (monotonic seconds, the clock of ejections and routed shares) and a ``wall``
(seconds since the epoch, shown as the snapshot's time), and returns frozen data; :func:`encode` and
:func:`decode` are its JSON form (``GET /status.json``). Nothing here holds a prompt, a token or a
credential: endpoint ids and addresses, counts, the policy's values and feed addresses only (an
endpoint's ``metrics_url`` and ``slot_restore`` URL are left out).

Per endpoint:

    state         "ready" (routable), else the first of "unhealthy", "draining", "ejected"
    load          the scheduler's estimate of requests at the engine (EndpointState.load)
    running, waiting, kv_usage   the last reading (scrape or the agent's Load; null when none or stale)
    routed_share  recent_routed(now) / sum over the fleet (0 when nothing was routed lately)
    routed_recent recent_routed(now) itself (what several workers' shares are combined from)
    index_blocks  blocks the prefix index holds for it (HybridIndex.occupancy)

Per model and endpoint the drift alarm has heard of (extproc/drift/README.md): the window's sample
count, ratio (engine-reused / predicted cached tokens) and error, and whether its alarm is tripped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from extproc.control.feeds import FeedView
from extproc.control.policy import PolicyStore
from extproc.drift.monitor import DriftView
from extproc.fleet import EndpointState, Fleet
from extproc.flow.control import FlowControl
from extproc.index.hybrid import HybridIndex

#: The JSON document's version; a reader refuses another.
SCHEMA = 1


class StatusError(ValueError):
    """A status document that is not JSON of :data:`SCHEMA`'s shape; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class EndpointStatus:
    """One endpoint (module docstring: the meaning of each figure). ``ejected_for_s``: seconds until a
    failed try's ejection ends (0: not ejected); ``in_flight``: this gateway's open streams there;
    ``outstanding``: its requests there whose completion it has not heard; ``precise``: the index
    follows the engine's KV events (else it learns from routing decisions)."""

    id: str
    address: str
    models: tuple[str, ...]
    role: str
    engine: str
    node: str | None
    state: str
    healthy: bool
    draining: bool
    ejected_for_s: float
    load: float
    running: float | None
    waiting: float | None
    kv_usage: float | None
    in_flight: int
    outstanding: int
    routed_share: float
    index_blocks: int
    precise: bool
    routed_recent: float = 0.0


@dataclass(frozen=True, slots=True)
class FeedStatus:
    """One agent's or kvcached's index-event feed (:class:`~extproc.control.feeds.FeedView`)."""

    address: str
    connected: bool
    endpoints: tuple[str, ...]
    age_s: float | None
    staleness_s: float | None
    last_error: str


@dataclass(frozen=True, slots=True)
class IndexStatus:
    """The prefix index: ``mode`` (``precise``: engine KV events followed where fed; ``approximate``),
    ``blocks`` held over every endpoint and node store, ``stores``: blocks per node store (a node's
    kvcached) and node tier (``ram``, ``ssd``), and the feeds."""

    mode: str
    blocks: int
    stores: dict[str, dict[str, int]]
    feeds: tuple[FeedStatus, ...]


@dataclass(frozen=True, slots=True)
class PolicyStatus:
    """The policy in force: every path's effective value (what ``kvgate policy list`` prints),
    the paths overridden (etcd or the policy file) and the values refused (path -> reason)."""

    values: dict[str, Any]
    overridden: tuple[str, ...]
    rejected: dict[str, str]


@dataclass(frozen=True, slots=True)
class QueueStatus:
    """Requests flow control holds for ``model`` in the band of ``priority``."""

    model: str
    priority: int
    queued: int


@dataclass(frozen=True, slots=True)
class DriftStatus:
    """The drift alarm of one (model, endpoint) (:class:`~extproc.drift.monitor.DriftView`)."""

    model: str
    endpoint: str
    samples: int
    ratio: float | None
    error: float | None
    tripped: bool
    #: Requests compared since start (with a prediction or not).
    observed: int = 0
    #: Where the engine's number came from: ``responses`` (each answer's cached tokens) or ``counters``
    #: (the engine's prefix-cache counters, :mod:`extproc.drift.counters`).
    source: str = "responses"


@dataclass(frozen=True, slots=True)
class Status:
    """One gateway's view, at ``at`` (wall seconds since the epoch)."""

    at: float
    models: tuple[str, ...]
    endpoints: tuple[EndpointStatus, ...]
    index: IndexStatus
    policy: PolicyStatus
    queues: tuple[QueueStatus, ...] = ()
    schema: int = SCHEMA
    #: Requests held over every model and band.
    queued: int = field(default=0)
    #: The drift alarm per (model, endpoint), sorted.
    drift: tuple[DriftStatus, ...] = ()


def endpoint_state(state: EndpointState, now: float) -> str:
    """``ready`` when routable, else why not: ``unhealthy``, ``draining`` or ``ejected`` (in that order)."""
    if not state.healthy:
        return "unhealthy"
    if state.draining:
        return "draining"
    if state.ejected(now):
        return "ejected"
    return "ready"


def snapshot(
    fleet: Fleet,
    index: HybridIndex,
    flow: FlowControl[Any],
    policy: PolicyStore,
    feeds: Sequence[FeedView],
    now: float,
    wall: float,
    drift: Sequence[DriftView] = (),
) -> Status:
    """The status of one gateway at ``now`` (monotonic seconds) and ``wall`` (seconds since the epoch);
    ``drift``: the drift alarm's views."""
    states = sorted(fleet, key=lambda s: s.id)
    occupancy = {str(k): v for k, v in index.occupancy().items()}
    recent = {s.id: s.recent_routed(now) for s in states}
    total_recent = sum(recent.values())
    endpoints = tuple(_endpoint(s, now, recent[s.id], total_recent, occupancy, index) for s in states)
    ids = {e.id for e in endpoints}
    stores = {str(k): dict(sorted(v.items())) for k, v in sorted(index.node_occupancy().items())}
    depth = flow.queues.depth()
    queues = tuple(
        QueueStatus(m, p, n) for (m, p), n in sorted(depth.items(), key=lambda i: (i[0][0], -i[0][1]))
    )
    overrides = policy.overrides
    return Status(
        at=wall,
        models=tuple(fleet.models()),
        endpoints=endpoints,
        index=IndexStatus(
            mode="precise" if index.events else "approximate",
            blocks=sum(occupancy.get(i, 0) for i in ids) + sum(sum(t.values()) for t in stores.values()),
            stores=stores,
            feeds=tuple(
                FeedStatus(f.address, f.connected, f.endpoints, f.age_s, f.staleness_s, f.last_error)
                for f in feeds
            ),
        ),
        policy=PolicyStatus(
            values=policy.effective(),
            overridden=tuple(sorted(overrides)),
            rejected=dict(sorted(policy.rejected.items())),
        ),
        queues=queues,
        queued=sum(q.queued for q in queues),
        drift=tuple(  # sorted: model, endpoint, source
            DriftStatus(d.model, d.endpoint, d.samples, d.ratio, d.error, d.tripped, d.observed, d.source)
            for d in sorted(drift, key=lambda d: (d.model, d.endpoint, d.source))
        ),
    )


def _endpoint(
    state: EndpointState,
    now: float,
    recent: float,
    total_recent: float,
    occupancy: dict[str, int],
    index: HybridIndex,
) -> EndpointStatus:
    ep, metrics = state.endpoint, state.metrics
    return EndpointStatus(
        id=str(ep.id),
        address=ep.address,
        models=tuple(sorted(ep.models)),
        role=ep.role,
        engine=ep.engine,
        node=ep.node,
        state=endpoint_state(state, now),
        healthy=state.healthy,
        draining=state.draining,
        ejected_for_s=max(0.0, state.ejected_until - now) if state.ejected(now) else 0.0,
        load=state.load,
        running=None if metrics is None else metrics.running,
        waiting=None if metrics is None else metrics.waiting,
        kv_usage=None if metrics is None else metrics.kv_usage,
        in_flight=state.in_flight,
        outstanding=state.outstanding,
        routed_share=recent / total_recent if total_recent > 0 else 0.0,
        index_blocks=occupancy.get(str(ep.id), 0),
        precise=index.is_precise(ep.id),
        routed_recent=recent,
    )


def encode(status: Status) -> bytes:
    """The JSON document served at ``/status.json``."""
    return msgspec.json.encode(status)


def decode(raw: bytes) -> Status:
    """A document of :func:`encode` (unknown keys ignored, so a newer gateway's extra figures are
    skipped); :class:`StatusError` when it is not one, or of another :data:`SCHEMA`."""
    try:
        status = msgspec.json.decode(raw, type=Status)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StatusError(f"not a kvgate status document: {exc}") from exc
    if status.schema != SCHEMA:
        raise StatusError(f"status document schema {status.schema}, this kvgate reads {SCHEMA}")
    return status
