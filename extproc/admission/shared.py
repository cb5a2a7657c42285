"""What etcd adds to admission: tenants from ``tenants/<id>`` and token budgets shared by replicas.

Pure: no IO, no clock (``now`` is a parameter). The etcd shell is :mod:`extproc.control.usage` under the
control plane's one watch (:class:`extproc.control.plane.ControlCore` hands it the ``tenants/`` and
``usage/`` keys); ``extproc/admission/README.md`` states the design, its formulas and its bounds.

* :class:`TenantDirectory`: the gateway's ``[[tenants]]`` overlaid by etcd ``tenants/<id>`` values, each
  validated by :func:`decode_tenant` (a refused value leaves the key's last good tenant in force).
* :class:`UsageLedger`: what this replica publishes (its budgets' :attr:`~TokenBudgets.charged`) and
  what other replicas' published counters charge its buckets.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from contracts.errors import ConfigError
from contracts.etcd import TENANTS, decode_usage
from extproc.admission.budget import TokenBudgets
from extproc.admission.config import parse_tenant
from extproc.admission.gate import Gate
from extproc.admission.tenants import TENANT_ID, Tenant, Tenants

log = logging.getLogger(__name__)

#: Deleted usage keys whose last counter a ledger keeps (oldest forgotten first).
TOMBSTONES = 65_536


def decode_tenant(tenant_id: str, value: bytes) -> Tenant:
    """Validate the value of ``tenants/<tenant_id>``: a JSON object of the ``[[tenants]]`` schema whose
    ``id`` is ``tenant_id`` or absent; :class:`ConfigError` names the key and the reason."""
    where = f"{TENANTS}/{tenant_id}"
    if not TENANT_ID.fullmatch(tenant_id):
        raise ConfigError(f"{where}: not a valid tenant id")
    try:
        doc = json.loads(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    if doc.setdefault("id", tenant_id) != tenant_id:
        raise ConfigError(f"{where}.id: {doc['id']!r} does not match the key")
    return parse_tenant(doc, where)


class TenantDirectory:
    """The tenants in force: the file's, in file order, an etcd tenant of the same id replacing one in its
    place, then the other etcd tenants by id. Every change goes to ``on_change`` (the gate's
    :meth:`~extproc.admission.gate.Gate.set_tenants`) as a whole new :class:`Tenants`.

    :meth:`put` and :meth:`delete` follow the :class:`extproc.control.plane.FamilySink` contract: they
    return whether the tenant set changed. A refused value is logged and counted in :attr:`rejected`,
    and the key's last good tenant (if any) stays; deleting a key brings the file's tenant of that id back.
    """

    def __init__(self, file_tenants: Sequence[Tenant], on_change: Callable[[Tenants], None]) -> None:
        self._file = tuple(file_tenants)
        self._etcd: dict[str, Tenant] = {}
        self._on_change = on_change
        self.tenants = Tenants(self._file)
        self.rejected = 0

    def put(self, name: str, value: bytes, *, backlog: bool) -> bool:
        """``tenants/<name>`` = ``value`` (``backlog``: from a full read; no difference here)."""
        try:
            tenant = decode_tenant(name, value)
        except ConfigError as exc:
            kept = "its last good value" if name in self._etcd else "it out"
            log.warning("etcd tenant refused, keeping %s: %s", kept, exc)
            self.rejected += 1
            return False
        if self._etcd.get(name) == tenant:
            return False
        self._etcd[name] = tenant
        log.info("tenant %s set from etcd", name)
        self._publish()
        return True

    def delete(self, name: str) -> bool:
        """``tenants/<name>`` was deleted: the tenant leaves (or the file's tenant of that id returns)."""
        if self._etcd.pop(name, None) is None:
            return False
        log.info("tenant %s removed from etcd", name)
        self._publish()
        return True

    def _publish(self) -> None:
        ordered = [self._etcd.get(t.id, t) for t in self._file]
        file_ids = {t.id for t in self._file}
        ordered += [self._etcd[i] for i in sorted(self._etcd) if i not in file_ids]
        self.tenants = Tenants(ordered)
        self._on_change(self.tenants)


class UsageLedger:
    """Shares token budgets between replicas through cumulative counters (see the README's formulas).

    Outbound: :meth:`due` is this replica's charged counters (``budgets.charged``) that changed since the
    last call. Inbound: :meth:`observe` takes another replica's published counter and charges this
    replica's bucket of that tenant with its change since last seen (a drop is a refund given back). A
    counter first seen in a full read (``backlog``) is a baseline, charged nothing: it sums spending from
    before this replica knew; one first seen live is a replica that just started, charged in full. A
    counter that disappears (its replica's lease ended) is not refunded, and its last value is kept (up
    to :data:`TOMBSTONES` of them): a replica whose lease lapsed and was granted anew puts the same key
    again with the same cumulative counter, and only its change since is charged (replica ids are unique
    per process, so a key that comes back is the same counter).
    """

    def __init__(self, budgets: TokenBudgets, lookup: Callable[[str], Tenant | None]) -> None:
        self._budgets = budgets
        self._lookup = lookup
        self._published: dict[str, int] = {}
        self._seen: dict[tuple[str, str], int] = {}  # (tenant, replica) -> counter last seen
        self._gone: OrderedDict[tuple[str, str], int] = OrderedDict()  # deleted keys' last counters
        self.rejected = 0

    def due(self) -> Mapping[str, int]:
        """Counters (tenant id -> tokens charged) to publish now; each is reported once per change."""
        changed = {t: n for t, n in self._budgets.charged.items() if self._published.get(t) != n}
        self._published.update(changed)
        return changed

    def counters(self) -> Mapping[str, int]:
        """This replica's counters now, every limited tenant it charged (what sibling workers are sent)."""
        return self._budgets.charged

    def observe(self, tenant_id: str, replica: str, value: bytes | None, *, backlog: bool, now: float) -> int:
        """Another replica's counter for ``tenant_id`` is ``value`` (``None``: gone); returns the tokens
        charged to this replica's bucket (negative: refunded; 0 when the tenant is unknown or unlimited)."""
        key = (tenant_id, replica)
        if value is None:
            last_seen = self._seen.pop(key, None)
            if last_seen is not None:
                self._gone[key] = last_seen
                self._gone.move_to_end(key)
                while len(self._gone) > TOMBSTONES:
                    self._gone.popitem(last=False)
            return 0
        try:
            counter = decode_usage(value)
        except ConfigError as exc:
            log.warning("etcd usage of tenant %s by %s ignored: %s", tenant_id, replica, exc)
            self.rejected += 1
            return 0
        last = self._seen.get(key)
        if last is None:
            last = self._gone.pop(key, None)  # the same replica back under a new lease
        self._seen[key] = counter
        delta = counter - last if last is not None else (0 if backlog else counter)
        tenant = self._lookup(tenant_id)
        if delta == 0 or tenant is None or tenant.tokens is None:
            return 0
        self._budgets.charge(tenant, delta, now)
        return delta


class SharedAdmission:
    """A gate's etcd side: :attr:`tenants` (its tenant set, kept in force on the gate) and :attr:`usage`
    (its budgets' ledger). Built over a gate whose tenants are the gateway file's."""

    def __init__(self, gate: Gate) -> None:
        self.tenants = TenantDirectory(tuple(gate.tenants), gate.set_tenants)
        self.usage = UsageLedger(gate.budgets, lambda tenant_id: gate.tenants.get(tenant_id))
