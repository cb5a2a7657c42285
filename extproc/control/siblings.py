"""Sibling workers: the ext_proc processes of one host share in-flight counts and routing decisions.

``[extproc] workers = N`` runs N ext_procs behind Envoy's one ext_proc cluster (Envoy balances per
stream), each following the same feeds and etcd. What each one learns only from its own streams is
shared here, so every worker schedules on what the whole host routed:

- **learned**: the endpoint and the chained digests a worker recorded for a decision (what
  :meth:`~extproc.routing.router.Router.commit` records); the others record the same, so their
  approximate (and speculative precise) index and working set learn what the sibling routed;
- **loads**: the sender's ABSOLUTE ``in_flight`` and net routed count
  (:attr:`~extproc.fleet.EndpointState.net_routed`: routed minus completed since its last scrape, possibly
  negative) per endpoint (all of them: an endpoint left out is 0), sent when they change (coalesced, at
  most every :data:`COALESCE_S`) and as a heartbeat every :data:`HEARTBEAT_S`; the receiver keeps them
  per sibling, forgets a sibling silent for :data:`EXPIRE_S`, and writes the sums into
  ``EndpointState.sibling_in_flight`` / ``sibling_routed``, which
  :attr:`~extproc.fleet.EndpointState.load` adds (every load-aware filter and scorer sees them), then
  kicks flow control's dispatcher (a sibling's slot may have freed);
- **queued tops**: with the loads, per model with requests queued in the sender's flow control, the
  highest priority queued (:meth:`~extproc.flow.dispatch.Dispatcher.queued_tops`; a model left out has
  nothing queued there), sent when it changes (coalesced with the loads) and with every heartbeat. The
  receiver's flow control holds a request of priority ``p`` back while a sibling reports more than ``p``
  queued for its model (strict priority across the host's workers), trusting a report for at most
  ``EXPIRE_S`` after it was heard (a silent sibling holds nothing back for longer); a report whose top
  fell or left, or a sibling that expires, runs a dispatch pass;
- **usage** (only when the gateway has no etcd, which otherwise carries it: ``usage/<tenant>/<replica>``):
  the tokens the sender's own requests charged each tenant's budget since it started (absolute counters,
  :attr:`~extproc.admission.budget.TokenBudgets.charged`), with the sender's start time, when they change
  (coalesced) and with every heartbeat. The receiver hands each counter to its usage ledger
  (:class:`~extproc.admission.shared.UsageLedger`) as the replica ``<sender>@<start>``, which charges its
  own bucket of that tenant with the change since last seen: every worker's budget sees the whole host's
  spending. Every heartbeat carries the counters, an empty message when there are none yet. The first
  message heard from a sibling that started before the receiver is a baseline (its counters hold
  spending from before the receiver existed, charged nothing; spending between the receiver's start and
  that message, at most a heartbeat, is not charged); every later change, a tenant it names later, and
  everything of a sibling that started after the receiver are charged; a restarted worker is a new
  replica (a new start), so its counter starting again from 0 is no refund.
- **prefill work** (with P/D, :mod:`extproc.disagg`): the sender's ABSOLUTE queued prefill tokens per
  prefill endpoint (:meth:`~extproc.disagg.plan.Disaggregator.queued`: the uncached prompt tokens of its
  prefill sub-requests still running there; an endpoint left out has none), sent with the loads when
  they changed since the last send and with every heartbeat. The receiver keeps them per sibling,
  forgets them with the sibling's loads, and writes the sums into the disaggregator's
  ``sibling_queued``, which its least-work prefill pick adds to its own (extproc/disagg/README.md, "The
  pair"): two workers no longer both pick the idle prefill replica for two long prompts.
- **cascade verdicts** (with a cascade's ``preroute``, :mod:`extproc.cascade.prior`): each gate verdict on a
  first step the sender's learner took (the virtual model, escalated or not, the request's hashed
  features), coalesced like the decisions. The receiver's learner for that virtual model takes it too
  (a model it has no learner for is skipped), so the workers learn which requests escalate from every
  verdict of the host, as one worker would, instead of each from its share.

Transport: every worker binds a Unix datagram socket ``DIR/<worker>.sock`` (``[extproc] siblings_dir``,
mode 0700: only this user can send) and sends to every other ``*.sock`` there, re-listed each heartbeat.
Sending never blocks and never fails a request: a full receiver queue drops the datagram (loads are
absolute, so the next one repairs it; a dropped decision is one the sibling does not learn), a sibling
that went away is skipped until it binds again. Workers on other hosts share only through feeds and etcd.

Wire format (pure, :func:`encode_learned` / :func:`encode_loads` / :func:`encode_usage` /
:func:`encode_prefill` / :func:`encode_verdicts` / :func:`decode`): a header ``magic "KVS2", kind (1
learned, 2 loads, 3 usage, 4 prefill, 5 verdicts), sender length`` and the sender's name; learned: records
of ``endpoint length, digest count, endpoint, 16-byte digests``; loads: a flag byte (1: the first datagram
of a snapshot, which replaces the sender's counts and queued tops), a count of queued tops (0 after the
first datagram) and that many ``model length, priority (signed), model``, then entries ``endpoint length,
in_flight, net routed (signed), endpoint``; usage: the sender's start (nanoseconds since the epoch, 64
bits), then entries ``tenant length, counter (signed 64 bits), tenant``; prefill: a flag byte (1: the
first datagram of a snapshot, which replaces the sender's), then entries ``endpoint length, tokens
(unsigned 32 bits), endpoint``; verdicts: records of ``model length, escalated (0 or 1), feature count,
model, features (unsigned 32 bits each)``. Integers are network order. No JSON: a record is a few
``struct`` packs and a join. ``KVS2`` added the queued tops; a ``KVS1`` worker and a ``KVS2`` one drop
each other's datagrams (so share nothing) until both run the same version; a worker built before kind 3
(or 4, 5) drops those datagrams alone (and so does not see that sender's prefill work, or learns from its
own cascade verdicts only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from contracts.digest import DIGEST_BYTES, Digest
from contracts.errors import ConfigError
from contracts.events import EndpointId
from extproc.fleet import Fleet
from extproc.routing.router import Router

log = logging.getLogger(__name__)

MAGIC = b"KVS2"
LEARNED, LOADS, USAGE, PREFILL, VERDICTS = 1, 2, 3, 4, 5
#: Largest datagram sent (bytes): far below Linux's Unix datagram limit (the socket's send buffer).
MAX_DATAGRAM = 60_000
#: Changed loads and new records wait this long (s) to share one send per sibling.
COALESCE_S = 0.005
#: A worker sends its loads at least this often (s): its heartbeat; the directory is re-listed as often.
HEARTBEAT_S = 1.0
#: A sibling not heard from this long (s) is gone: its counts stop counting.
EXPIRE_S = 3.0
#: Datagrams read per wake-up of the event loop, at most (the rest on the next turn).
READ_BATCH = 256
#: Worker names: one path component, short enough for a socket path.
WORKER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SUFFIX = ".sock"
_UNIX_PATH_MAX = 108  # sun_path, with its NUL
_MAX_COUNT = 2**32 - 1
_MIN_NET, _MAX_NET = -(2**31), 2**31 - 1

_HEAD = struct.Struct("!4sBB")
_RECORD = struct.Struct("!HH")
_FLAGS = struct.Struct("!B")
_ENTRY = struct.Struct("!HIi")
_TOPS = struct.Struct("!H")
_TOP = struct.Struct("!Hi")
_STARTED = struct.Struct("!Q")
_COUNTER = struct.Struct("!Hq")
_TOKENS = struct.Struct("!HI")
_VERDICT = struct.Struct("!HBH")
_FEATURE = struct.Struct("!I")
_MIN_COUNTER, _MAX_COUNTER = -(2**63), 2**63 - 1


class MessageError(ValueError):
    """A datagram that is not a sibling message of this version (dropped by the receiver)."""


@dataclass(frozen=True, slots=True)
class Learned:
    """Decisions a sibling recorded: ``(endpoint, digests)`` each."""

    sender: str
    records: list[tuple[EndpointId, list[Digest]]]


@dataclass(frozen=True, slots=True)
class Loads:
    """A sibling's counts per endpoint, ``(in_flight, net routed)``; ``replace``: the first
    datagram of a snapshot (counts of endpoints absent from the snapshot are 0), the only one with
    ``tops``: the sender's highest queued priority per model (models absent: nothing queued)."""

    sender: str
    replace: bool
    counts: dict[EndpointId, tuple[int, int]]
    tops: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Usage:
    """A sibling's token counters per tenant (tokens its own requests charged each budget since it
    started) and its start (nanoseconds since the epoch: which process of that worker name)."""

    sender: str
    started_ns: int
    counters: dict[str, int]


@dataclass(frozen=True, slots=True)
class Prefill:
    """A sibling's queued prefill tokens per endpoint; ``replace``: the first datagram of a snapshot
    (endpoints absent from the snapshot have none)."""

    sender: str
    replace: bool
    tokens: dict[EndpointId, int]


@dataclass(frozen=True, slots=True)
class Verdicts:
    """Cascade gate verdicts a sibling's learners took: ``(virtual model, escalated, features)`` each."""

    sender: str
    records: list[tuple[str, bool, tuple[int, ...]]]


class SiblingCascade(Protocol):
    """What the bus needs of the cascades (:class:`~extproc.cascade.plan.Cascader`): a hook it sets to
    hear this worker's verdicts, and the entry for the siblings'."""

    on_verdict: Callable[[str, tuple[int, ...], bool], None] | None

    def heard(self, model: str, features: tuple[int, ...], escalated: bool) -> None: ...


class SiblingPrefill(Protocol):
    """This worker's P/D planner as the bus sees it (:class:`~extproc.disagg.plan.Disaggregator`): its
    own queued prefill tokens to send, and where the siblings' sums go."""

    sibling_queued: Mapping[EndpointId, int]

    def queued(self) -> dict[EndpointId, int]: ...


class SiblingUsage(Protocol):
    """This worker's token-budget ledger as the bus sees it (:class:`~extproc.admission.shared.UsageLedger`):
    its own counters to send, the siblings' to charge."""

    def counters(self) -> Mapping[str, int]: ...

    def observe(
        self, tenant_id: str, replica: str, value: bytes | None, *, backlog: bool, now: float
    ) -> int: ...


class SiblingFlow(Protocol):
    """This worker's flow-control shell as the bus sees it (:class:`~extproc.flow.dispatch.Dispatcher`):
    the bus sets :attr:`on_tops` to send when the queued tops change, reads :meth:`queued_tops`, hands
    over the siblings' reports and kicks a dispatch pass when their counts changed."""

    on_tops: Callable[[], None] | None

    def queued_tops(self) -> dict[str, int]: ...

    def sibling_heard(self, sender: str, tops: Mapping[str, int], until: float) -> None: ...

    def sibling_gone(self, sender: str) -> None: ...

    def kick(self) -> None: ...


def _header(kind: int, sender: str) -> bytes:
    name = sender.encode()
    return _HEAD.pack(MAGIC, kind, len(name)) + name


def encode_learned(
    sender: str, records: Iterable[tuple[EndpointId, Sequence[Digest]]], limit: int = MAX_DATAGRAM
) -> list[bytes]:
    """Datagrams of at most ``limit`` bytes carrying ``records``; a record longer than one datagram keeps
    its leading digests (a chain's prefix is itself a valid record)."""
    head = _header(LEARNED, sender)

    def packed() -> Iterator[bytes]:
        for endpoint, digests in records:
            eid = endpoint.encode()
            room = (limit - len(head) - _RECORD.size - len(eid)) // DIGEST_BYTES
            kept = digests[: max(0, room)]
            yield _RECORD.pack(len(eid), len(kept)) + eid + b"".join(kept)

    return _datagrams(head, packed(), limit)


def _datagrams(head: bytes, records: Iterable[bytes], limit: int) -> list[bytes]:
    """``records`` joined behind ``head`` into datagrams of at most ``limit`` bytes (a record longer than
    that goes alone)."""
    out: list[bytes] = []
    parts: list[bytes] = [head]
    size = len(head)
    for record in records:
        if size + len(record) > limit and len(parts) > 1:
            out.append(b"".join(parts))
            parts, size = [head], len(head)
        parts.append(record)
        size += len(record)
    if len(parts) > 1:
        out.append(b"".join(parts))
    return out


def encode_loads(
    sender: str,
    counts: Mapping[EndpointId, tuple[int, int]],
    limit: int = MAX_DATAGRAM,
    tops: Mapping[str, int] | None = None,
) -> list[bytes]:
    """A snapshot of ``counts`` and queued ``tops`` in datagrams of at most ``limit`` bytes (at least one,
    the first flagged to replace the sender's counts and tops, and the only one carrying tops; an empty
    snapshot says every count is 0 and nothing is queued). Tops that do not fit in the first datagram
    are left out (the siblings then hold nothing back for those models); priorities are clamped to 32
    bits."""
    head = _header(LOADS, sender)
    empty = len(head) + _FLAGS.size + _TOPS.size  # a datagram without tops or entries
    top_entries: list[bytes] = []
    size = empty
    for model, priority in (tops or {}).items():
        name = model.encode()
        entry = _TOP.pack(len(name), min(max(priority, _MIN_NET), _MAX_NET)) + name
        if size + len(entry) <= limit:
            top_entries.append(entry)
            size += len(entry)
    out: list[bytes] = []
    parts: list[bytes] = []
    for endpoint, (in_flight, routed) in counts.items():
        eid = endpoint.encode()
        net = min(max(routed, _MIN_NET), _MAX_NET)
        entry = _ENTRY.pack(len(eid), min(in_flight, _MAX_COUNT), net) + eid
        if size + len(entry) > limit and parts:
            out.append(_loads_datagram(head, top_entries if not out else [], parts, first=not out))
            parts, size = [], empty
        parts.append(entry)
        size += len(entry)
    if parts or not out:
        out.append(_loads_datagram(head, top_entries if not out else [], parts, first=not out))
    return out


def encode_usage(
    sender: str, started_ns: int, counters: Mapping[str, int], limit: int = MAX_DATAGRAM
) -> list[bytes]:
    """``counters`` (tenant id -> tokens) in datagrams of at most ``limit`` bytes, each carrying the
    sender's start (no counters: one datagram without entries, which says the sender has charged
    nothing yet). Counters are clamped to 64 bits."""
    head = _header(USAGE, sender) + _STARTED.pack(started_ns)
    out: list[bytes] = []
    parts: list[bytes] = []
    size = len(head)
    for tenant, counter in counters.items():
        name = tenant.encode()
        entry = _COUNTER.pack(len(name), min(max(counter, _MIN_COUNTER), _MAX_COUNTER)) + name
        if size + len(entry) > limit and parts:
            out.append(head + b"".join(parts))
            parts, size = [], len(head)
        parts.append(entry)
        size += len(entry)
    if parts or not out:
        out.append(head + b"".join(parts))
    return out


def encode_prefill(sender: str, tokens: Mapping[EndpointId, int], limit: int = MAX_DATAGRAM) -> list[bytes]:
    """A snapshot of queued prefill ``tokens`` per endpoint in datagrams of at most ``limit`` bytes (at
    least one, the first flagged to replace the sender's; an empty snapshot says none is queued).
    Counts are clamped to 32 bits."""
    head = _header(PREFILL, sender)
    out: list[bytes] = []
    parts: list[bytes] = []
    size = len(head) + _FLAGS.size
    for endpoint, count in tokens.items():
        eid = endpoint.encode()
        entry = _TOKENS.pack(len(eid), min(max(count, 0), _MAX_COUNT)) + eid
        if size + len(entry) > limit and parts:
            out.append(head + _FLAGS.pack(not out) + b"".join(parts))
            parts, size = [], len(head) + _FLAGS.size
        parts.append(entry)
        size += len(entry)
    if parts or not out:
        out.append(head + _FLAGS.pack(not out) + b"".join(parts))
    return out


def encode_verdicts(
    sender: str, records: Iterable[tuple[str, bool, Sequence[int]]], limit: int = MAX_DATAGRAM
) -> list[bytes]:
    """Datagrams of at most ``limit`` bytes carrying ``records`` (a request has at most ~65 features: a
    record is far below one datagram)."""

    def packed() -> Iterator[bytes]:
        for model, escalated, features in records:
            name = model.encode()
            yield _VERDICT.pack(len(name), escalated, len(features)) + name + _features(features)

    return _datagrams(_header(VERDICTS, sender), packed(), limit)


def _features(features: Sequence[int]) -> bytes:
    return struct.pack(f"!{len(features)}I", *features)


def _loads_datagram(head: bytes, tops: Sequence[bytes], entries: Sequence[bytes], *, first: bool) -> bytes:
    return head + _FLAGS.pack(first) + _TOPS.pack(len(tops)) + b"".join(tops) + b"".join(entries)


def decode(data: bytes) -> Learned | Loads | Usage | Prefill | Verdicts:
    """The message in ``data``; :class:`MessageError` for anything else (truncated, another version)."""
    try:
        magic, kind, name_len = _HEAD.unpack_from(data)
        if magic != MAGIC:
            raise MessageError("not a sibling message")
        at = _HEAD.size + name_len
        sender = data[_HEAD.size : at].decode()
        if kind == LEARNED:
            records: list[tuple[EndpointId, list[Digest]]] = []
            while at < len(data):
                eid_len, count = _RECORD.unpack_from(data, at)
                at += _RECORD.size
                endpoint = EndpointId(data[at : at + eid_len].decode())
                at += eid_len
                end = at + count * DIGEST_BYTES
                if end > len(data):
                    raise MessageError("truncated record")
                records.append(
                    (endpoint, [Digest(data[i : i + DIGEST_BYTES]) for i in range(at, end, DIGEST_BYTES)])
                )
                at = end
            return Learned(sender, records)
        if kind == LOADS:
            (flags,) = _FLAGS.unpack_from(data, at)
            at += _FLAGS.size
            (top_count,) = _TOPS.unpack_from(data, at)
            at += _TOPS.size
            tops: dict[str, int] = {}
            for _ in range(top_count):
                name_len, priority = _TOP.unpack_from(data, at)
                at += _TOP.size
                if at + name_len > len(data):
                    raise MessageError("truncated queued top")
                tops[data[at : at + name_len].decode()] = priority
                at += name_len
            counts = {
                EndpointId(name): (in_flight, routed)
                for name, (in_flight, routed) in _named(data, at, _ENTRY, "entry")
            }
            return Loads(sender, bool(flags & 1), counts, tops)
        if kind == USAGE:
            (started_ns,) = _STARTED.unpack_from(data, at)
            at += _STARTED.size
            counters = {name: counter for name, (counter,) in _named(data, at, _COUNTER, "usage entry")}
            return Usage(sender, started_ns, counters)
        if kind == PREFILL:
            (flags,) = _FLAGS.unpack_from(data, at)
            at += _FLAGS.size
            entries = _named(data, at, _TOKENS, "prefill entry")
            tokens = {EndpointId(name): count for name, (count,) in entries}
            return Prefill(sender, bool(flags & 1), tokens)
        if kind == VERDICTS:
            verdicts: list[tuple[str, bool, tuple[int, ...]]] = []
            while at < len(data):
                name_len, escalated, count = _VERDICT.unpack_from(data, at)
                at += _VERDICT.size
                model = data[at : at + name_len].decode()
                at += name_len
                end = at + count * _FEATURE.size
                if end > len(data) or escalated > 1:
                    raise MessageError("truncated or bad verdict")
                verdicts.append((model, bool(escalated), struct.unpack_from(f"!{count}I", data, at)))
                at = end
            return Verdicts(sender, verdicts)
    except (struct.error, UnicodeDecodeError) as exc:
        raise MessageError(f"malformed sibling message: {exc}") from exc
    raise MessageError(f"unknown message kind {kind}")


def _named(data: bytes, at: int, entry: struct.Struct, what: str) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """The entries from ``at`` to the end of ``data``: each ``entry`` (its first field the name's length,
    then the values) followed by the UTF-8 name; ``MessageError`` when a name runs past the end (the
    caller turns ``struct.error`` and ``UnicodeDecodeError`` into one too)."""
    while at < len(data):
        name_len, *values = entry.unpack_from(data, at)
        at += entry.size
        if at + name_len > len(data):
            raise MessageError(f"truncated {what}")
        yield data[at : at + name_len].decode(), tuple(values)
        at += name_len


def local_loads(fleet: Fleet) -> dict[EndpointId, tuple[int, int]]:
    """This worker's own ``(in_flight, net_routed)`` per endpoint, zeros left out."""
    return {s.id: (s.in_flight, s.net_routed) for s in fleet if s.in_flight or s.net_routed}


class SiblingLoads:
    """The siblings' counts per endpoint and when each sibling was last heard from (pure: ``now`` is
    given, monotonic seconds)."""

    def __init__(self, expire_s: float = EXPIRE_S) -> None:
        self.expire_s = expire_s
        self._counts: dict[str, dict[EndpointId, tuple[int, int]]] = {}
        self._prefill: dict[str, dict[EndpointId, int]] = {}
        self._heard: dict[str, float] = {}

    @property
    def senders(self) -> list[str]:
        """Siblings heard from within ``expire_s`` (as of the last :meth:`expire`), sorted."""
        return sorted(self._heard)

    def apply(self, message: Loads, now: float) -> bool:
        """Take ``message`` heard at ``now``; True when its sender is new (or back after expiring)."""
        new = message.sender not in self._heard
        self._heard[message.sender] = now
        if message.replace or new:
            self._counts[message.sender] = dict(message.counts)
        else:
            self._counts[message.sender].update(message.counts)
        return new

    def apply_prefill(self, message: Prefill, now: float) -> None:
        """Take a sibling's queued prefill tokens heard at ``now`` (a snapshot's first datagram replaces
        what it said before, a later one adds to it). Heard-from time is the loads' (sent together):
        prefill work alone does not keep a sibling alive."""
        if message.replace or message.sender not in self._prefill:
            self._prefill[message.sender] = dict(message.tokens)
        else:
            self._prefill[message.sender].update(message.tokens)
        self._heard.setdefault(message.sender, now)
        self._counts.setdefault(message.sender, {})

    def expire(self, now: float) -> list[str]:
        """Forget siblings silent for more than ``expire_s``; their names."""
        gone = [s for s, at in self._heard.items() if now - at > self.expire_s]
        for sender in gone:
            del self._heard[sender], self._counts[sender]
            self._prefill.pop(sender, None)
        return gone

    def prefill_totals(self) -> dict[EndpointId, int]:
        """Per endpoint, the siblings' queued prefill tokens summed (endpoints with none left out)."""
        out: dict[EndpointId, int] = {}
        for tokens in self._prefill.values():
            for endpoint, count in tokens.items():
                if count:
                    out[endpoint] = out.get(endpoint, 0) + count
        return out

    def totals(self) -> dict[EndpointId, tuple[int, int]]:
        """Per endpoint, the siblings' ``(in_flight, net routed)`` summed."""
        out: dict[EndpointId, tuple[int, int]] = {}
        for counts in self._counts.values():
            for endpoint, (in_flight, routed) in counts.items():
                have = out.get(endpoint, (0, 0))
                out[endpoint] = (have[0] + in_flight, have[1] + routed)
        return out

    def write(self, fleet: Fleet) -> None:
        """Set every endpoint's ``sibling_in_flight`` and ``sibling_routed`` to the sums (0 if none)."""
        totals = self.totals()
        for state in fleet:
            state.sibling_in_flight, state.sibling_routed = totals.get(state.id, (0, 0))


class SiblingBus:
    """This worker's socket in the siblings directory: the router's listener on the sending side, the
    index, working set and fleet's writer on the receiving side; with ``flow``, also the sender of this
    worker's queued tops and the receiver of the siblings' (see the module docstring). :meth:`start` and
    :meth:`aclose` run on the event loop, as do the listener calls
    (:class:`~extproc.routing.router.RoutingListener`). ``clock`` must be ``flow``'s clock too (a
    report's trust ends at ``clock() + expire_s``)."""

    def __init__(
        self,
        directory: Path,
        name: str,
        router: Router,
        *,
        flow: SiblingFlow | None = None,
        usage: SiblingUsage | None = None,
        prefill: SiblingPrefill | None = None,
        cascade: SiblingCascade | None = None,
        clock: Callable[[], float] = time.monotonic,
        coalesce_s: float = COALESCE_S,
        heartbeat_s: float = HEARTBEAT_S,
        expire_s: float = EXPIRE_S,
    ) -> None:
        if not WORKER_NAME.fullmatch(name):
            raise ConfigError(f"worker name {name!r}: letters, digits, '.', '_', '-' (at most 64)")
        self.directory, self.name = directory, name
        self.path = directory / f"{name}{SUFFIX}"
        if len(os.fsencode(self.path)) >= _UNIX_PATH_MAX:
            raise ConfigError(f"extproc.siblings_dir: {directory} is too long for a Unix socket path")
        self._router = router
        self._flow = flow
        self._usage = usage
        self._usage_sent: dict[str, int] = {}
        self._usage_beat = True
        self._usage_known: set[str] = set()  # sibling replicas (name@start) heard from
        self._prefill = prefill
        self._prefill_sent: dict[EndpointId, int] = {}
        self._cascade = cascade
        self._verdicts: list[tuple[str, bool, tuple[int, ...]]] = []
        #: This process's start (ns since the epoch): siblings tell its usage counters from a restarted
        #: worker's of the same name by it.
        self.started_ns = time.time_ns()
        self._clock = clock
        self._coalesce_s, self._heartbeat_s = coalesce_s, heartbeat_s
        self.loads = SiblingLoads(expire_s)
        self._peers: list[str] = []
        self._learned: list[tuple[EndpointId, Sequence[Digest]]] = []
        self._loads_changed = False
        self._flush_handle: asyncio.TimerHandle | None = None
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        #: Datagrams not sent because a sibling's queue was full (drops are never retried).
        self.dropped = 0

    def start(self) -> None:
        """Make the directory (0700; one that others may enter is refused), bind ``<name>.sock``
        (replacing this worker's earlier socket), listen, and start the heartbeat."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.directory.stat().st_mode & 0o077:
            raise ConfigError(f"extproc.siblings_dir: {self.directory} must be mode 0700 (this user's only)")
        self.path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.bind(str(self.path))
        self._sock = sock
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.fileno(), self._readable)
        self._router.listener = self
        if self._flow is not None:
            self._flow.on_tops = self.queue_changed
        if self._cascade is not None:
            self._cascade.on_verdict = self.verdict
        self._rescan()
        self._task = loop.create_task(self._beat())
        log.info("sibling worker %s listening at %s", self.name, self.path)

    async def aclose(self) -> None:
        """Stop listening and sending; remove the socket (the siblings forget this worker's counts
        within ``expire_s``)."""
        if self._router.listener is self:
            self._router.listener = None
        if self._flow is not None and self._flow.on_tops == self.queue_changed:
            self._flow.on_tops = None
        if self._cascade is not None and self._cascade.on_verdict == self.verdict:
            self._cascade.on_verdict = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            self.path.unlink(missing_ok=True)

    # -- the router's listener ---------------------------------------------------------------------

    def recorded(self, endpoint: EndpointId, digests: Sequence[Digest], now: float) -> None:
        """Queue the record for the siblings (sent within ``coalesce_s`` with the changed loads)."""
        if self._peers:
            self._learned.append((endpoint, digests))
        self.released(endpoint)

    def released(self, endpoint: EndpointId) -> None:
        """Loads changed: send them within ``coalesce_s``."""
        self.queue_changed()

    def queue_changed(self) -> None:
        """The loads or the queued tops changed: send both within ``coalesce_s``."""
        self._loads_changed = True
        self._soon()

    def verdict(self, model: str, features: tuple[int, ...], escalated: bool) -> None:
        """A cascade's learner took a gate verdict: send it to the siblings within ``coalesce_s``."""
        if self._peers:
            self._verdicts.append((model, escalated, features))
            self._soon()

    def _soon(self) -> None:
        if self._flush_handle is None and self._sock is not None:
            self._flush_handle = asyncio.get_running_loop().call_later(self._coalesce_s, self._flush)

    # -- sending ---------------------------------------------------------------------------------------

    def _flush(self) -> None:
        self._flush_handle = None
        learned, self._learned = self._learned, []
        verdicts, self._verdicts = self._verdicts, []
        datagrams = encode_learned(self.name, learned) if learned else []
        if verdicts:
            datagrams += encode_verdicts(self.name, verdicts)
        if self._loads_changed:
            self._loads_changed = False
            tops = self._flow.queued_tops() if self._flow is not None else None
            datagrams += encode_loads(self.name, local_loads(self._router.fleet), tops=tops)
            datagrams += self._prefill_due(force=self._usage_beat)
        datagrams += self._usage_due(force=self._usage_beat)
        self._usage_beat = False
        self._send(datagrams)

    def _prefill_due(self, *, force: bool) -> list[bytes]:
        """The queued prefill tokens to send: when they changed since the last send (plans and releases
        change the loads too, so they are looked at with them), and with every heartbeat."""
        if self._prefill is None:
            return []
        tokens = self._prefill.queued()
        if tokens == self._prefill_sent and not force:
            return []
        self._prefill_sent = tokens
        return encode_prefill(self.name, tokens)

    def _usage_due(self, *, force: bool) -> list[bytes]:
        """The usage datagrams to send: all counters when one changed since the last send (sent with the
        loads, which change with every routed and completed request; and with every heartbeat); none
        without a ledger or counters."""
        if self._usage is None:
            return []
        counters = dict(self._usage.counters())
        if counters == self._usage_sent and not force:
            return []
        self._usage_sent = counters
        return encode_usage(self.name, self.started_ns, counters)

    def _send(self, datagrams: Sequence[bytes]) -> None:
        sock = self._sock
        if sock is None or not datagrams:
            return
        for peer in list(self._peers):
            for data in datagrams:
                try:
                    sock.sendto(data, peer)
                except BlockingIOError:
                    self.dropped += 1  # its queue is full: it catches up with the next loads
                except (ConnectionRefusedError, FileNotFoundError):
                    self._peers.remove(peer)  # gone: listed again when it binds again
                    break
                except OSError as exc:
                    log.debug("sibling %s: send failed: %s", peer, exc)
                    break

    def _rescan(self) -> None:
        try:
            names = sorted(os.listdir(self.directory))
        except OSError as exc:
            log.warning("siblings directory %s: %s", self.directory, exc)
            return
        own = self.path.name
        self._peers = [str(self.directory / n) for n in names if n.endswith(SUFFIX) and n != own]

    async def _beat(self) -> None:
        """Every ``heartbeat_s``: re-list the directory, forget silent siblings, send the loads."""
        while True:
            await asyncio.sleep(self._heartbeat_s)
            self._rescan()
            gone = self.loads.expire(self._clock())
            for sender in gone:
                log.info("sibling worker %s: %s is gone", self.name, sender)
                if self._flow is not None:
                    self._flow.sibling_gone(sender)
            if gone:
                self.loads.write(self._router.fleet)
                self._write_prefill()
            self._loads_changed = True
            self._usage_beat = True  # the heartbeat repeats the counters (a dropped datagram heals)
            if self._flush_handle is None:
                self._flush()

    # -- receiving -------------------------------------------------------------------------------------

    def _readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        loads_changed = prefill_changed = False
        reports: list[tuple[str, dict[str, int], float]] = []
        for _ in range(READ_BATCH):
            try:
                data = sock.recv(MAX_DATAGRAM + 1)
            except (BlockingIOError, InterruptedError):
                break
            try:
                message = decode(data)
            except MessageError as exc:
                log.debug("sibling worker %s: dropped a datagram: %s", self.name, exc)
                continue
            if message.sender == self.name:
                continue
            if isinstance(message, Learned):
                self.learn(message, self._clock())
            elif isinstance(message, Usage):
                self.charge(message, self._clock())
            elif isinstance(message, Prefill):
                self.loads.apply_prefill(message, self._clock())
                prefill_changed = True
            elif isinstance(message, Verdicts):
                if self._cascade is not None:
                    for model, escalated, features in message.records:
                        self._cascade.heard(model, features, escalated)
            else:
                now = self._clock()
                if self.loads.apply(message, now):
                    log.info("sibling worker %s: heard from %s", self.name, message.sender)
                loads_changed = True
                if message.replace:
                    reports.append((message.sender, message.tops, now + self.loads.expire_s))
        if prefill_changed:
            self._write_prefill()
        if loads_changed:
            self.loads.write(self._router.fleet)
            if self._flow is not None:
                for sender, tops, until in reports:
                    self._flow.sibling_heard(sender, tops, until)
                self._flow.kick()  # a sibling's counts fell: a held request may fit now

    def _write_prefill(self) -> None:
        if self._prefill is not None:
            self._prefill.sibling_queued = self.loads.prefill_totals()

    def charge(self, message: Usage, now: float) -> None:
        """Hand a sibling's token counters to this worker's ledger (the module docstring: the counters of
        a sibling that started before this worker are a baseline in the first message heard from it; a
        tenant it names later, or any counter of a sibling that started after, is charged in full)."""
        if self._usage is None:
            return
        replica = f"{message.sender}@{message.started_ns}"
        baseline = replica not in self._usage_known and message.started_ns < self.started_ns
        self._usage_known.add(replica)
        for tenant, counter in message.counters.items():
            self._usage.observe(tenant, replica, str(counter).encode(), backlog=baseline, now=now)

    def usage_heard(self, sender: str) -> bool:
        """Whether a usage message of sibling ``sender`` (any start) has been heard."""
        return any(r.split("@", 1)[0] == sender for r in self._usage_known)

    def learn(self, message: Learned, now: float) -> None:
        """Record a sibling's decisions in this worker's index and working set (endpoints this worker
        does not know are skipped: its fleet catches up from the same etcd and config)."""
        router = self._router
        for endpoint, digests in message.records:
            if digests and router.fleet.get(endpoint) is not None:
                router.index.record(endpoint, digests, now)
                if router.working_set is not None:
                    router.working_set.record(endpoint, digests, now)
