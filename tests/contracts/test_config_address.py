"""``contracts.config.ip_port``: the one parser of an endpoint's ``ip:port``, read by the canonical form,
EDS's socket and the pool's socket key (each must agree on what is an IP literal)."""

from __future__ import annotations

import ipaddress

import pytest

from contracts.config import canonical_address, ip_port
from extproc.inferencepool.merge import socket_key
from extproc.xds.eds import socket_address


@pytest.mark.parametrize(
    ("address", "ip", "port"),
    [
        ("10.0.0.2:8000", "10.0.0.2", "8000"),
        ("[10.0.0.2]:8000", "10.0.0.2", "8000"),
        ("[FD00:0::1]:8000", "fd00::1", "8000"),
        ("[::ffff:10.0.0.2]:80", "::ffff:10.0.0.2", "80"),
    ],
)
def test_an_ip_literal_is_parsed_bracketed_or_not(address: str, ip: str, port: str) -> None:
    assert ip_port(address) == (ipaddress.ip_address(ip), port)


@pytest.mark.parametrize("address", ["engine.local:8000", "[engine]:80", "[fd00::1]", "no-port"])
def test_a_name_is_no_ip_literal_for_any_reader(address: str) -> None:
    assert ip_port(address) is None
    assert canonical_address(address) == address
    assert socket_key(address) == address
    assert socket_address(address) is None


def test_the_three_readers_agree_on_one_socket() -> None:
    spellings = ["[FD00:0::1]:8000", "[fd00::1]:8000", "[fd00:0000:0000:0000:0000:0000:0000:0001]:8000"]
    assert {canonical_address(a) for a in spellings} == {"[fd00::1]:8000"}
    assert {socket_key(a) for a in spellings} == {"[fd00::1]:8000"}
    assert {socket_address(a) for a in spellings} == {("fd00::1", 8000)}
    # the pool's key goes one step further: an IPv4-mapped address is its IPv4 socket
    assert socket_key("[::ffff:10.0.0.2]:80") == socket_key("10.0.0.2:80") == "10.0.0.2:80"
    assert canonical_address("[::ffff:10.0.0.2]:80") == "[::ffff:10.0.0.2]:80"
