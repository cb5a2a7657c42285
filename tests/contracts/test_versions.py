"""contracts.versions: the compatibility rule, and how a feed batch, an endpoint record and a kvcached
record of an older and a newer version are read (in memory; tests/extproc/control/test_plane_versions.py
reads them from a real etcd and over a real gRPC feed, tests/kvcached/test_daemon.py a real daemon's)."""

from __future__ import annotations

import json

import msgspec
import pytest
from blake3 import blake3

from contracts.digest import DIGEST_BYTES, chain_seed
from contracts.errors import ConfigError
from contracts.etcd import PeerInfo, decode_peer, encode_peer, peer_skew
from contracts.events import Batch, Cleared, Load, Stored, batch_skew, decode_batch_skewed, encode
from contracts.versions import (
    DIGEST_VERSION,
    FEED_VERSION,
    KVCACHED_RECORD_VERSION,
    RECORD_VERSION,
    Skew,
    SkewLog,
    digest_matches,
    skew,
)
from engines.endpoint import Endpoint, decode_endpoint, decode_record, encode_endpoint

D1, D2 = b"\x01" * DIGEST_BYTES, b"\x02" * DIGEST_BYTES


def test_rule_accepts_the_previous_and_the_current_version() -> None:
    assert [skew(v, 5) for v in (3, 4, 5, 6)] == [Skew.TOO_OLD, Skew.OK, Skew.OK, Skew.NEWER]
    assert digest_matches(DIGEST_VERSION) and not digest_matches(DIGEST_VERSION + 1)


def test_skew_is_logged_once_per_source_and_version_and_counted_every_time() -> None:
    skews = SkewLog()
    assert skews.note("feed", "10.0.0.1:7000", 3, "ignored") is not None
    assert skews.note("feed", "10.0.0.1:7000", 3, "ignored") is None
    assert skews.note("feed", "10.0.0.2:7000", 3, "ignored") is not None
    assert skews.counts == {"feed": 3}


def test_the_digest_seed_carries_its_version() -> None:
    material = f"kvgate-v{DIGEST_VERSION}\x00m\x00\x00".encode()
    assert chain_seed("m") == blake3(material).digest(DIGEST_BYTES)


# -- feed batches -------------------------------------------------------------------------------------


class _LegacyBatch(msgspec.Struct, array_like=True, frozen=True):
    """A batch as a sender older than the version fields wrote it."""

    source: str
    epoch: int
    seq: int
    events: list[Stored | Load]
    snapshot: bool = False
    ts: float = 0.0


class Future(msgspec.Struct, tag="future", array_like=True, frozen=True):
    """An event kind a newer feed version might add."""

    endpoint: str
    what: str


class _NewerBatch(msgspec.Struct, array_like=True, frozen=True):
    source: str
    epoch: int
    seq: int
    events: list[Stored | Load | Future]
    snapshot: bool = False
    ts: float = 0.0
    version: int = FEED_VERSION + 1
    digest: int = DIGEST_VERSION
    extra: str = "a field of the next version"


def test_a_batch_of_the_previous_version_is_applied_as_is() -> None:
    raw = msgspec.msgpack.encode(_LegacyBatch("node-a", 1, 2, [Stored("e", [D1]), Load("e", 1, 2)]))
    batch = decode_batch_skewed(raw)
    assert (batch.version, batch.digest) == (1, 1) and FEED_VERSION - 1 == 1
    assert batch_skew(batch) is Skew.OK
    assert batch.events == [Stored("e", [D1]), Load("e", 1, 2)]


def test_a_batch_of_the_current_version_round_trips() -> None:
    batch = Batch("node-a", 1, 2, [Stored("e", [D1])], version=FEED_VERSION, digest=DIGEST_VERSION)
    assert decode_batch_skewed(encode(batch)) == batch


def test_a_newer_batch_keeps_its_loads_and_drops_its_kv_data() -> None:
    newer = _NewerBatch("node-a", 1, 2, [Stored("e", [D1]), Future("e", "?"), Load("e", 3, 4)])
    batch = decode_batch_skewed(msgspec.msgpack.encode(newer))
    assert batch.version == FEED_VERSION + 1 and batch_skew(batch) is Skew.NEWER
    assert batch.events == [Load("e", 3, 4)]
    assert (batch.source, batch.epoch, batch.seq) == ("node-a", 1, 2)  # sequence checks still work


def test_a_newer_snapshot_clears_what_the_receiver_held() -> None:
    newer = _NewerBatch("node-a", 1, 2, [Stored("e", [D1]), Load("f", 1, 0)], snapshot=True)
    batch = decode_batch_skewed(msgspec.msgpack.encode(newer))
    assert batch.snapshot and batch.events == [Cleared("e"), Cleared("f"), Load("f", 1, 0)]


def test_digests_of_another_digest_version_are_never_applied() -> None:
    batch = Batch(
        "n", 1, 2, [Stored("e", [D1]), Load("e", 0, 0)], version=FEED_VERSION, digest=DIGEST_VERSION + 1
    )
    seen = decode_batch_skewed(encode(batch))
    assert batch_skew(batch) is Skew.NEWER and seen.events == [Load("e", 0, 0)]


def test_a_malformed_batch_of_a_readable_version_is_still_an_error() -> None:
    from contracts.events import EventError

    bad = Batch("n", 1, 2, [Stored("e", [b"short"])], version=FEED_VERSION)
    with pytest.raises(EventError, match="digest of 5 bytes"):
        decode_batch_skewed(encode(bad))


# -- endpoint records ---------------------------------------------------------------------------------

EP = Endpoint(
    id="vllm-0",  # type: ignore[arg-type]
    address="10.0.0.7:8000",
    models=frozenset({"m"}),
    node="node-a",
    feed="10.0.0.7:7000",
    kv_events=True,
    slot_restore="http://10.0.0.7:7400/slots/restore-chain",
)


def _doc(**changes: object) -> bytes:
    doc = json.loads(encode_endpoint(EP))
    doc.update(changes)
    return json.dumps({k: v for k, v in doc.items() if v is not None}).encode()


def test_records_carry_their_schema_and_digest_version() -> None:
    doc = json.loads(encode_endpoint(EP))
    assert (doc["schema"], doc["digest"]) == (RECORD_VERSION, DIGEST_VERSION)
    assert decode_endpoint("node-a/vllm-0", encode_endpoint(EP)) == EP


def test_a_record_of_the_previous_version_under_the_old_key_is_read_as_written() -> None:
    legacy = _doc(schema=None, digest=None)  # what agents wrote before versions: no fields, flat key
    decoded = decode_record("vllm-0", legacy)
    assert decoded.endpoint == EP and decoded.skew is None


def test_a_newer_record_joins_without_its_kv_data() -> None:
    decoded = decode_record("node-a/vllm-0", _doc(schema=RECORD_VERSION + 1, cache_tiers=["hbm", "cxl"]))
    assert decoded.endpoint is not None and not decoded.refused
    assert decoded.endpoint.address == EP.address and decoded.endpoint.models == EP.models
    assert not decoded.endpoint.kv_events and decoded.endpoint.slot_restore is None  # load-only for it
    assert decoded.skew is not None and "newer" in decoded.skew
    with pytest.raises(ConfigError, match="newer"):  # the strict reader refuses it loudly
        decode_endpoint("node-a/vllm-0", _doc(schema=RECORD_VERSION + 1))


def test_a_record_of_another_digest_version_joins_without_its_kv_data() -> None:
    decoded = decode_record("node-a/vllm-0", _doc(digest=DIGEST_VERSION + 1))
    assert decoded.endpoint is not None and not decoded.endpoint.kv_events
    assert decoded.skew is not None and "digest version" in decoded.skew


def test_a_record_of_the_current_version_with_an_unknown_field_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown key"):
        decode_record("node-a/vllm-0", _doc(cache_tiers=["hbm"]))


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("node-b/vllm-0", _doc(), "node: 'node-a' does not match the key"),
        ("node-a/vllm-1", _doc(), "does not match the key"),
        ("a/b/vllm-0", _doc(), "expected endpoints/<node>/<id>"),
        ("node-a/vllm-0", _doc(schema="2"), "schema: expected a positive integer"),
        ("node-a/vllm-0", _doc(digest=0), "digest: expected a positive integer"),
    ],
)
def test_records_that_do_not_match_their_key_or_version_rules_are_refused(
    name: str, value: bytes, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        decode_record(name, value)


# -- kvcached/<node> records ----------------------------------------------------------------------------

PEER = PeerInfo("node-a", "10.0.0.7:7300", "10.0.0.7:4433", "10.0.0.7:7301")


def _peer(**changes: object) -> bytes:
    doc = json.loads(encode_peer(PEER)) | changes
    return json.dumps({k: v for k, v in doc.items() if v is not ...}).encode()


def test_a_kvcached_record_carries_its_schema_and_round_trips() -> None:
    raw = encode_peer(PEER)
    assert json.loads(raw)["schema"] == KVCACHED_RECORD_VERSION == 2
    assert decode_peer("node-a", raw) == PEER and peer_skew(PEER) is None


def test_a_kvcached_record_of_the_previous_version_is_used() -> None:
    """What daemons wrote before the field (and before ``digest``): version 1, read as written."""
    legacy = decode_peer("node-a", _peer(schema=..., digest=...))
    assert (legacy.schema, legacy.digest, legacy.quic) == (1, 1, PEER.quic)
    assert peer_skew(legacy) is None


def test_a_newer_kvcached_record_is_read_and_not_used() -> None:
    """Read leniently (its new field ignored, its node still named), then neither followed nor asked for
    blocks: its fields may mean something this reader does not know."""
    newer = decode_peer("node-a", _peer(schema=KVCACHED_RECORD_VERSION + 1, tiers=["ram", "cxl"]))
    assert newer.schema == KVCACHED_RECORD_VERSION + 1 and newer.feed == PEER.feed
    skewed = peer_skew(newer)
    assert skewed is not None and skewed[:2] == ("kvcached record", KVCACHED_RECORD_VERSION + 1)
    assert "newer" in skewed[2]


def test_a_kvcached_record_of_another_digest_version_is_not_used() -> None:
    skewed = peer_skew(decode_peer("node-a", _peer(digest=DIGEST_VERSION + 1)))
    assert skewed is not None and skewed[:2] == ("kvcached digest", DIGEST_VERSION + 1)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (_peer(tiers=["ram"]), "unknown key"),  # the current version is read strictly
        (_peer(schema=0), "schema: expected a version >= 1"),
        (_peer(schema=True), "schema: expected a version >= 1"),
        (_peer(schema=KVCACHED_RECORD_VERSION + 1, quic="nope"), "quic: expected host:port"),
    ],
)
def test_kvcached_records_that_break_the_rules_are_refused(value: bytes, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        decode_peer("node-a", value)


def test_a_kvcached_record_too_old_for_this_reader_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the schema is 3, a version-1 record (older than N - 1) is refused."""
    monkeypatch.setattr("contracts.etcd.KVCACHED_RECORD_VERSION", 3)
    skewed = peer_skew(decode_peer("node-a", _peer(schema=...)))
    assert skewed is not None and skewed[1] == 1 and "refused" in skewed[2]
