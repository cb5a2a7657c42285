"""Cross-cluster fetch (issue 22): another cluster's kvcached is asked only after every local peer
missed, only when ``[remote] allow``, and within its own byte budget; the policy alone, its config, and
the service with a stand-in peer client (the QUIC protocol itself: tests/kvcached/test_peers.py)."""

from __future__ import annotations

import pytest

from contracts.kvcached import GetRequest, StatsRequest
from kvcached.config import parse_kvcached_config
from kvcached.errors import KvcachedConfigError
from kvcached.remote import RemoteFetchPolicy
from kvcached.service import KvcachedService
from kvcached.tiers import TieredStore
from tests.kvcached.test_service import FakePeers, digest


def test_the_budget_allows_while_not_in_debt() -> None:
    p = RemoteFetchPolicy(True, fetch_bytes_per_s=100.0, burst_bytes=100.0, now=0.0)
    assert p.may_fetch(0.0)
    p.charge(250, 0.0)  # a block larger than what was left: debt of 150 bytes
    assert not p.may_fetch(1.0)  # 1 s repays 100
    assert p.may_fetch(1.6)  # 1.5 s repays 150: positive again
    assert p.bytes == 250 and p.refused == 1
    assert not RemoteFetchPolicy(False, 100.0, 100.0, 0.0).may_fetch(0.0)


def test_config() -> None:
    tls = {"cert": "c.pem", "key": "c.key", "ca": "ca.pem"}
    node = {"node": "n", "ram_bytes": 1024, "tls": tls, "listen_unix": "/tmp/kvc.sock"}
    base = {"kvcached": node, "quic": {"listen": "127.0.0.1:0"}}
    cfg = parse_kvcached_config(
        {
            **base,
            "remote": {
                "allow": True,
                "fetch_bytes_per_s": 1e6,
                "peers": [{"cluster": "eu", "address": "10.1.0.8:4433"}],
            },
        }
    )
    assert cfg.remote is not None and cfg.remote.allow and cfg.remote.peers[0].cluster == "eu"
    with pytest.raises(KvcachedConfigError, match="fetch_bytes_per_s"):
        parse_kvcached_config({**base, "remote": {"allow": True}})
    with pytest.raises(KvcachedConfigError, match="needs \\[quic\\]"):
        parse_kvcached_config(
            {"kvcached": base["kvcached"], "remote": {"allow": True, "fetch_bytes_per_s": 1.0}}
        )
    with pytest.raises(KvcachedConfigError, match="address"):
        parse_kvcached_config({**base, "remote": {"peers": [{"cluster": "eu", "address": "nope"}]}})


def service(
    peers: FakePeers, allow: bool = True, rate: float = 1000.0
) -> tuple[KvcachedService, TieredStore, list[float]]:
    store = TieredStore(1 << 20, None, 0)
    clock = [0.0]
    policy = RemoteFetchPolicy(allow, rate, max(rate, 10.0), 0.0)
    svc = KvcachedService(
        store,
        peer_client=peers,  # type: ignore[arg-type]
        peers=lambda: ["local:1"],
        remote_peers=("remote:1",),
        remote=policy,
        clock=lambda: clock[0],
    )
    return svc, store, clock


async def test_an_intra_cluster_copy_is_preferred() -> None:
    peers = FakePeers({"local:1": {digest(1): b"near"}, "remote:1": {digest(1): b"far"}})
    svc, store, _ = service(peers)
    reply = await svc.get(GetRequest(digest(1)))
    assert (reply.data, reply.source) == (b"near", "peer")
    assert [a for a, _ in peers.calls] == ["local:1"]  # the other cluster never asked
    assert svc.remote_counters == {"hits": 0, "misses": 0, "refused": 0, "bytes": 0}
    store.close()


async def test_a_local_miss_goes_to_the_other_cluster_within_budget() -> None:
    blob = b"x" * 600
    peers = FakePeers({"local:1": {}, "remote:1": {digest(1): blob, digest(2): blob, digest(3): blob}})
    svc, store, clock = service(peers, rate=1000.0)  # burst 1,000 bytes
    assert (await svc.get(GetRequest(digest(1)))).data == blob  # 400 left
    assert (await svc.get(GetRequest(digest(2)))).data == blob  # -200: in debt
    assert (await svc.get(GetRequest(digest(3)))).data is None  # refused by the budget
    assert svc.remote_counters == {"hits": 2, "misses": 0, "refused": 1, "bytes": 1200}
    clock[0] = 0.5  # 500 bytes repaid: 300
    assert (await svc.get(GetRequest(digest(3)))).data == blob
    assert store.tier_of(digest(3)) == "ram"
    assert (await svc.stats(StatsRequest())).stats["remote_hits"] == 3
    store.close()


async def test_not_allowed_means_never() -> None:
    peers = FakePeers({"local:1": {}, "remote:1": {digest(1): b"far"}})
    svc, store, _ = service(peers, allow=False)
    assert (await svc.get(GetRequest(digest(1)))).data is None
    assert [a for a, _ in peers.calls] == ["local:1"]
    assert svc.remote_counters["refused"] == 1
    store.close()


async def test_concurrent_misses_stay_within_the_budget() -> None:
    """The budget's bound (``rate x window + burst + one block``) holds for misses that arrive together:
    a fetch in flight holds one largest block of the budget, so the others do not all start while the
    bucket still looks full."""
    import asyncio

    blob = b"x" * 600
    peers = FakePeers({"local:1": {}, "remote:1": {digest(i): blob for i in range(10)}}, delay_s=0.01)
    svc, store, _clock = service(peers, rate=1000.0)  # burst 1,000 bytes
    replies = await asyncio.gather(*(svc.get(GetRequest(digest(i))) for i in range(10)))
    assert svc.remote_counters["bytes"] <= 1000 + 600
    assert svc.remote_counters["hits"] == sum(r.data is not None for r in replies) >= 1
    assert svc.remote_counters["hits"] + svc.remote_counters["refused"] == 10
    store.close()
