"""LoRA adapter slots of one simulated replica, as vLLM's ``--max-loras`` GPU slots. Pure.

vLLM keeps at most ``max_loras`` adapters in GPU slots (its LRU adapter cache) and puts at most that many
distinct adapters in one batch: a waiting request whose adapter is not loaded is admitted only when a
slot is free or holds an adapter no running request uses (the least recently used such adapter is
evicted); otherwise it stays waiting and requests behind it may go first (vLLM's scheduler skips it).
Loading an adapter into a slot costs ``TimingModel.lora_load_s`` (added to the step that admits the
request; load/sim/README.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection


class LoraSlots:
    """``max_loras`` slots holding adapters, least recently used first. ``loads``: adapters loaded so far
    (each load into a slot counts, the first ones included); ``evictions``: adapters dropped for another."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        self.max_loras = max_loras
        self._loaded: OrderedDict[str, None] = OrderedDict()
        self.loads = 0
        self.evictions = 0

    @property
    def loaded(self) -> list[str]:
        """Adapters in slots, least recently used first."""
        return list(self._loaded)

    def can_run(self, name: str, busy: Collection[str]) -> bool:
        """Whether a request for ``name`` can be admitted while adapters ``busy`` have running requests."""
        if name in self._loaded or len(self._loaded) < self.max_loras:
            return True
        return any(a not in busy for a in self._loaded)

    def use(self, name: str, busy: Collection[str]) -> bool:
        """Admit a request for ``name`` (:meth:`can_run` must hold): True when the adapter had to be
        loaded (evicting the least recently used idle one when no slot is free)."""
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return False
        if len(self._loaded) >= self.max_loras:
            victim = next(a for a in self._loaded if a not in busy)
            del self._loaded[victim]
            self.evictions += 1
        self._loaded[name] = None
        self.loads += 1
        return True
