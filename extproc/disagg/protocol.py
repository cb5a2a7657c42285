"""The handoff bodies: vLLM's ``kv_transfer_params`` protocol and SGLang's bootstrap fields. Pure.

vLLM (NixlConnector, and the disaggregated-serving proxies of vLLM's own tests):

* the prefill request is the client's body with ``kv_transfer_params`` = ``{do_remote_decode: true,
  do_remote_prefill: false, remote_engine_id: null, remote_block_ids: null, remote_host: null,
  remote_port: null}``, ``stream: false``, ``max_tokens: 1`` (and ``max_completion_tokens: 1`` when the
  body has it), without ``stream_options``, ``min_tokens`` and ``min_completion_tokens`` (a prefill
  engine samples one token, then stops length-capped, which is what makes it hand its blocks over);
* the prefill engine's JSON answer carries ``kv_transfer_params`` for the decode side
  (``do_remote_prefill: true``, ``remote_engine_id``, ``remote_block_ids``, ``remote_host``,
  ``remote_port``, and newer releases ``remote_request_id``, ``tp_size``);
* the decode request is the client's body, unchanged but for those params (``do_remote_prefill`` set
  true, ``do_remote_decode`` false).

SGLang (``--disaggregation-mode prefill|decode``): its router sends the same body to the prefill and the
decode server at once, both with ``bootstrap_host`` (the prefill server's host), ``bootstrap_port`` (its
bootstrap server's port) and ``bootstrap_room`` (a random 63-bit id pairing the two); the decode server
pulls the KV from the prefill server through that room. No answer of the prefill side is needed. A prefill
server with data parallelism runs the request on ``bootstrap_room % dp_size`` unless the body names a rank
(``routed_dp_rank``, ``data_parallel_rank``), and the decode server looks for the KV on the room's rank
unless told ``disagg_prefill_dp_rank``: the prefill half goes without a client's rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from extproc.disagg.errors import HandoffFailed

#: The prefill request's ``kv_transfer_params`` (vLLM's field names).
PREFILL_PARAMS: Mapping[str, object] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
#: Fields a prefill engine's ``kv_transfer_params`` must carry for the decode side to fetch the blocks.
REQUIRED_FROM_PREFILL = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")
#: The largest ``kv_transfer_params`` forwarded to a decode engine, encoded (bytes): NixlConnector's block
#: ids of a 1M-token prompt (65,536 blocks of 16 tokens, about 7 bytes an id) in four KV cache groups take
#: about 1.8 MB; anything past it is no prefill engine's answer.
MAX_PARAMS_BYTES = 2 << 20
#: Fields a vLLM prefill engine refuses or that would make it stream or decode past one token.
_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")
#: Fields the SGLang prefill half goes without: it never streams, and its data-parallel rank is the room's
#: (``bootstrap_room % dp_size``, where the decode server, told no ``disagg_prefill_dp_rank``, fetches the
#: KV), never a rank the client named (``routed_dp_rank``, or the older ``data_parallel_rank``).
_SGLANG_PREFILL_DROPPED = ("stream_options", "routed_dp_rank", "data_parallel_rank")
#: The largest SGLang bootstrap room id (a signed 64-bit integer on its side).
MAX_ROOM = (1 << 63) - 1


def _object(body: bytes) -> dict[str, Any]:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HandoffFailed("bad_response", f"not JSON ({exc.msg})") from None
    if not isinstance(doc, dict):
        raise HandoffFailed("bad_response", "not a JSON object")
    return doc


def prefill_body(request: Mapping[str, Any]) -> bytes:
    """The vLLM prefill request for the client's parsed ``request`` body."""
    doc = {k: v for k, v in request.items() if k not in _PREFILL_DROPPED}
    doc["kv_transfer_params"] = dict(PREFILL_PARAMS)
    doc["stream"] = False
    doc["max_tokens"] = 1
    if "max_completion_tokens" in doc:
        doc["max_completion_tokens"] = 1
    return orjson.dumps(doc)


def transfer_params(response: bytes) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a vLLM prefill engine's JSON answer, checked before any of it goes to a
    decode engine: a JSON object (its keys strings), with the fields the decode side reads of the types
    vLLM sends (``remote_engine_id`` and ``remote_host`` strings, ``remote_port`` a port number,
    ``remote_block_ids`` a list of block ids, or of such lists: one a KV cache group; ``tp_size``, when
    present, a positive integer), at most :data:`MAX_PARAMS_BYTES` encoded. :class:`HandoffFailed`
    (``bad_response``) otherwise: the request is then served aggregated, nothing of them forwarded."""
    params = _object(response).get("kv_transfer_params")
    if not isinstance(params, dict):
        raise HandoffFailed("bad_response", "the prefill answer carries no kv_transfer_params")
    missing = [k for k in REQUIRED_FROM_PREFILL if params.get(k) is None]
    if missing:
        raise HandoffFailed("bad_response", f"kv_transfer_params lack {', '.join(missing)}")
    wrong = [k for k, ok in _FIELD_CHECKS.items() if k in params and not ok(params[k])]
    if wrong:
        raise HandoffFailed("bad_response", f"kv_transfer_params: bad {', '.join(wrong)}")
    try:
        size = len(orjson.dumps(params))
    except orjson.JSONEncodeError:  # nested past orjson's depth limit: it could not be forwarded
        raise HandoffFailed("bad_response", "kv_transfer_params nested too deep") from None
    if size > MAX_PARAMS_BYTES:
        raise HandoffFailed("bad_response", f"kv_transfer_params of {size} bytes (over {MAX_PARAMS_BYTES})")
    return params


def _count(value: object, low: int, high: int | None = None) -> bool:
    """An integer (not a boolean) in ``[low, high]``."""
    return type(value) is int and value >= low and (high is None or value <= high)


def _block_ids(value: object) -> bool:
    """vLLM's ``remote_block_ids``: block ids, or (a model with several KV cache groups) a list of them
    per group."""
    return isinstance(value, list) and all(
        _count(v, 0) or (isinstance(v, list) and all(_count(b, 0) for b in v)) for v in value
    )


#: The fields of a prefill engine's ``kv_transfer_params`` the decode side reads, and their check.
_FIELD_CHECKS: Mapping[str, Callable[[object], bool]] = {
    "remote_engine_id": lambda v: isinstance(v, str),
    "remote_host": lambda v: isinstance(v, str),
    "remote_port": lambda v: _count(v, 1, 65535),
    "remote_block_ids": _block_ids,
    "tp_size": lambda v: _count(v, 1),
}


def decode_body(request: Mapping[str, Any], params: Mapping[str, Any]) -> bytes:
    """The vLLM decode request: the client's body with the prefill engine's ``params``."""
    doc = dict(request)
    doc["kv_transfer_params"] = {**params, "do_remote_prefill": True, "do_remote_decode": False}
    return orjson.dumps(doc)


def bootstrap_bodies(request: Mapping[str, Any], host: str, port: int, room: int) -> tuple[bytes, bytes]:
    """SGLang's (prefill body, decode body): each the client's body with ``bootstrap_host``,
    ``bootstrap_port`` and ``bootstrap_room``; the prefill side never streams and takes the data-parallel
    rank the room names (:data:`_SGLANG_PREFILL_DROPPED`)."""
    if not 0 <= room <= MAX_ROOM:
        raise ValueError(f"bootstrap_room must be in [0, 2^63), got {room}")
    fields = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
    decode = {**request, **fields}
    prefill = {k: v for k, v in decode.items() if k not in _SGLANG_PREFILL_DROPPED}
    prefill["stream"] = False
    return orjson.dumps(prefill), orjson.dumps(decode)


def parse_request(body: bytes) -> dict[str, Any]:
    """The client's body as a JSON object (it was validated before routing; :class:`HandoffFailed`
    otherwise)."""
    return _object(body)
