"""Prefill/decode disaggregation in the simulator: vLLM's ``kv_transfer_params`` as NixlConnector reads
and writes them. Pure (the caller sleeps the transfer time and runs the engine).

A replica started with ``--role prefill`` or ``--role decode`` has the connector (both halves, as vLLM's
``kv_both``); with ``--role both`` (the default, no connector) ``kv_transfer_params`` are ignored, as a
vLLM without ``--kv-transfer-config`` ignores them.

* ``do_remote_decode: true`` (a prefill request): the replica prefills and samples one token as usual;
  its non-streamed answer gains ``kv_transfer_params`` = ``{do_remote_prefill: true, do_remote_decode:
  false, remote_engine_id, remote_block_ids, remote_request_id, remote_host, remote_port, tp_size}``
  (its engine id, the cache blocks holding the prompt, its own address as the side channel).
* ``do_remote_prefill: true`` (a decode request) with ``remote_engine_id``, ``remote_block_ids``,
  ``remote_host`` and ``remote_port``: the replica waits the transfer time of the prompt tokens it does
  not hold (``TimingModel.transfer_s``), then decodes without computing the prompt
  (``Engine.add_request(remote_prefill=True)``). Without those fields: 400, as the handshake would fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from load.sim.errors import invalid

ROLES = ("both", "prefill", "decode")
#: What a decode request's params must name for its KV to be fetched.
REMOTE_FIELDS = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")


@dataclass(frozen=True, slots=True)
class Transfer:
    """What a request's ``kv_transfer_params`` ask of this replica: ``remote_decode`` (prefill for
    another replica) or ``remote_prefill`` (the prefill replica's params: decode its request)."""

    remote_decode: bool = False
    remote_prefill: dict[str, Any] | None = None


NONE = Transfer()


def read_transfer(body: dict[str, Any], role: str) -> Transfer:
    """The request's transfer (``NONE`` without params or without a connector); 400 for params that are
    not an object, or a remote prefill that names no source."""
    params = body.get("kv_transfer_params")
    if params is None or role == "both":
        return NONE
    if not isinstance(params, dict):
        raise invalid("kv_transfer_params must be an object", "kv_transfer_params")
    if params.get("do_remote_prefill"):
        missing = [k for k in REMOTE_FIELDS if params.get(k) is None]
        if missing:
            raise invalid(f"kv_transfer_params lack {', '.join(missing)}", "kv_transfer_params")
        return Transfer(remote_prefill=params)
    return Transfer(remote_decode=bool(params.get("do_remote_decode")))


def prefill_params(
    engine_id: str, request_id: str, block_ids: Sequence[int], host: str, port: int
) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill answer carries for the decode replica."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": list(block_ids),
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }
