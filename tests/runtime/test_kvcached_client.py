"""runtime.kvcached: the client's error contract against a stand-in daemon (gRPC on 127.0.0.1:0)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from contracts.kvcached import SERVICE, KvcachedError
from runtime.kvcached import KvcachedClient


async def test_a_reply_that_does_not_decode_is_a_kvcached_error() -> None:
    """A daemon of another build answering a shape this client does not read: ``KvcachedError`` (the
    documented "any other failure"), not msgspec's own exception."""

    async def stats(request: bytes, context: Any) -> bytes:
        return b"\x93\x01\x02"  # msgpack, but not a StatsReply

    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Stats": grpc.unary_unary_rpc_method_handler(stats)}
    )
    server = grpc.aio.server(handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = KvcachedClient(f"127.0.0.1:{port}", timeout_s=5)
    try:
        with pytest.raises(KvcachedError):
            await client.stats()
    finally:
        await client.aclose()
        await server.stop(0)
