"""extproc.etcd: settings, keys, the endpoint codec, and leased keys against a real etcd."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import etcd3aio
import pytest

from extproc.errors import ConfigError
from extproc.etcd import (
    ETCD_ERRORS,
    EtcdSettings,
    LeasedKeys,
    connect,
    decode_endpoint,
    drain_key,
    encode_endpoint,
    endpoint_key,
    parse_etcd_settings,
    policy_key,
    policy_path,
    split_key,
)
from extproc.fleet import Endpoint, EndpointId
from kvgate.etcdserver import TEST_TTL_S, EtcdServer, ServerTls

pytest_plugins = ("tests.etcd_fixtures",)

# -- settings -------------------------------------------------------------------------------------------


def test_settings_defaults() -> None:
    assert parse_etcd_settings({}, "etcd") == EtcdSettings()


def test_settings_full() -> None:
    raw = {
        "endpoints": ["10.0.0.1:2379", "10.0.0.2:2379"],
        "prefix": "/team/",
        "tls_ca": "ca.pem",
        "tls_cert": "c.pem",
        "tls_key": "k.pem",
        "tls_server_name": "etcd.local",
        "timeout_s": 0.5,
    }
    settings = parse_etcd_settings(raw, "etcd")
    assert settings.endpoints == ("10.0.0.1:2379", "10.0.0.2:2379")
    assert (settings.prefix, settings.tls_server_name, settings.timeout_s) == ("/team/", "etcd.local", 0.5)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"endpoint": ["a:1"]}, "unknown key(s) endpoint"),
        ({"endpoints": []}, "non-empty list"),
        ({"endpoints": ["nohost"]}, "expected host:port"),
        ({"endpoints": "a:1"}, "expected list"),
        ({"prefix": "/kvgate"}, "must end with '/'"),
        ({"tls_cert": "c.pem", "tls_ca": "ca.pem"}, "set all of tls_cert, tls_key"),
        ({"tls_cert": "c.pem", "tls_key": "k.pem"}, "needs tls_ca"),
        ({"timeout_s": 0}, "must be a finite number"),
        ("x", "expected a table"),
    ],
)
def test_settings_refused(raw: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_etcd_settings(raw, "etcd")


async def test_connect_reports_missing_tls_file(tmp_path: Path) -> None:
    settings = EtcdSettings(tls_ca=str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="tls_ca"):
        await connect(settings)


# -- keys -----------------------------------------------------------------------------------------------


def test_keys() -> None:
    assert endpoint_key("/kvgate/", "vllm-0") == "/kvgate/endpoints/vllm-0"
    assert drain_key("/p/", "x") == "/p/drain/x"
    assert policy_key("/kvgate/", "weights/prefix") == "/kvgate/policy/weights/prefix"
    assert policy_key("/kvgate/", "models/org/model") == "/kvgate/models/org/model"
    with pytest.raises(ConfigError):
        endpoint_key("/kvgate/", "")


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("/kvgate/endpoints/a", ("endpoints", "a")),
        (b"/kvgate/policy/weights/prefix", ("policy", "weights/prefix")),
        ("/kvgate/models/org/m", ("models", "org/m")),
        ("/other/endpoints/a", None),
        ("/kvgate/endpoints/", None),
        ("/kvgate/endpoints", None),
    ],
)
def test_split_key(key: str | bytes, expected: tuple[str, str] | None) -> None:
    assert split_key("/kvgate/", key) == expected


def test_policy_path() -> None:
    assert policy_path("policy", "weights/prefix") == "weights/prefix"
    assert policy_path("models", "org/m") == "models/org/m"
    assert policy_path("policy", "models/x") is None  # would shadow the models/ family
    assert policy_path("drain", "x") is None


# -- endpoint codec -------------------------------------------------------------------------------------

FULL = Endpoint(
    id=EndpointId("node1-gpu0"),
    address="10.0.0.7:8000",
    models=frozenset({"m1", "m2"}),
    engine="sglang",
    metrics_url="http://10.0.0.7:8000/metrics",
    labels=(("pool", "a"), ("zone", "z1")),
    role="prefill",
    node="node1",
    feed="10.0.0.7:5557",
    kv_events=True,
    block_size=16,
    capacity_blocks=40000,
)
MINIMAL = Endpoint(id=EndpointId("e"), address="127.0.0.1:1", models=frozenset({"m"}))


@pytest.mark.parametrize("endpoint", [FULL, MINIMAL], ids=["full", "minimal"])
def test_codec_round_trip(endpoint: Endpoint) -> None:
    value = encode_endpoint(endpoint)
    assert decode_endpoint(endpoint.id, value) == endpoint
    assert set(json.loads(value)) == {
        "id", "address", "models", "engine", "role", "node", "feed", "kv_events", "metrics_url",
        "block_size", "capacity_blocks", "labels",
    }  # fmt: skip


def test_codec_slot_restore_round_trip() -> None:
    url = "http://10.0.0.7:7400/slots/restore-chain"
    endpoint = dataclasses.replace(FULL, engine="llama_cpp", slot_restore=url)
    value = encode_endpoint(endpoint)
    assert json.loads(value)["slot_restore"] == url
    assert decode_endpoint(endpoint.id, value) == endpoint
    assert "slot_restore" not in json.loads(encode_endpoint(FULL))  # absent when not offered
    assert decode_endpoint(FULL.id, _with(slot_restore=None)).slot_restore is None
    with pytest.raises(ConfigError, match="slot_restore: expected an http"):
        decode_endpoint(FULL.id, _with(slot_restore="unix:/run/agent.sock"))


def test_decode_accepts_defaults() -> None:
    endpoint = decode_endpoint("e", b'{"id": "e", "address": "h:1", "models": ["m"]}')
    assert (endpoint.engine, endpoint.role, endpoint.kv_events) == ("vllm", "both", False)
    assert endpoint.feed is None and endpoint.labels == ()


def _with(**changes: object) -> bytes:
    doc = json.loads(encode_endpoint(FULL))
    for key, value in changes.items():
        if value is _DROP:
            del doc[key]
        else:
            doc[key] = value
    return json.dumps(doc).encode()


_DROP = object()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1]", "expected a table"),
        (_with(id="other"), "does not match the key"),
        (_with(address=_DROP), "address: required"),
        (_with(address="10.0.0.7"), "expected host:port"),
        (_with(models=[]), "non-empty list of model names"),
        (_with(models=["ok", 3]), "non-empty list of model names"),
        (_with(engine="tgi"), "engine: expected one of"),
        (_with(role="both-ways"), "role: expected one of"),
        (_with(feed="nowhere"), "feed: expected host:port"),
        (_with(kv_events="yes"), "kv_events: expected bool"),
        (_with(block_size=0), "block_size: must be >= 1"),
        (_with(block_size="16"), "block_size: expected int"),
        (_with(capacity_blocks=True), "capacity_blocks: expected int, got bool"),
        (_with(labels={"pool": 1}), "labels.pool: expected str"),
        (_with(metrics_url=5), "metrics_url: expected str"),
        (_with(extra=1), "unknown key"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_decode_refuses(value: bytes, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        decode_endpoint("node1-gpu0", value)
    assert str(info.value).startswith("endpoints/node1-gpu0")


# -- leased keys (real etcd) ----------------------------------------------------------------------------


async def _until(condition: Callable[[], Awaitable[bool]], timeout_s: float) -> float:
    """Poll ``condition`` until true; the seconds it took (fails after ``timeout_s``)."""
    started = time.monotonic()
    while not await condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def _value(client: etcd3aio.Etcd3Client, key: str) -> bytes | None:
    assert client.kv is not None
    response = await client.kv.get(key, timeout=2.0)
    return bytes(response.kvs[0].value) if response.kvs else None


async def test_leased_keys_put_update_delete_revoke(
    etcd_client: etcd3aio.Etcd3Client, etcd_prefix: str
) -> None:
    a, b = etcd_prefix + "endpoints/a", etcd_prefix + "endpoints/b"
    keys = LeasedKeys(etcd_client, TEST_TTL_S)
    assert await keys.start({a: b"1", b: b"2"})
    assert keys.registered and keys.lease_id is not None
    assert await _value(etcd_client, a) == b"1"
    assert etcd_client.kv is not None
    stored = await etcd_client.kv.get(a)
    assert stored.kvs[0].lease == keys.lease_id
    assert await keys.update(a, b"1b")
    assert await _value(etcd_client, a) == b"1b"
    await keys.delete(b)
    assert await _value(etcd_client, b) is None
    await keys.aclose()
    assert await _value(etcd_client, a) is None  # revoked: gone at once


async def test_leased_keys_vanish_within_ttl_when_renewal_stops(
    etcd_client: etcd3aio.Etcd3Client, etcd_prefix: str
) -> None:
    key = etcd_prefix + "endpoints/dead"
    keys = LeasedKeys(etcd_client, TEST_TTL_S)
    assert await keys.start({key: b"x"})
    await keys.aclose(revoke=False)  # the agent died

    async def gone() -> bool:
        return await _value(etcd_client, key) is None

    elapsed = await _until(gone, TEST_TTL_S + 2.0)
    assert elapsed <= TEST_TTL_S + 1.0


async def test_leased_keys_register_again_when_the_lease_is_lost(
    etcd_client: etcd3aio.Etcd3Client, etcd_prefix: str
) -> None:
    key = etcd_prefix + "endpoints/e"
    keys = LeasedKeys(etcd_client, TEST_TTL_S)
    assert await keys.start({key: b"v"})
    first = keys.lease_id
    assert first is not None and etcd_client.lease is not None
    await etcd_client.lease.revoke(first)  # as if it had expired during an outage
    assert await _value(etcd_client, key) is None

    async def back() -> bool:
        return await _value(etcd_client, key) == b"v"

    await _until(back, TEST_TTL_S + 2.0)
    assert keys.lease_id not in (None, first)
    assert keys.counters["lost"] == 1
    await keys.aclose()


async def test_leased_keys_survive_an_etcd_restart(etcd_outage_server: EtcdServer) -> None:
    server = etcd_outage_server
    client = await connect(EtcdSettings(endpoints=(server.address,), timeout_s=1.0))
    key = "/kvgate/endpoints/survivor"
    keys = LeasedKeys(client, TEST_TTL_S, timeout_s=1.0)
    try:
        assert await keys.start({key: b"v"})

        async def unregistered() -> bool:
            return not keys.registered

        async def registered() -> bool:
            return keys.registered and await _value(client, key) == b"v"

        server.stop()  # outage: same data comes back
        await _until(unregistered, 5.0)
        assert await keys.update(key, b"v") is False  # not reachable now: re-put later
        server.start()
        await _until(registered, 5.0)
        assert keys.counters["lost"] == 0

        server.stop()  # the cluster comes back empty: the lease is gone, the keys are put again
        await _until(unregistered, 5.0)
        server.wipe()
        server.start()
        await _until(registered, 5.0)
        assert keys.counters["lost"] == 1

        server.stop()  # an agent that starts while etcd is down registers once it is up
        late_key = "/kvgate/endpoints/late"
        late = LeasedKeys(client, TEST_TTL_S, timeout_s=1.0)
        try:
            assert not await late.start({late_key: b"l"})
            server.start()

            async def late_registered() -> bool:
                return late.registered and await _value(client, late_key) == b"l"

            await _until(late_registered, 5.0)
        finally:
            await late.aclose()
    finally:
        await keys.aclose()
        await client.close()


async def test_connect_with_mutual_tls(tmp_path: Path) -> None:
    import datetime as dt

    from certs.store import dev_bundle

    bundle = dev_bundle(tmp_path / "certs", ["engine-etcd", "agent"], dt.datetime.now(dt.UTC))
    server_files, agent = bundle["engine-etcd"], bundle["agent"]
    tls = ServerTls(server_files.ca, server_files.cert, server_files.key, agent.cert, agent.key)
    with EtcdServer(tmp_path / "etcd", tls=tls) as server:
        settings = EtcdSettings(
            endpoints=(server.address,),
            tls_ca=str(agent.ca),
            tls_cert=str(agent.cert),
            tls_key=str(agent.key),
            timeout_s=2.0,
        )
        client = await connect(settings)
        try:
            keys = LeasedKeys(client, TEST_TTL_S)
            assert await keys.start({"/kvgate/endpoints/tls": b"v"})
            assert await _value(client, "/kvgate/endpoints/tls") == b"v"
            await keys.aclose()
        finally:
            await client.close()
        no_cert = EtcdSettings(endpoints=(server.address,), tls_ca=str(agent.ca), timeout_s=1.0)
        anonymous = await connect(no_cert)
        try:
            with pytest.raises(ETCD_ERRORS):
                await _value(anonymous, "/kvgate/endpoints/tls")
        finally:
            await anonymous.close()
