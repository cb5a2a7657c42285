"""How a cluster reaches a host the operator named: an IP literal as it is (``STATIC``), a name resolved
by DNS (``STRICT_DNS``: every address the name has is kept)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable


def is_ip(host: str) -> bool:
    """Whether ``host`` is an IP literal (no brackets)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def cluster_type(hosts: Iterable[str]) -> str:
    """``STATIC`` for addresses only, else ``STRICT_DNS``."""
    return "STATIC" if all(is_ip(h) for h in hosts) else "STRICT_DNS"
