"""Make etcd's users, roles and auth match a :class:`~kvgate.etcdsec.rbac.Plan`, idempotently (the shell).

Run as etcd's ``root`` (a client certificate with CN ``root``, etcd started with
``--client-cert-auth``): before auth is enabled any client that etcd's CA verifies may do this, after
it only ``root``. Each run:

1. adds every planned role that is missing, grants its missing permissions and, for roles kvgate owns
   (``kvgate-*``), revokes permissions the plan no longer has;
2. adds every planned user that is missing (no password: certificates only), grants its roles and
   revokes ``kvgate-*`` roles the plan no longer gives it;
3. enables auth if it is off.

A second run with the same plan changes nothing (:attr:`Report.changes` is empty). Users and roles the
plan does not name are left alone (an identity removed from the plan keeps its user: delete it with
``etcdctl user delete``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import etcd3aio
from etcd3aio import PermissionType

from kvgate.etcdsec.rbac import ROLE_PREFIX, Grant, Perm, Plan


@dataclass(slots=True)
class Report:
    """What a run changed, one line per change (empty: etcd already matched the plan)."""

    changes: list[str] = field(default_factory=list)


def _grants(response: object) -> set[Grant]:
    perms = getattr(response, "perm", [])
    return {Grant(bytes(p.key), bytes(p.range_end), Perm(int(p.permType))) for p in perms}


async def apply(client: etcd3aio.Etcd3Client, plan: Plan, *, timeout_s: float = 5.0) -> Report:
    """Bring etcd in line with ``plan`` (module docstring); etcd errors propagate."""
    auth = client.auth
    assert auth is not None, "etcd client is not connected"
    report = Report()
    roles = set((await auth.role_list(timeout=timeout_s)).roles)
    for role in plan.roles:
        if role.name not in roles:
            await auth.role_add(role.name, timeout=timeout_s)
            report.changes.append(f"role {role.name} added")
            have: set[Grant] = set()
        else:
            have = _grants(await auth.role_get(role.name, timeout=timeout_s))
        for grant in sorted(role.grants - have):
            await auth.role_grant_permission(
                role.name,
                grant.key,
                grant.range_end or None,
                perm_type=PermissionType(int(grant.perm)),
                timeout=timeout_s,
            )
            report.changes.append(f"role {role.name}: {_show(grant)} granted")
        if role.name.startswith(ROLE_PREFIX):
            # etcd keeps one permission per range: a changed perm type on a range is a grant above.
            wanted_ranges = {(g.key, g.range_end) for g in role.grants}
            for grant in sorted(have - role.grants):
                if (grant.key, grant.range_end) in wanted_ranges:
                    continue
                await auth.role_revoke_permission(
                    role.name, grant.key, grant.range_end or None, timeout=timeout_s
                )
                report.changes.append(f"role {role.name}: {_show(grant)} revoked")
    users = set((await auth.user_list(timeout=timeout_s)).users)
    for user in plan.users:
        if user.name not in users:
            await auth.user_add(user.name, no_password=True, timeout=timeout_s)
            report.changes.append(f"user {user.name} added")
            current: set[str] = set()
        else:
            current = set((await auth.user_get(user.name, timeout=timeout_s)).roles)
        for role_name in sorted(user.roles - current):
            await auth.user_grant_role(user.name, role_name, timeout=timeout_s)
            report.changes.append(f"user {user.name}: role {role_name} granted")
        for role_name in sorted(current - user.roles):
            if role_name.startswith(ROLE_PREFIX):
                await auth.user_revoke_role(user.name, role_name, timeout=timeout_s)
                report.changes.append(f"user {user.name}: role {role_name} revoked")
    if not (await auth.auth_status(timeout=timeout_s)).enabled:
        await auth.auth_enable(timeout=timeout_s)
        report.changes.append("auth enabled")
    return report


def _show(grant: Grant) -> str:
    key = grant.key.decode("utf-8", "replace")
    where = key if not grant.range_end else f"{key}*"
    return f"{grant.perm.name.lower()} {where}"
