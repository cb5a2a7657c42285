"""The handoff bodies against vLLM's documented ``kv_transfer_params`` fields and SGLang's bootstrap
fields (examples written from the protocol: vLLM's NixlConnector and its disaggregated-serving proxy)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from extproc.disagg.errors import HandoffFailed
from extproc.disagg.protocol import (
    MAX_PARAMS_BYTES,
    MAX_ROOM,
    bootstrap_bodies,
    decode_body,
    parse_request,
    prefill_body,
    transfer_params,
)

CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hello"}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 200,
    "max_completion_tokens": 150,
    "min_tokens": 5,
    "temperature": 0.2,
}

#: A vLLM prefill engine's answer (NixlConnector, one token, length-capped).
PREFILL_ANSWER: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "The"}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 2000, "completion_tokens": 1, "total_tokens": 2001},
    "kv_transfer_params": {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [4, 5, 6],
        "remote_engine_id": "0f6c-engine",
        "remote_request_id": "chatcmpl-1",
        "remote_host": "10.0.0.7",
        "remote_port": 5600,
        "tp_size": 1,
    },
}


def test_prefill_body_asks_for_one_token_and_a_remote_decode() -> None:
    doc = orjson.loads(prefill_body(CHAT))
    assert doc["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert doc["stream"] is False
    assert doc["max_tokens"] == 1 and doc["max_completion_tokens"] == 1
    for dropped in ("stream_options", "min_tokens"):
        assert dropped not in doc
    assert doc["messages"] == CHAT["messages"] and doc["temperature"] == 0.2
    assert CHAT["max_tokens"] == 200, "the client's body is not changed"


def test_prefill_body_adds_no_max_completion_tokens() -> None:
    doc = orjson.loads(prefill_body({"model": "m", "prompt": "x"}))
    assert doc["max_tokens"] == 1 and "max_completion_tokens" not in doc


def test_decode_body_carries_the_prefill_params() -> None:
    params = transfer_params(orjson.dumps(PREFILL_ANSWER))
    doc = orjson.loads(decode_body(CHAT, params))
    expected = {**PREFILL_ANSWER["kv_transfer_params"], "do_remote_prefill": True, "do_remote_decode": False}
    assert doc["kv_transfer_params"] == expected
    rest = {k: v for k, v in doc.items() if k != "kv_transfer_params"}
    assert rest == CHAT, "the decode engine gets the client's request unchanged"


@pytest.mark.parametrize(
    ("answer", "detail"),
    [
        (b"not json", "not JSON"),
        (b"[1]", "not a JSON object"),
        (orjson.dumps({"choices": []}), "no kv_transfer_params"),
        (orjson.dumps({"kv_transfer_params": None}), "no kv_transfer_params"),
        (
            orjson.dumps({"kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "e"}}),
            "remote_block_ids, remote_host, remote_port",
        ),
    ],
)
def test_unusable_prefill_answers(answer: bytes, detail: str) -> None:
    with pytest.raises(HandoffFailed) as caught:
        transfer_params(answer)
    assert caught.value.reason == "bad_response"
    assert detail in str(caught.value)


def answer_with(**fields: Any) -> bytes:
    """A prefill answer whose ``kv_transfer_params`` has ``fields`` changed (``None``: left out), encoded
    by :mod:`json`, which nests deeper than orjson encodes."""
    params = {**PREFILL_ANSWER["kv_transfer_params"], **fields}
    return json.dumps({**PREFILL_ANSWER, "kv_transfer_params": params}).encode()


def nested(depth: int) -> list[Any]:
    value: list[Any] = [1]
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("answer", "detail"),
    [
        (orjson.dumps({"kv_transfer_params": "x"}), "no kv_transfer_params"),
        (orjson.dumps({"kv_transfer_params": [1, 2]}), "no kv_transfer_params"),
        (answer_with(remote_block_ids="4,5"), "bad remote_block_ids"),
        (answer_with(remote_block_ids=[4, "5"]), "bad remote_block_ids"),
        (answer_with(remote_block_ids=[4, -1]), "bad remote_block_ids"),
        (answer_with(remote_block_ids=[[4], [[5]]]), "bad remote_block_ids"),
        (answer_with(remote_block_ids=nested(300)), "bad remote_block_ids"),
        (answer_with(remote_port="5600"), "bad remote_port"),
        (answer_with(remote_port=True), "bad remote_port"),
        (answer_with(remote_port=70000), "bad remote_port"),
        (
            answer_with(remote_host={"ip": "10.0.0.7"}, remote_engine_id=7),
            "bad remote_engine_id, remote_host",
        ),
        (answer_with(tp_size=0), "bad tp_size"),
        (answer_with(extra=nested(300)), "nested too deep"),
        (answer_with(extra="x" * MAX_PARAMS_BYTES), f"over {MAX_PARAMS_BYTES}"),
    ],
)
def test_prefill_params_of_the_wrong_shape_are_unusable(answer: bytes, detail: str) -> None:
    """Only the gateway sets a decode engine's handoff fields: what a prefill engine (or anything answering
    on its address) returns is checked before it goes on (a string, a list, fields of other types, values
    nested past what can be re-encoded, megabytes of them), each a ``bad_response``, not a crash."""
    with pytest.raises(HandoffFailed) as caught:
        transfer_params(answer)
    assert caught.value.reason == "bad_response"
    assert detail in str(caught.value)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"tp_size": None, "remote_request_id": None},  # older releases send neither
        {"remote_block_ids": [[4, 5], [0, 9]]},  # one list a KV cache group (hybrid models)
        {"remote_block_ids": [], "remote_num_tokens": 2000, "vendor": {"any": ["json", 1]}},
    ],
)
def test_prefill_params_of_vllms_shapes_go_on(fields: dict[str, Any]) -> None:
    params = {k: v for k, v in {**PREFILL_ANSWER["kv_transfer_params"], **fields}.items() if v is not None}
    answer = orjson.dumps({**PREFILL_ANSWER, "kv_transfer_params": params})
    assert transfer_params(answer) == params


def test_sglang_bootstrap_fields_go_to_both() -> None:
    prefill, decode = bootstrap_bodies(CHAT, "10.0.0.7", 8998, 12345)
    p, d = orjson.loads(prefill), orjson.loads(decode)
    for doc in (p, d):
        assert (doc["bootstrap_host"], doc["bootstrap_port"], doc["bootstrap_room"]) == (
            "10.0.0.7",
            8998,
            12345,
        )
    assert p["stream"] is False and "stream_options" not in p
    assert d["stream"] is True and d["stream_options"] == {"include_usage": True}
    with pytest.raises(ValueError):
        bootstrap_bodies(CHAT, "h", 1, MAX_ROOM + 1)


def test_sglangs_prefill_half_goes_to_the_data_parallel_rank_its_room_names() -> None:
    """An SGLang prefill server with data parallelism puts a request on ``routed_dp_rank`` (or the older
    ``data_parallel_rank``) when the body names one, else on ``bootstrap_room % dp_size``, and the decode
    server, told no ``disagg_prefill_dp_rank``, fetches the KV from the rank the room names: a client's
    own rank on the prefill half would leave the decode waiting on the wrong rank. The decode half keeps
    it (it picks the decode server's own rank)."""
    request = {**CHAT, "routed_dp_rank": 1, "data_parallel_rank": 1}
    prefill, decode = bootstrap_bodies(request, "10.0.0.7", 8998, 12344)
    p, d = orjson.loads(prefill), orjson.loads(decode)
    assert "routed_dp_rank" not in p and "data_parallel_rank" not in p
    assert (d["routed_dp_rank"], d["data_parallel_rank"], d["bootstrap_room"]) == (1, 1, 12344)


def test_parse_request() -> None:
    assert parse_request(b'{"model": "m"}') == {"model": "m"}
    with pytest.raises(HandoffFailed):
        parse_request(b"[]")
