"""Fuzzing the validators of what etcd holds (issue 24 part 3): every family the gateway's control core
reads (``endpoints/``, ``drain/``, ``kvcached/``, ``policy/`` with ``flow/`` and ``burst``, ``models/``,
``objectives/``, ``audit/``) and the families handed to sinks (``tenants/``, ``usage/``,
``federation/``), each value arbitrary bytes, arbitrary JSON, or a valid record with fields replaced.

Property: :meth:`ControlCore.apply` never raises (a bad value is refused and counted), a refused policy
value leaves the policy in force as it was (the last good one stays), and the policy in force can always
be turned into the routing policy the router uses.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import example, given
from hypothesis import strategies as st

from contracts.etcd import Change
from contracts.events import EndpointId
from engines.endpoint import Endpoint, encode_endpoint
from extproc.admission.budget import TokenBudgets
from extproc.admission.shared import TenantDirectory, UsageLedger
from extproc.admission.tenants import Tenant
from extproc.control.plane import ControlCore
from extproc.control.policy import PolicyStore, cascade_policy, pd_policy, routing_policy
from extproc.control.usage import UsageSync
from extproc.federation.links import parse_federation
from extproc.federation.peers import Federation
from extproc.federation.shell import LinkSink
from extproc.fleet import Fleet
from tests.fuzz.strategies import FUZZ, json_values

PREFIX = "/kvgate/"
STATIC = Endpoint(EndpointId("static"), "10.0.0.1:8000", frozenset({"m"}))
LINK: dict[str, Any] = {
    "cluster": "b",
    "ingress": "127.0.0.1:10443",
    "service": "127.0.0.1:9500",
    "identity": "spiffe://kvgate.local/federation-b",
    "rtt_ms": 20,
    "egress_requests_per_s": 50,
    "egress_bytes_per_s": 1e7,
}

#: A valid value of each family (and policy path), the base of the mutations.
VALID: dict[str, dict[str, Any]] = {
    "endpoints/node-0/e1": orjson.loads(
        encode_endpoint(Endpoint(EndpointId("e1"), "10.0.0.2:8000", frozenset({"m"}), node="node-0"))
    ),
    "kvcached/node-0": {"node": "node-0", "quic": "127.0.0.1:7000", "feed": "127.0.0.1:7001"},
    "tenants/acme": {"models": ["m"], "tokens": {"per_minute": 600, "burst": 1000}},
    "federation/b": LINK,
    "models/m": {"labels": {"pool": "a"}, "profile": None},
    "models/auto": {"cascade": {"steps": ["m", "big"], "threshold": -0.5}},
    "objectives/interactive": {"priority": 1, "ttft_ms": 1000},
    "policy/weights/prefix": 3.0,
    "policy/profiles/default/weights/queue": 2.0,
    "policy/index/block_size": 16,
    "policy/index/speculative_ttl_s": 2.0,
    "policy/flow/saturation": {"max_waiting": 8, "max_in_flight": 8},
    "policy/flow/bands/default": {"max_requests": 32, "max_wait_s": 10},
    "policy/flow/bands/-1": {"headroom": -0.5},
    "policy/flow/models/m": {"max_waiting": 4},
    "policy/flow/max_queued": 4096,
    "policy/flow/fairness": "requests",
    "policy/flow/engine_priority": {"order": "low_first", "scale": 1},
    "policy/flow/burst": {"max_per_minute": 60},
    "policy/plugins/load-threshold/max_waiting": 16,
    "usage/acme/other": 5,
    "drain/e1": "",
    "audit/policy/weights": {"by": "operator", "op": "set"},
}
KEYS = [
    *sorted(VALID),
    "endpoints/e2",
    "policy/weights/nope",
    "policy/flow/bands/x",
    "policy/plugins/nope/x",
    "tenants/Bad Id",
    "usage/acme",
    "federation/B!",
    "elsewhere/x",
]


def _core() -> tuple[ControlCore, PolicyStore]:
    fleet, store = Fleet([STATIC]), PolicyStore()
    core = ControlCore(PREFIX, fleet, store)
    directory = TenantDirectory((Tenant("a", ("*",)),), lambda _tenants: None)
    core.follow("tenants", directory)
    ledger = UsageLedger(TokenBudgets(), lambda tenant: directory.tenants.get(tenant))
    core.follow("usage", UsageSync(ledger, sync_s=1.0, replica="me"))
    federation = Federation(parse_federation({"cluster": "a", "links": [LINK]}))
    core.follow("federation", LinkSink(federation, lambda: None))
    return core, store


@st.composite
def values(draw: st.DrawFn, key: str) -> bytes:
    """A value for ``key``: its valid record with fields replaced or removed, any JSON, or any bytes."""
    choice = draw(st.integers(0, 5))
    if choice == 0:
        return draw(st.binary(max_size=64))
    if choice == 1:
        return orjson.dumps(draw(json_values(10)))
    base = VALID.get(key, {})
    if isinstance(base, dict):
        doc = dict(base)
        for field in draw(st.lists(st.sampled_from(sorted(doc)), max_size=2)) if doc else []:
            doc.pop(field, None)
        doc.update(
            draw(
                st.dictionaries(
                    st.sampled_from(sorted(base) or ["x"]) | st.text(max_size=6), json_values(6), max_size=3
                )
            )
        )
        return orjson.dumps(doc)
    return orjson.dumps(draw(json_values(4)))


@st.composite
def changes(draw: st.DrawFn) -> list[Change]:
    out = []
    for _ in range(draw(st.integers(1, 6))):
        key = draw(st.sampled_from(KEYS) | st.text(max_size=12).map(lambda s: f"policy/{s}"))
        value = None if draw(st.integers(0, 5)) == 0 else draw(values(key))
        out.append(Change(PREFIX + key, value))
    return out


@FUZZ
@given(batches=st.lists(changes(), min_size=1, max_size=4))
@example(batches=[[Change(PREFIX + "policy/index/block_size", b"0")]])
def test_control_core_refuses_bad_records_and_keeps_the_last_good_policy(batches: list[list[Change]]) -> None:
    core, store = _core()
    for revision, batch in enumerate(batches, start=1):
        for change in batch:
            before = store.policy
            applied = core.apply([change], revision)
            if applied.policy is None:
                assert store.policy is before  # refused or unchanged: the last good policy stays
            policy = store.policy
            routing_policy(policy, max_fallbacks=2)
            pd_policy(policy, max_fallbacks=2)
            cascade_policy(policy)
            json.dumps(store.effective())
    # a full read of the same keys (a resync) is applied as a diff without raising either
    core.snapshot([(c.key, c.value) for batch in batches for c in batch if c.value is not None], 99)
