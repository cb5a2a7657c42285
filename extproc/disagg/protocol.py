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

from collections.abc import Mapping
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
    """The ``kv_transfer_params`` of a vLLM prefill engine's JSON answer; :class:`HandoffFailed`
    (``bad_response``) when there are none, or they lack a field the decode side needs."""
    params = _object(response).get("kv_transfer_params")
    if not isinstance(params, dict):
        raise HandoffFailed("bad_response", "the prefill answer carries no kv_transfer_params")
    missing = [k for k in REQUIRED_FROM_PREFILL if params.get(k) is None]
    if missing:
        raise HandoffFailed("bad_response", f"kv_transfer_params lack {', '.join(missing)}")
    return params


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
