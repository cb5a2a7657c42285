"""Fuzzing the KV event decoder (issue 24 part 3): the agent's decoding of an engine's ZMQ messages
(vLLM's msgpack batches, :mod:`agent.kvevents`) and their translation into index events
(:mod:`agent.translate`, what the agent's pump runs on every batch).

Property: any frames give a :class:`KvBatch` or a :class:`KvEventDecodeError`, and a decoded batch is
translated (malformed events counted and skipped), never another exception: one would end the engine's
event pump and with it the gateway's view of that engine's cache.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import example, given
from hypothesis import strategies as st

from agent.kvevents import KvBatch, KvEventDecodeError, decode_message, decode_payload
from agent.main import feed_batches
from agent.translate import Translator
from contracts.events import Cleared, Removed, Stored
from tests.fuzz.strategies import FUZZ, edge_ints, json_values

BLOCK = 4
hashes = st.one_of(edge_ints, st.binary(max_size=9))
tokens = st.lists(st.integers(0, 50_000) | edge_ints, max_size=3 * BLOCK)


def stored(draw: st.DrawFn) -> list[Any]:
    """A ``BlockStored`` event, array-like as vLLM 0.33 sends it, its fields plausible or not."""
    n = draw(st.integers(0, 3))
    block_size = draw(st.sampled_from([BLOCK, 2 * BLOCK, 0, -1, 3]) | edge_ints)
    ids = (
        draw(tokens)
        if draw(st.booleans())
        else draw(st.lists(st.integers(0, 50_000), min_size=n * BLOCK, max_size=n * BLOCK))
    )
    fields: list[Any] = [
        "BlockStored",
        draw(st.lists(hashes, min_size=n, max_size=n)),
        draw(st.none() | hashes),
        ids,
        block_size,
        draw(st.none() | edge_ints),
        draw(st.sampled_from([None, "GPU", "CPU", "STORAGE", "HBM"])),
        draw(st.none() | st.text(max_size=6)),
        draw(st.none() | st.lists(st.none() | st.lists(json_values(3), max_size=3), max_size=2)),
        draw(st.none() | st.integers(-1, 2)),
    ]
    return fields[: draw(st.integers(5, len(fields)))]


@st.composite
def events(draw: st.DrawFn) -> list[Any]:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return stored(draw)
    if kind == 1:
        medium = draw(st.sampled_from([None, "GPU", "CPU"]))
        return ["BlockRemoved", draw(st.lists(hashes, max_size=3)), medium]
    if kind == 2:
        return ["AllBlocksCleared"]
    return draw(st.lists(json_values(4), max_size=4))


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    """A msgpack batch ``[ts, events, dp_rank]`` (array or map form), or any msgpack, or any bytes."""
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=64))
    if kind == 1:
        return msgspec.msgpack.encode(draw(json_values(8)))
    batch_events = draw(st.lists(events(), max_size=4))
    ts = draw(st.floats(allow_nan=True) | edge_ints)
    if kind == 2:
        return msgspec.msgpack.encode([ts, batch_events, draw(st.none() | edge_ints)])
    return msgspec.msgpack.encode({"ts": ts, "events": batch_events})


def _decode(frames: list[bytes]) -> KvBatch | None:
    try:
        return decode_message(frames)
    except KvEventDecodeError:
        return None


@FUZZ
@given(frames=st.lists(st.binary(max_size=16), max_size=4))
def test_any_frames_decode_or_are_refused(frames: list[bytes]) -> None:
    _decode(frames)


@FUZZ
@given(batches=st.lists(payloads(), min_size=1, max_size=5))
@example(batches=[msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, [-1, 2, 3, 4], 4]]])])
@example(batches=[msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, [2**32, 2, 3, 4], 4]]])])
# a lora_name that is not UTF-8: UnicodeDecodeError escaped the decoder (and would end the subscriber)
@example(batches=[msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, [1] * 4, 4, None, None, "x"]]])
                  .replace(b"\xa1x", b"\xa1\x80")])  # fmt: skip
def test_decoded_batches_translate(batches: list[bytes]) -> None:
    translator = Translator("e1", "m", BLOCK)
    items = []
    for seq, payload in enumerate(batches):
        batch = _decode([b"kv", seq.to_bytes(8, "big"), payload])
        if batch is None:
            try:
                decode_payload(payload)
            except KvEventDecodeError:
                continue
            raise AssertionError("decode_payload took what decode_message refused")
        items.append(batch)
    for index_events in feed_batches(translator, items):
        assert all(isinstance(e, Stored | Removed | Cleared) for e in index_events)
    translator.snapshot()
