from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from extproc.config import parse_config
from extproc.server import Gateway


@asynccontextmanager
async def gateway_on(addresses: Sequence[str]) -> AsyncIterator[Gateway]:
    """A started Gateway (ephemeral ports, no metrics) whose static fleet is ``e0``, ``e1``, ... at
    ``addresses``, serving model ``m``."""
    config = parse_config(
        {
            "extproc": {"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "metrics_listen": ""},
            "endpoints": [{"id": f"e{i}", "address": a, "models": ["m"]} for i, a in enumerate(addresses)],
        }
    )
    gw = Gateway(config)
    await gw.start()
    try:
        yield gw
    finally:
        await gw.aclose(grace_s=0)
