"""The engine kinds kvgate fronts, registered by name, and the roles an engine plays (prefill/decode
disaggregation).

Each kind is one module exporting ``KIND`` (:class:`~engines.kind.EngineKind`); :data:`KINDS` lists them
all, here and nowhere else. Adding a kind is one module plus one line in that list (engines/README.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

from contracts.errors import ConfigError
from engines import llama_cpp, openai_compat, sglang, sim, trtllm, vllm
from engines.config import KV_OFFLOADS
from engines.kind import EngineKind
from engines.metrics import MetricNames

#: What an engine does in a disaggregated fleet: everything, prefill only, or decode only.
ROLES = ("both", "prefill", "decode")


def _registry(kinds: Iterable[EngineKind]) -> Mapping[str, EngineKind]:
    """Name -> kind, refusing (at import) a duplicate name or a matrix cell outside ROLES x KV_OFFLOADS."""
    table: dict[str, EngineKind] = {}
    for kind in kinds:
        if kind.name in table:
            raise ValueError(f"engine kind {kind.name!r} registered twice")
        for role, allowed in kind.offloads.items():
            if role not in ROLES or not set(allowed) <= set(KV_OFFLOADS):
                raise ValueError(f"engine kind {kind.name!r}: bad offload matrix row {role!r}: {allowed}")
        table[kind.name] = kind
    return MappingProxyType(table)


#: Every engine kind by name; the order is the one messages list them in.
KINDS: Mapping[str, EngineKind] = _registry(
    [vllm.KIND, sglang.KIND, trtllm.KIND, llama_cpp.KIND, openai_compat.KIND, sim.KIND]
)
ENGINE_KINDS = tuple(KINDS)
#: kind -> role -> allowed ``kv_offload`` values; a role missing for a kind is not supported at all.
OFFLOAD_MATRIX: Mapping[str, Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {name: kind.offloads for name, kind in KINDS.items()}
)
#: Kinds that publish KV events over ZMQ in vLLM's format (trtllm only offers an HTTP poll endpoint).
KV_EVENT_KINDS = tuple(name for name, kind in KINDS.items() if kind.kv_events)


def metric_names(kind: str) -> MetricNames:
    """The load series of ``kind``; vLLM's names for a kind not registered here (the common default of
    OpenAI-compatible servers)."""
    found = KINDS.get(kind)
    return vllm.METRICS if found is None else found.metrics


def check_combination(
    kind: str, role: str, kv_offload: str, where: str, *, role_from: str | None = None
) -> None:
    """Raise :class:`~contracts.errors.ConfigError` naming the allowed values unless ``kind`` x ``role`` x
    ``kv_offload`` is a cell of :data:`OFFLOAD_MATRIX`. ``where`` prefixes the key in the message;
    ``role_from`` names the key the role was inherited from, when it was not set where it is checked."""
    found = KINDS.get(kind)
    if found is None:
        raise ConfigError(f"{where}.kind: expected one of {', '.join(ENGINE_KINDS)}, got {kind!r}")
    roles = found.offloads
    if role not in roles:
        origin = "" if role_from is None else f" (inherited from {role_from})"
        raise ConfigError(
            f"{where}.role: {role!r}{origin} is not supported by {kind}; allowed: {', '.join(roles)}"
        )
    offered = [o for o in KV_OFFLOADS if any(o in allowed for allowed in roles.values())]
    if kv_offload not in offered:
        raise ConfigError(
            f"{where}.kv_offload: {kv_offload!r} is not supported by {kind}; allowed: {', '.join(offered)}"
        )
    if kv_offload not in roles[role]:
        raise ConfigError(
            f"{where}.kv_offload: {kv_offload!r} is not supported by {kind} with role {role!r}; "
            f"allowed: {', '.join(roles[role])}"
        )
