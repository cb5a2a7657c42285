"""The prefill/decode handoff's body fields, as the engines name them.

vLLM's ``kv_transfer_params``, SGLang's bootstrap triple and its ``disagg_prefill_dp_rank`` (which
data-parallel rank of the prefill server holds the KV; unset, the decode server derives it from the room)
tell an engine where to fetch a prompt's KV.
Only the gateway's disaggregation (:mod:`extproc.disagg`) sets them: a client's own are dropped where its
body is parsed (:mod:`extproc.routing.request`), and a migrated request's later tries drop them too
(:mod:`extproc.migration.continuation`), since they pair one try with its prefill.
"""

from __future__ import annotations

HANDOFF_FIELDS = frozenset(
    {"kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room", "disagg_prefill_dp_rank"}
)
