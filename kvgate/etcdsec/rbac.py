"""etcd's users, roles and key permissions for kvgate, computed from the identities (sans IO).

etcd v3 authenticates a client certificate as the user named by the certificate's common name when it
runs with ``--client-cert-auth`` and auth is enabled; kvgate's leaves have CN = service name
(:func:`certs.authority.build_leaf`), so each service's etcd user is its name. Permissions are key
ranges ``[key, range_end)`` (a prefix grant is the range up to the prefix with its last byte + 1, as
``etcdctl role grant-permission --prefix`` makes). Under prefix ``P`` (default ``/kvgate/``):

=================  =========================  ==============================================================
identity (CN)      etcd role                  permissions
=================  =========================  ==============================================================
``extproc[-*]``    ``kvgate-gateway``         read ``P``; readwrite ``P usage/`` (shared token budgets)
``agent-<node>``   ``kvgate-agent-<node>``    readwrite ``P endpoints/<node>/``; read ``P policy/`` (block
                                              size)
``agent``          ``kvgate-agents``          readwrite ``P endpoints/``; read ``P policy/`` (shared mode)
``kvcached-<n>``   ``kvgate-kvcached-<n>``    readwrite the key ``P kvcached/<n>``; read ``P kvcached/``
``operator[-*]``   ``kvgate-operator``        read ``P``; readwrite ``P`` + each of ``policy/ models/
                                              objectives/ tenants/ federation/ burst/ drain/ audit/``
``root``           ``root`` (etcd's own)      everything, auth included (the bootstrap's identity)
=================  =========================  ==============================================================

So an agent writes only under its own ``endpoints/<node>/`` (a node id must be a certificate suffix:
lowercase letters, digits, ``-``), a gateway writes nothing but its usage counters, and only operators
change policy, routes, objectives, tenants, federation links, burst endpoints and drains (each change
with its audit record, :mod:`kvgate.etcdsec.audit`). The shared ``agent`` identity (one certificate for
every agent, for installations whose node ids are not known when users are made) keeps agents out of
policy but lets one agent write another's endpoints: per-node identities need a certificate and a user
per node (the Kubernetes production overlay gives each StatefulSet pod ``agent-<pod name>``,
deploy/README.md).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from certs.authority import role_of
from certs.errors import CertError
from contracts.audit import AUDIT
from contracts.errors import ConfigError
from contracts.etcd import (
    BURST,
    DRAIN,
    ENDPOINTS,
    FEDERATION,
    KVCACHED,
    MODELS,
    OBJECTIVES,
    POLICY,
    TENANTS,
    USAGE,
)

GATEWAY_ROLE = "kvgate-gateway"
OPERATOR_ROLE = "kvgate-operator"
AGENTS_ROLE = "kvgate-agents"
"""The shared ``agent`` identity's role (every node's endpoints)."""
ROOT = "root"
"""etcd's root user and role (auth cannot be enabled without the user)."""
ROLE_PREFIX = "kvgate-"
"""Roles the bootstrap owns: it revokes their permissions nobody asked for, and never touches others."""
OPERATOR_FAMILIES = (POLICY, MODELS, OBJECTIVES, TENANTS, FEDERATION, BURST, DRAIN, AUDIT)


class Perm(enum.IntEnum):
    """etcd's ``authpb.Permission.Type``."""

    READ = 0
    WRITE = 1
    READWRITE = 2


@dataclass(frozen=True, slots=True, order=True)
class Grant:
    """One key permission: the range ``[key, range_end)`` (``range_end`` empty: the key alone)."""

    key: bytes
    range_end: bytes
    perm: Perm


@dataclass(frozen=True, slots=True)
class Role:
    name: str
    grants: frozenset[Grant]


@dataclass(frozen=True, slots=True)
class User:
    name: str
    roles: frozenset[str]


@dataclass(frozen=True, slots=True)
class Plan:
    """The users and roles etcd should have; :func:`plan` builds it."""

    prefix: str
    roles: tuple[Role, ...]
    users: tuple[User, ...]


def prefix_end(key: bytes) -> bytes:
    """The end of the range of every key starting with ``key`` (its last byte below 0xff, plus one)."""
    stripped = key.rstrip(b"\xff")
    if not stripped:
        return b"\x00"  # every key
    return stripped[:-1] + bytes([stripped[-1] + 1])


def prefix_grant(key: str, perm: Perm) -> Grant:
    raw = key.encode()
    return Grant(raw, prefix_end(raw), perm)


def key_grant(key: str, perm: Perm) -> Grant:
    return Grant(key.encode(), b"", perm)


def agent_role(node: str) -> str:
    return f"{ROLE_PREFIX}agent-{node}"


def kvcached_role(node: str) -> str:
    return f"{ROLE_PREFIX}kvcached-{node}"


def plan(prefix: str, identities: Iterable[str]) -> Plan:
    """The users and roles for ``identities`` (service names = certificate CNs) under ``prefix``.

    Each name's role decides its grants (module docstring); a name of another role (an engine, Envoy, an
    API client) gets no etcd user: :class:`ConfigError`. The ``root`` user is always part of the plan."""
    if not prefix.endswith("/") or not prefix.startswith("/"):
        raise ConfigError(f"etcd prefix must start and end with '/', got {prefix!r}")
    roles: dict[str, Role] = {}
    users: dict[str, User] = {ROOT: User(ROOT, frozenset({ROOT}))}
    for name in identities:
        if name == ROOT:
            continue
        role = _role_for(prefix, name)
        roles[role.name] = role
        users[name] = User(name, frozenset({role.name}))
    return Plan(prefix, tuple(roles[n] for n in sorted(roles)), tuple(users[n] for n in sorted(users)))


def _role_for(prefix: str, name: str) -> Role:
    try:
        kind = role_of(name)
    except CertError as exc:
        raise ConfigError(f"etcd identity {name!r}: {exc}") from exc
    suffix = name[len(kind) + 1 :]
    if kind == "extproc":
        grants = {prefix_grant(prefix, Perm.READ), prefix_grant(f"{prefix}{USAGE}/", Perm.READWRITE)}
        return Role(GATEWAY_ROLE, frozenset(grants))
    if kind == "operator":
        grants = {prefix_grant(prefix, Perm.READ)}
        grants |= {prefix_grant(f"{prefix}{family}/", Perm.READWRITE) for family in OPERATOR_FAMILIES}
        return Role(OPERATOR_ROLE, frozenset(grants))
    if kind == "agent" and not suffix:
        grants = {
            prefix_grant(f"{prefix}{ENDPOINTS}/", Perm.READWRITE),
            prefix_grant(f"{prefix}{POLICY}/", Perm.READ),
        }
        return Role(AGENTS_ROLE, frozenset(grants))
    if kind == "kvcached" and not suffix:
        raise ConfigError(f"etcd identity {name!r}: a kvcached daemon needs its node: kvcached-<node>")
    if kind == "agent":
        grants = {
            prefix_grant(f"{prefix}{ENDPOINTS}/{suffix}/", Perm.READWRITE),
            prefix_grant(f"{prefix}{POLICY}/", Perm.READ),
        }
        return Role(agent_role(suffix), frozenset(grants))
    if kind == "kvcached":
        grants = {
            key_grant(f"{prefix}{KVCACHED}/{suffix}", Perm.READWRITE),
            prefix_grant(f"{prefix}{KVCACHED}/", Perm.READ),
        }
        return Role(kvcached_role(suffix), frozenset(grants))
    raise ConfigError(f"etcd identity {name!r}: a {kind} has no business in etcd")
