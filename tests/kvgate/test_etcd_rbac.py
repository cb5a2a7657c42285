"""kvgate.etcdsec.rbac: the users, roles and key ranges each identity gets (pure)."""

from __future__ import annotations

import pytest

from contracts.errors import ConfigError
from kvgate.etcdsec.rbac import Grant, Perm, plan, prefix_end


def test_prefix_end_is_etcds_prefix_range_end() -> None:
    assert prefix_end(b"/kvgate/endpoints/node-a/") == b"/kvgate/endpoints/node-a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff") == b"\x00"


def _grants(identities: list[str], user: str) -> set[tuple[str, str, Perm]]:
    p = plan("/kvgate/", identities)
    (u,) = [u for u in p.users if u.name == user]
    (role_name,) = u.roles
    (role,) = [r for r in p.roles if r.name == role_name]
    return {(g.key.decode(), g.range_end.decode(), g.perm) for g in role.grants}


def test_each_identity_gets_its_own_ranges() -> None:
    ids = ["extproc", "extproc-1", "operator-bob", "agent-node-a", "kvcached-node-a", "agent"]
    p = plan("/kvgate/", ids)
    assert {u.name for u in p.users} == {*ids, "root"}
    assert _grants(ids, "agent-node-a") == {
        ("/kvgate/endpoints/node-a/", "/kvgate/endpoints/node-a0", Perm.READWRITE),
        ("/kvgate/policy/", "/kvgate/policy0", Perm.READ),
    }
    assert _grants(ids, "agent") == {
        ("/kvgate/endpoints/", "/kvgate/endpoints0", Perm.READWRITE),
        ("/kvgate/policy/", "/kvgate/policy0", Perm.READ),
    }
    assert (
        _grants(ids, "extproc")
        == _grants(ids, "extproc-1")
        == {
            ("/kvgate/", "/kvgate0", Perm.READ),
            ("/kvgate/usage/", "/kvgate/usage0", Perm.READWRITE),
        }
    )
    assert _grants(ids, "kvcached-node-a") == {
        ("/kvgate/kvcached/node-a", "", Perm.READWRITE),
        ("/kvgate/kvcached/", "/kvgate/kvcached0", Perm.READ),
    }
    operator = _grants(ids, "operator-bob")
    written = {key for key, _, perm in operator if perm is Perm.READWRITE}
    assert written == {
        f"/kvgate/{f}/"
        for f in ("policy", "models", "objectives", "tenants", "federation", "burst", "drain", "audit")
    }
    assert Grant(b"/kvgate/endpoints/", b"/kvgate/endpoints0", Perm.READWRITE) not in {
        g for r in p.roles if r.name == "kvgate-operator" for g in r.grants
    }


@pytest.mark.parametrize(
    ("identity", "message"),
    [
        ("engine-gpu0", "has no business in etcd"),
        ("envoy-edge", "has no business in etcd"),
        ("kvcached", "needs its node"),
        ("Agent-A", "bad service name"),
    ],
)
def test_identities_without_an_etcd_role_are_refused(identity: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan("/kvgate/", [identity])


def test_the_prefix_must_be_a_directory() -> None:
    with pytest.raises(ConfigError, match="start and end with '/'"):
        plan("/kvgate", ["extproc"])
