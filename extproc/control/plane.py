"""The control plane of one gateway: etcd's endpoints, drains, policy, routes and objectives -> its Fleet
and policy.

:class:`ControlCore` is sans-IO: it takes snapshots (every key under the prefix at a revision) and
batches of changes, and applies them to a :class:`~extproc.fleet.Fleet` and a
:class:`~extproc.control.policy.PolicyStore`:

* ``endpoints/<node>/<id>`` (and ``endpoints/<id>``, the layout of older agents): an id belongs to the
  node whose key claimed it first (etcd's create revision); another node's key for the same id is
  refused (logged once, counted in ``counters["claims_refused"]``) and takes over only once the keys
  claimed before it are gone (:meth:`ControlCore._endpoint_key`). The key that describes it is decoded
  under the version rule (:func:`engines.endpoint.decode_record`, :mod:`contracts.versions`: a record
  of a newer schema or another digest version joins without its KV data, logged once and counted in
  ``counters["version_skew"]``) and upserted, or removed on delete of the key that described it.
  Endpoints from the gateway's own config stay; an etcd entry with the id of one of them, or with the
  address of another endpoint, is refused with a log (unless that endpoint yields,
  :attr:`ControlCore.yields`: an InferencePool pod's endpoint gives its address up to the agent's
  record); one refused for its address is tried again whenever the fleet changes, and joins once the
  address is free. A value that does not decode is refused and the endpoint's last good description stays. One
  that :attr:`ControlCore.admits` refuses (an InferencePool's gateway: no ready pod of the pool has its
  address) is held out of the fleet until :meth:`ControlCore.readmit` finds it admitted.
* ``drain/<id>``: present = :attr:`EndpointState.draining` (also for static endpoints, and remembered
  for an endpoint that registers later).
* ``policy/<path>`` (``policy/flow/...`` included), ``models/<name>``, ``objectives/<name>``: after each
  batch or snapshot that changed one, etcd's whole set of policy values goes to the policy store at once
  (:meth:`~extproc.control.policy.PolicyStore.replace`: the same policy whatever order the values came
  in; a set that is not valid keeps the last good policy and is tried again at the next change);
  :func:`contracts.etcd.policy_path` maps keys to paths.
* ``audit/<family>/<name>``: the audit record of an operator's change (:mod:`contracts.audit`), logged
  as one line (identity, key, operation, revision; never a value) when it arrives live.
* any other family a :class:`FamilySink` was registered for (:meth:`ControlCore.follow`): handed to it,
  e.g. ``tenants/<id>`` and ``usage/<tenant>/<replica>`` (:mod:`extproc.control.usage`).

A value that raises anything while it is decoded or checked (a number too large for a float, JSON
nested too deep) is that key's refusal, logged without the value; the rest of the batch applies, and a
key counts as seen only once it was handled.

Changes are :class:`contracts.etcd.Change`. A snapshot is diffed against what was applied, so a resync
after an outage applies exactly what changed while the watcher was away. :class:`ControlPlane` is the
shell: it owns an etcd client and runs the core under :class:`runtime.watch.PrefixWatcher`, the loop
shared with kvcached's peer discovery (one range read, then a watch from the next revision, a liveness
probe beside it; on an outage the last known fleet and policy stay while it reconnects with capped
backoff and resyncs, also when the watch is compacted, without spinning on a watch etcd keeps
cancelling), and turns what each batch changed into the ``on_policy`` / ``on_fleet_change`` callbacks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import etcd3aio

from contracts import audit
from contracts.config import ip_port
from contracts.errors import ConfigError
from contracts.etcd import (
    DRAIN,
    ENDPOINTS,
    KVCACHED,
    Change,
    EtcdSettings,
    decode_peer,
    endpoint_id_of,
    peer_skew,
    policy_path,
    split_key,
)
from contracts.events import EndpointId
from contracts.versions import SkewLog
from engines.endpoint import Endpoint, decode_record
from extproc.control.policy import Policy, PolicyStore
from extproc.fleet import Fleet
from runtime.etcd import connect
from runtime.watch import PrefixWatcher

log = logging.getLogger(__name__)
audit_log = logging.getLogger("kvgate.audit")


@dataclass(frozen=True, slots=True)
class Applied:
    """What a batch changed: the fleet (membership, descriptions, drain flags) and/or the policy."""

    fleet_changed: bool = False
    policy: Policy | None = None


@dataclass(frozen=True, slots=True)
class _Claim:
    """One ``endpoints/`` key's claim of its endpoint id: ``owner``, the node of its key (of an
    ``endpoints/<id>`` key, the ``node`` its record names; ``None``: none); ``created``, its etcd create
    revision."""

    owner: str | None
    created: int
    value: bytes


def _owner(name: str, value: bytes) -> str | None:
    node, sep, _ = name.rpartition("/")
    if sep:
        return node
    try:
        node = json.loads(value).get("node")
    except (ValueError, AttributeError, RecursionError):
        return None
    return node if isinstance(node, str) else None


def _holder(claims: Mapping[str, _Claim]) -> str:
    """The key that describes an endpoint: its id belongs to the owner of the claim created first (ties:
    the first key name); of that owner's keys, ``endpoints/<node>/<id>`` before ``endpoints/<id>``."""
    first = min(claims, key=lambda name: (claims[name].created, name))
    owner = claims[first].owner
    return max(
        (name for name, claim in claims.items() if name == first or (owner and claim.owner == owner)),
        key=lambda name: ("/" in name, -claims[name].created, name),
    )


class FamilySink(Protocol):
    """Takes the keys of one family (``<prefix><family>/<name>``) from the control plane, on the event
    loop (must not block). Each returns whether something changed (``False``: same value, or refused)."""

    def put(self, name: str, value: bytes, *, backlog: bool) -> bool:
        """``<family>/<name>`` is ``value``; ``backlog``: learnt from a full read (start, resync), not a
        live watch event, so the value may sum changes made while nobody was watching."""
        ...

    def delete(self, name: str) -> bool:
        """``<family>/<name>`` was deleted (or expired with its lease)."""
        ...


class ControlCore:
    """Applies etcd state under ``prefix`` to ``fleet`` and ``store``; no IO, no clock.

    ``static_ids``: endpoints of the gateway's own config (default: those in ``fleet`` now); etcd can
    drain them but never replace or remove them.
    """

    def __init__(
        self, prefix: str, fleet: Fleet, store: PolicyStore, static_ids: Iterable[EndpointId] | None = None
    ) -> None:
        self.prefix = prefix
        self.fleet = fleet
        self.store = store
        self.static_ids = frozenset(s.id for s in fleet) if static_ids is None else frozenset(static_ids)
        self.revision = 0
        self._seen: dict[str, bytes] = {}  # key -> last value applied (or refused)
        self._ours: set[EndpointId] = set()
        self._draining: set[EndpointId] = set()
        #: kvcached daemons by node (``kvcached/<node>``): their index feed address (``None``: none).
        self.kvcached_feeds: dict[str, str | None] = {}
        self.counters = dict.fromkeys(
            ("syncs", "changes", "rejected", "refused", "ignored", "version_skew", "claims_refused"), 0
        )
        self._skew = SkewLog()
        #: The records read now at another version (``("endpoint" | "kvcached", name)``): a gauge, so that
        #: the skew alarm lasts as long as the skew, not only while the counter moves.
        self.skewed: set[tuple[str, str]] = set()
        self._endpoint_keys: dict[EndpointId, str] = {}  # id -> the key name that describes it now
        #: The ``endpoints/`` keys of each etcd endpoint id (key name -> its claim, :func:`_holder`).
        self._claims: dict[EndpointId, dict[str, _Claim]] = {}
        self._waiting_logged: set[str] = set()  # key names whose refused claim was logged (once each)
        self._sinks: dict[str, FamilySink] = {}
        self._backlog = False  # applying a snapshot's diff
        self._revision_now = 0  # the revision of the changes being applied
        self._created_now = 0  # the create revision of the key being applied (0: not known)
        #: Whether an etcd endpoint may be in the fleet now (refused ones are held and asked again by
        #: :meth:`readmit`; with an InferencePool, those at the address of none of its ready pods,
        #: :meth:`extproc.inferencepool.merge.PoolSync.admits`); default: every one.
        self.admits: Callable[[Endpoint], bool] = lambda _endpoint: True
        self._held: dict[EndpointId, Endpoint] = {}
        #: etcd endpoints refused for an address another endpoint holds: tried again when the fleet changes.
        self._refused: dict[EndpointId, Endpoint] = {}
        self._policy_values: dict[str, bytes] = {}  # etcd's policy values now (path -> raw JSON)
        self._policy_dirty = False
        #: Whether an endpoint of the fleet gives its address up to an etcd record that has it (the
        #: InferencePool's pods, :meth:`extproc.inferencepool.merge.PoolSync.owns`); default: none does.
        self.yields: Callable[[EndpointId], bool] = lambda _endpoint_id: False

    def follow(self, family: str, sink: FamilySink) -> None:
        """Hand the keys of ``family`` to ``sink`` from the next snapshot on (register before the first;
        the families the core handles itself cannot be taken)."""
        if family in (ENDPOINTS, DRAIN, KVCACHED, audit.AUDIT) or policy_path(family, "x") is not None:
            raise ValueError(f"the control core handles {family}/ itself")
        self._sinks[family] = sink

    @property
    def etcd_endpoints(self) -> frozenset[EndpointId]:
        """Endpoints this core added from etcd (and has not removed)."""
        return frozenset(self._ours)

    def draining(self, endpoint_id: EndpointId) -> bool:
        """etcd has ``drain/<endpoint_id>`` (for an endpoint of any source, present or to come)."""
        return endpoint_id in self._draining

    @property
    def held(self) -> frozenset[EndpointId]:
        """etcd endpoints held out of the fleet because :attr:`admits` refuses them."""
        return frozenset(self._held)

    def snapshot(
        self, kvs: Iterable[tuple[str, bytes]], revision: int, created: Mapping[str, int] | None = None
    ) -> Applied:
        """Make the applied state equal to a full read of the prefix taken at ``revision`` (``created``:
        each key's create revision; an endpoint key created anew while nobody watched: deleted, then put;
        puts in the order etcd created the keys)."""
        current, created = dict(kvs), created or {}
        anew = {
            k for k in current if self._seen.get(k) == current[k] and self._created_anew(k, created.get(k, 0))
        }
        changes = [Change(k, None) for k in sorted(self._seen) if k not in current or k in anew]
        changes += sorted(  # in the order etcd created them (the first claim of an endpoint id holds it)
            (
                Change(k, v, created.get(k, 0))
                for k, v in current.items()
                if self._seen.get(k) != v or k in anew
            ),
            key=lambda change: (change.created, change.key),
        )
        self.counters["syncs"] += 1
        self._backlog = True
        try:
            return self.apply(changes, revision)
        finally:
            self._backlog = False

    def apply(self, changes: Iterable[Change], revision: int) -> Applied:
        """Apply changes in order (one watch response, or a snapshot's diff); then, when a policy key
        changed, the policy of etcd's whole set of policy values (:meth:`PolicyStore.replace`)."""
        fleet_changed = False
        self._revision_now = revision
        self._policy_dirty = False
        for change in changes:
            fleet_changed |= self._apply_one(change)
        if fleet_changed and self._refused:
            fleet_changed |= self._retry_refused()
        policy_changed = self._policy_dirty and self._apply_policy()
        self.revision = max(self.revision, revision)
        return Applied(fleet_changed, self.store.policy if policy_changed else None)

    def _apply_one(self, change: Change) -> bool:
        """One key: whether the fleet changed. A value that raises anything while it is decoded or
        checked is that key's refusal (logged without the value); the key counts as handled only after."""
        key, value = change.key, change.value
        if value is None:
            if key not in self._seen:
                return False
        elif self._seen.get(key) == value and not self._created_anew(key, change.created):
            return False
        self.counters["changes"] += 1
        try:
            self._created_now = change.created
            changed = self._dispatch(key, value)
        except Exception as exc:
            log.warning("etcd key %s refused (%s); its last good state stays", key, type(exc).__name__)
            self.counters["rejected"] += 1
            changed = False
        if value is None:
            self._seen.pop(key, None)
        else:
            self._seen[key] = value
        return changed

    def _apply_policy(self) -> bool:
        """Build the policy from every policy value etcd holds now: whether the policy in force changed."""
        before = self.store.rejected
        try:
            changed = self.store.replace(self._policy_values) is not None
        except Exception as exc:  # a check that raised what it should not: refused, the last good stays
            log.warning("etcd policy refused (%s); the last good policy stays", type(exc).__name__)
            self.counters["rejected"] += 1
            return False
        self.counters["rejected"] += sum(1 for p, r in self.store.rejected.items() if before.get(p) != r)
        return changed

    def _created_anew(self, key: str, created: int) -> bool:
        """Whether the endpoint key ``key`` was created again (another create revision than its claim's)."""
        parsed = split_key(self.prefix, key)
        if not created or parsed is None or parsed[0] != ENDPOINTS:
            return False
        claim = self._claims.get(EndpointId(endpoint_id_of(parsed[1])), {}).get(parsed[1])
        return claim is not None and claim.created != created

    def _dispatch(self, key: str, value: bytes | None) -> bool:
        parsed = split_key(self.prefix, key)
        if parsed is not None:
            family, name = parsed
            if family == ENDPOINTS:
                return self._endpoint_key(name, value, self._created_now)
            if family == DRAIN:
                return self._drain(EndpointId(name), value is not None)
            if family == KVCACHED:
                return self._kvcached(name, value)
            path = policy_path(family, name)
            if path is not None:
                if value is None:
                    self._policy_values.pop(path, None)
                else:
                    self._policy_values[path] = value
                self._policy_dirty = True
                return False
            if family == audit.AUDIT:
                if value is not None and not self._backlog:
                    line = audit.log_line(
                        audit.decode_record(value), f"{self.prefix}{name}", self._revision_now
                    )
                    audit_log.info("%s", line)
                return False
            sink = self._sinks.get(family)
            if sink is not None:
                if value is None:
                    sink.delete(name)
                else:
                    sink.put(name, value, backlog=self._backlog)
                return False
        self.counters["ignored"] += 1
        return False

    def _endpoint_key(self, name: str, value: bytes | None, created: int = 0) -> bool:
        """``endpoints/<name>`` changed: the endpoint it names, whichever layout. An id belongs to the node
        whose key claimed it first (the oldest create revision, :func:`_holder`): another node's key for
        it is refused (logged once, counted in ``counters["claims_refused"]``) and waits until the keys
        before it are gone (their leases ended), so an agent confined to ``endpoints/<node>/`` cannot take
        over another node's endpoint. The same node's keys take turns: an endpoint moving from
        ``endpoints/<id>`` (whose record names the node) to ``endpoints/<node>/<id>`` in a rolling upgrade
        is described by the new key; the delete of the old one, when its lease ends, changes nothing."""
        endpoint_id = EndpointId(endpoint_id_of(name))
        node, sep, _ = name.rpartition("/")
        if endpoint_id in self.static_ids or (sep and (not node or "/" in node)):
            return self._endpoint(endpoint_id, value, name)  # refused there
        claims = self._claims.setdefault(endpoint_id, {})
        before = self._endpoint_keys.get(endpoint_id)
        previous = claims.get(before) if before is not None else None
        if value is None:
            claims.pop(name, None)
            self._waiting_logged.discard(name)
        else:
            old = claims.get(name)
            when = created or (old.created if old is not None else self._revision_now)
            claims[name] = _Claim(_owner(name, value), when, value)
        if not claims:
            del self._claims[endpoint_id]
            self._endpoint_keys.pop(endpoint_id, None)
            return self._endpoint(endpoint_id, None)
        holder = _holder(claims)
        if holder == before and holder != name:
            if value is not None:
                self._refuse_claim(endpoint_id, name, holder)
            return False
        self._endpoint_keys[endpoint_id] = holder
        self._waiting_logged.discard(holder)
        changed = False
        moved = before is not None and holder != before
        if moved and (previous is None or previous.owner != claims[holder].owner):
            # Another node's endpoint now: the last one's description and live state go first.
            log.info("endpoint %s: etcd key endpoints/%s holds the id now", endpoint_id, holder)
            changed = self._endpoint(endpoint_id, None)
        return self._endpoint(endpoint_id, claims[holder].value, holder) or changed

    def _refuse_claim(self, endpoint_id: EndpointId, name: str, holder: str) -> None:
        self.counters["claims_refused"] += 1
        if name not in self._waiting_logged:
            self._waiting_logged.add(name)
            log.warning(
                "etcd endpoints/%s refused: endpoints/%s holds endpoint %s (it waits until that key goes)",
                name,
                holder,
                endpoint_id,
            )

    def _endpoint(self, endpoint_id: EndpointId, value: bytes | None, name: str | None = None) -> bool:
        if endpoint_id in self.static_ids:
            if value is not None:
                log.warning("etcd endpoint %s refused: the gateway config defines that id", endpoint_id)
                self.counters["refused"] += 1
            return False
        self._refused.pop(endpoint_id, None)  # its new value (or its removal) decides anew
        if value is None:
            self._held.pop(endpoint_id, None)
            self.skewed.discard(("endpoint", endpoint_id))
            if endpoint_id not in self._ours:
                return False
            self._ours.discard(endpoint_id)
            self.fleet.remove(endpoint_id)
            log.info("endpoint %s left the fleet", endpoint_id)
            return True
        try:
            decoded = decode_record(name or endpoint_id, value)
        except ConfigError as exc:
            kept = "its last good value" if endpoint_id in self._ours else "it out of the fleet"
            log.warning("etcd endpoint refused, keeping %s: %s", kept, exc)
            self.counters["rejected"] += 1
            return False
        if decoded.skew is None:
            self.skewed.discard(("endpoint", endpoint_id))
        else:
            self.skewed.add(("endpoint", endpoint_id))
            self.counters["version_skew"] += 1
            if self._skew.note("endpoint record", endpoint_id, decoded.skew, decoded.skew) is not None:
                log.warning("version skew: %s", decoded.skew)
        if decoded.endpoint is None:
            self.counters["rejected"] += 1
            return False
        endpoint = decoded.endpoint
        if ip_port(endpoint.address) is None:  # EDS serves ip:port only: it would never be routed to
            kept = "its last good value" if endpoint_id in self._ours else "it out of the fleet"
            log.warning(
                "etcd endpoint %s refused, keeping %s: address %r is not an IP address and port (Envoy "
                "routes to addresses, not names)",
                endpoint_id,
                kept,
                endpoint.address,
            )
            self.counters["rejected"] += 1
            return False
        if not self.admits(endpoint):
            self._held[endpoint_id] = endpoint
            return self._hold(endpoint_id)
        self._held.pop(endpoint_id, None)
        return self._admit(endpoint_id, endpoint)

    def _hold(self, endpoint_id: EndpointId) -> bool:
        """Take an endpoint of ours out of the fleet while :attr:`admits` refuses it (kept in ``_held``)."""
        if endpoint_id not in self._ours:
            return False
        self._ours.discard(endpoint_id)
        self.fleet.remove(endpoint_id)
        log.info("endpoint %s held out of the fleet (not admitted)", endpoint_id)
        return True

    def readmit(self) -> bool:
        """Ask :attr:`admits` again about every etcd endpoint (after what it reads changed): those it now
        refuses leave the fleet, held ones it now admits join. Returns whether the fleet changed."""
        changed = False
        for endpoint_id in sorted(self._ours):
            state = self.fleet.get(endpoint_id)
            if state is not None and not self.admits(state.endpoint):
                self._held[endpoint_id] = state.endpoint
                changed |= self._hold(endpoint_id)
        for endpoint_id, endpoint in sorted(self._held.items()):
            if self.admits(endpoint):
                del self._held[endpoint_id]
                changed |= self._admit(endpoint_id, endpoint)
        if self._refused:
            changed |= self._retry_refused()
        return changed

    def _retry_refused(self) -> bool:
        """Try again the endpoints refused for an address another one held (after the fleet changed)."""
        changed = False
        for endpoint_id, endpoint in sorted(self._refused.items()):
            if self.admits(endpoint):
                changed |= self._admit(endpoint_id, endpoint)
        return changed

    def _admit(self, endpoint_id: EndpointId, endpoint: Endpoint) -> bool:
        holder = self.fleet.by_address(endpoint.address)
        if holder is not None and holder.id != endpoint_id and self.yields(holder.id):
            log.info("endpoint %s takes over %s from %s", endpoint_id, endpoint.address, holder.id)
            self.fleet.remove(holder.id)  # e.g. an InferencePool pod's: the agent's record is richer
            holder = None
        if holder is not None and holder.id != endpoint_id:
            if self._refused.get(endpoint_id) != endpoint:
                address = endpoint.address
                log.warning("etcd endpoint %s refused: %s is %s's address", endpoint_id, address, holder.id)
                self.counters["refused"] += 1
            self._refused[endpoint_id] = endpoint  # joins when the address is free (_retry_refused)
            return False
        self._refused.pop(endpoint_id, None)
        state = self.fleet.get(endpoint_id)
        if state is not None and state.endpoint == endpoint:
            return False
        self.fleet.upsert(endpoint)
        self.fleet.set_state(endpoint_id, draining=endpoint_id in self._draining)
        if endpoint_id not in self._ours:
            log.info("endpoint %s (%s) joined the fleet", endpoint_id, endpoint.address)
        self._ours.add(endpoint_id)
        return True

    def _kvcached(self, node: str, value: bytes | None) -> bool:
        """A node's kvcached came, changed or went: its feed joins or leaves the set gateways follow."""
        if value is None:
            self.skewed.discard(("kvcached", node))
            return self.kvcached_feeds.pop(node, None) is not None
        try:
            info = decode_peer(node, value)
        except ConfigError as exc:
            log.warning("etcd kvcached/%s ignored: %s", node, exc)
            self.counters["rejected"] += 1
            return False
        skewed = peer_skew(info)
        if skewed is not None:
            # Another record schema, or blocks keyed under another digest scheme: never followed.
            self.counters["version_skew"] += 1
            self.skewed.add(("kvcached", node))
            what, version, why = skewed
            line = self._skew.note(what, node, version, f"{why}; its feed is not followed")
            if line is not None:
                log.warning("%s", line)
            had = node in self.kvcached_feeds
            self.kvcached_feeds.pop(node, None)
            return had
        self.skewed.discard(("kvcached", node))
        self.kvcached_feeds[node] = info.feed
        return True

    def _drain(self, endpoint_id: EndpointId, draining: bool) -> bool:
        if draining == (endpoint_id in self._draining):
            return False
        if draining:
            self._draining.add(endpoint_id)
        else:
            self._draining.discard(endpoint_id)
        log.info("endpoint %s %s", endpoint_id, "draining" if draining else "no longer draining")
        if self.fleet.get(endpoint_id) is None:
            return False
        self.fleet.set_state(endpoint_id, draining=draining)
        return True


class ControlPlane:
    """Keeps a Fleet and a PolicyStore in step with etcd: :class:`ControlCore` driven by a
    :class:`runtime.watch.PrefixWatcher` over the whole prefix, on an etcd client of its own.

    ``on_policy(policy)`` runs after a change to the policy in force, ``on_fleet_change()`` after the
    fleet changed; both run on the event loop and must not block. ``probe_interval_s``: how often
    liveness is checked while watching (an outage is noticed within about that long);
    ``max_backoff_s``: the longest wait between reconnection attempts.
    """

    def __init__(
        self,
        settings: EtcdSettings,
        fleet: Fleet,
        store: PolicyStore,
        *,
        on_policy: Callable[[Policy], None] | None = None,
        on_fleet_change: Callable[[], None] | None = None,
        static_ids: Iterable[EndpointId] | None = None,
        probe_interval_s: float = 1.0,
        max_backoff_s: float = 5.0,
    ) -> None:
        self.settings = settings
        self.core = ControlCore(settings.prefix, fleet, store, static_ids)
        self._on_policy = on_policy
        self._on_fleet_change = on_fleet_change
        self._probe_interval_s = probe_interval_s
        self._max_backoff_s = max_backoff_s
        self._client: etcd3aio.Etcd3Client | None = None
        self._watcher: PrefixWatcher[Applied] | None = None  # made in start(), kept for its counters

    @property
    def connected(self) -> bool:
        """etcd answered the last call (``False`` before :meth:`start` and after :meth:`aclose`)."""
        return self._watcher is not None and self._watcher.connected

    @property
    def client(self) -> etcd3aio.Etcd3Client | None:
        """The plane's etcd client (``None`` before :meth:`start` and after :meth:`aclose`), which a
        companion that writes to etcd may share (the client is safe for concurrent calls)."""
        return self._client

    @property
    def revision(self) -> int:
        """The etcd revision the fleet and policy reflect."""
        return self.core.revision

    @property
    def counters(self) -> Mapping[str, int]:
        """For metrics: syncs, changes, rejected, refused, ignored, outages, compactions, connected."""
        watcher = self._watcher.counters if self._watcher is not None else {}
        return {
            **self.core.counters,
            "outages": watcher.get("outages", 0),
            "compactions": watcher.get("compactions", 0),
            "connected": int(self.connected),
        }

    async def start(self) -> None:
        """Open the client and start following etcd in the background (an etcd that is down is retried:
        the gateway runs on its static fleet and embedded policy meanwhile)."""
        if self._client is not None:
            raise RuntimeError("ControlPlane already started")
        self._client = await connect(self.settings)
        self._watcher = PrefixWatcher(
            self._client,
            self.settings.prefix,
            self.core,
            timeout_s=self.settings.timeout_s,
            probe_interval_s=self._probe_interval_s,
            max_backoff_s=self._max_backoff_s,
            on_applied=self._notify,
            name="etcd-control-plane",
        )
        self._watcher.start()

    async def wait_synced(self, timeout_s: float) -> bool:
        """Wait until the first full read has been applied; ``False`` after ``timeout_s`` seconds (at
        once when not started)."""
        return self._watcher is not None and await self._watcher.wait_synced(timeout_s)

    async def aclose(self) -> None:
        if self._watcher is not None:
            await self._watcher.aclose()
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    def _notify(self, applied: Applied) -> None:
        if applied.fleet_changed and self._on_fleet_change is not None:
            self._on_fleet_change()
        if applied.policy is not None and self._on_policy is not None:
            self._on_policy(applied.policy)
