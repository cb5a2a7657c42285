"""What an etcd identity may do, asked of a real etcd (with :mod:`tests.etcd_fixtures`' ``secure_etcd``)."""

from __future__ import annotations

from contracts.etcd import EtcdSettings
from runtime.etcd import ETCD_ERRORS, connect


async def may_put(settings: EtcdSettings, key: str, value: bytes) -> bool:
    """Whether ``settings``' identity may put ``key`` (etcd answers permission denied otherwise)."""
    client = await connect(settings)
    try:
        assert client.kv is not None
        try:
            await client.kv.put(key, value, timeout=5.0, max_attempts=1)
        except ETCD_ERRORS as exc:
            assert "permission denied" in str(exc).lower() or "PERMISSION_DENIED" in str(exc), exc
            return False
        return True
    finally:
        await client.close()
