"""Token budgets shared by ext_proc replicas through etcd: the shell around a usage ledger.

:class:`UsageSync` is this replica's side of ``usage/<tenant>/<replica>`` (design, formulas and bounds:
``extproc/admission/README.md``):

* outbound, every ``sync_s`` seconds, it puts the counters the ledger says changed (the tokens this
  replica charged each tenant's budget since it started) under a lease of its own
  (:class:`runtime.etcd.LeasedKeys`, on the control plane's client): when the replica stops or dies the
  lease ends and its counters vanish;
* inbound, it is the control plane's :class:`~extproc.control.plane.FamilySink` for ``usage/``: every
  other replica's counter goes to the ledger with the time, its own are skipped.

The ledger is :class:`extproc.admission.shared.UsageLedger` (pure), seen here as :class:`Ledger`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import etcd3aio

from contracts.etcd import encode_usage, split_usage, usage_key
from runtime.etcd import LeasedKeys

LEASE_TTL_S = 10
"""How long a replica's counters outlive it (other replicas forget it once they vanish)."""


class Ledger(Protocol):
    """The pure accounting (:class:`extproc.admission.shared.UsageLedger`)."""

    def due(self) -> Mapping[str, int]:
        """This replica's counters (tenant id -> tokens) changed since the last call."""
        ...

    def observe(self, tenant_id: str, replica: str, value: bytes | None, *, backlog: bool, now: float) -> int:
        """Another replica's counter (``None``: gone); returns the tokens charged here."""
        ...


def replica_id() -> str:
    """``<host>:<pid>:<random>``: unique to this process, readable in ``etcdctl get --prefix``."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class UsageSync:
    """Publishes this replica's counters and feeds other replicas' to ``ledger`` (module docstring).

    ``sync_s``: the publishing period; ``replica``: this replica's id (default :func:`replica_id`);
    ``clock``: monotonic seconds, the ``now`` of the ledger's charges.
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        sync_s: float,
        replica: str | None = None,
        ttl_s: int = LEASE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ledger = ledger
        self.sync_s = sync_s
        self.replica = replica or replica_id()
        self._ttl_s = ttl_s
        self._clock = clock
        self._keys: LeasedKeys | None = None
        self._task: asyncio.Task[None] | None = None
        self.published = 0  # counter values put

    # -- inbound: the control plane's sink for usage/ ----------------------------------------------------

    def put(self, name: str, value: bytes, *, backlog: bool) -> bool:
        """Another replica's counter ``usage/<tenant>/<replica>`` (this replica's own are skipped)."""
        return self._observe(name, value, backlog)

    def delete(self, name: str) -> bool:
        """A counter vanished (its replica's lease ended): the ledger forgets it, refunding nothing."""
        return self._observe(name, None, False)

    def _observe(self, name: str, value: bytes | None, backlog: bool) -> bool:
        parts = split_usage(name)
        if parts is None or parts[1] == self.replica:
            return False
        tenant_id, replica = parts
        return self.ledger.observe(tenant_id, replica, value, backlog=backlog, now=self._clock()) != 0

    # -- outbound ---------------------------------------------------------------------------------------

    async def start(self, client: etcd3aio.Etcd3Client, prefix: str, timeout_s: float) -> None:
        """Take a lease on ``client`` (an etcd that is down is retried in the background) and publish
        every ``sync_s`` seconds until :meth:`aclose`."""
        if self._task is not None:
            raise RuntimeError("UsageSync already started")
        self._keys = LeasedKeys(client, self._ttl_s, timeout_s=timeout_s)
        await self._keys.start()
        self._task = asyncio.create_task(self._run(prefix), name="etcd-usage-sync")

    async def aclose(self) -> None:
        """Stop publishing and revoke the lease: this replica's counters vanish at once."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        keys, self._keys = self._keys, None
        if keys is not None:
            await keys.aclose()

    async def _run(self, prefix: str) -> None:
        while True:
            await asyncio.sleep(self.sync_s)
            await self._publish(prefix)

    async def _publish(self, prefix: str) -> None:
        """Put the counters that changed (one that fails to reach etcd is put again by the lease's own
        reconnection, :class:`~runtime.etcd.LeasedKeys`)."""
        if self._keys is None:
            return
        for tenant_id, counter in sorted(self.ledger.due().items()):
            await self._keys.update(usage_key(prefix, tenant_id, self.replica), encode_usage(counter))
            self.published += 1
