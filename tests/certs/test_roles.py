"""certs.roles: the who-may-call-whom matrix of issue 26.1 and the identity URIs it reads."""

from __future__ import annotations

import pytest

from certs.authority import identity_uri
from certs.roles import (
    AGENT_ADMIN,
    CALLERS,
    ENGINE,
    EXTPROC,
    FEED,
    KVCACHED_API,
    KVCACHED_PEERS,
    permits,
    role_of_uri,
)


@pytest.mark.parametrize(
    ("uri", "role"),
    [
        ("spiffe://kvgate.local/engine", "engine"),
        ("spiffe://kvgate.local/engine-gpu3", "engine"),
        ("spiffe://kvgate.local/envoy-edge", "envoy-edge"),
        ("spiffe://kvgate.local/envoy-edge-2", "envoy-edge"),
        ("spiffe://kvgate.local/operator-alice", "operator"),
        ("spiffe://kvgate.local/client-alice", "client"),
        ("spiffe://kvgate.local/client", None),  # an API client needs a suffix
        ("spiffe://kvgate.local/envoy", None),  # not a role
        ("spiffe://kvgate.local/extprocx", None),
        ("spiffe://kvgate.local/Engine", None),
        ("spiffe://kvgate.local/engine\n", None),
        ("spiffe://kvgate.local/engine/x", None),
        ("spiffe://kvgate.local/engine?x=1", None),
        ("spiffe://kvgate.local/", None),
        ("spiffe://other.domain/engine", None),  # another trust domain
        ("spiffe://kvgate.local.evil/engine", None),
        ("https://kvgate.local/engine", None),
        ("SPIFFE://kvgate.local/engine", None),
        ("", None),
    ],
)
def test_role_of_uri(uri: str, role: str | None) -> None:
    assert role_of_uri(uri) == role


@pytest.mark.parametrize(
    ("name", "role"),
    [
        ("agent", "agent"),
        ("agent-node-0", "agent"),
        ("kvcached-node-1", "kvcached"),
        ("client-dev", "client"),
    ],
)
def test_role_of_uri_reads_what_the_authority_writes(name: str, role: str) -> None:
    assert role_of_uri(identity_uri(name)) == role


MATRIX = {  # issue 26.1, as the module docstring's table states it
    ENGINE: {"envoy-edge", "extproc", "agent"},
    FEED: {"extproc"},
    AGENT_ADMIN: {"extproc", "operator"},
    KVCACHED_PEERS: {"kvcached"},
    KVCACHED_API: {"agent", "operator"},
    EXTPROC: {"envoy-edge"},
}
ROLES = ("envoy-edge", "extproc", "agent", "kvcached", "engine", "oidc", "operator", "client")


def test_callers_matrix() -> None:
    assert {hop: set(roles) for hop, roles in CALLERS.items()} == MATRIX
    with pytest.raises(TypeError):
        CALLERS[ENGINE] = frozenset()  # type: ignore[index]


@pytest.mark.parametrize("hop", sorted(MATRIX))
@pytest.mark.parametrize("role", ROLES)
def test_permits_by_role_whatever_the_suffix(hop: str, role: str) -> None:
    allowed = role in MATRIX[hop]
    assert permits(hop, [identity_uri(f"{role}-x1")]) is allowed
    if role != "client":
        assert permits(hop, [identity_uri(role)]) is allowed


def test_permits_needs_one_allowed_identity() -> None:
    assert not permits(ENGINE, [])
    assert not permits(ENGINE, ["spiffe://other.domain/extproc", "URI:spiffe://kvgate.local/extproc"])
    assert permits(ENGINE, ["spiffe://other.domain/extproc", identity_uri("extproc-0")])
    assert permits(FEED, [identity_uri("engine"), identity_uri("extproc")])  # any allowed URI will do


def test_unknown_hop_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        permits("etcd", [identity_uri("extproc")])


def test_issue_help_names_every_service_it_takes(capsys: pytest.CaptureFixture[str]) -> None:
    """The README issues root, etcd and operator-NAME certificates: --help must not leave them out."""
    from certs.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["issue", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ("envoy-edge", "oidc", "operator", "etcd", "root", "federation", "client-NAME"):
        assert name in text
