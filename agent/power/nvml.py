"""NVML as a power source: the node's GPUs, read by the agent's :class:`agent.telemetry.GpuTelemetry`,
summed into one :class:`~agent.power.reading.Sample` (:func:`~agent.power.reading.from_gpus`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from agent.power.reading import Sample, from_gpus
from contracts.events import Gpu


class NvmlSource:
    """``read_gpus``: the blocking NVML read (run in a worker thread); no GPU is a reported error."""

    kind = "nvml"

    def __init__(self, name: str, read_gpus: Callable[[], Sequence[Gpu]]) -> None:
        self.name = name
        self._read_gpus = read_gpus

    async def read(self) -> Sample:
        return from_gpus(await asyncio.to_thread(self._read_gpus))

    async def aclose(self) -> None:
        return None
