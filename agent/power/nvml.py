"""NVML as a power source: the node's GPUs, read by the agent's :class:`agent.telemetry.GpuTelemetry`,
summed into one :class:`~agent.power.reading.Sample` (:func:`~agent.power.reading.from_gpus`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from agent.power.errors import PowerSourceError
from agent.power.reading import Sample, from_gpus
from contracts.events import Gpu


class NvmlSource:
    """``read_gpus``: the blocking NVML read (run in a worker thread); no GPU is a reported error.

    One read at a time: NVML calls cannot be interrupted, so a read the monitor gave up waiting for
    keeps its thread until NVML answers; until then each new read is a reported error, not another
    thread (a hung driver would otherwise fill the loop's default thread pool, which DNS lookups and
    file IO share)."""

    kind = "nvml"

    def __init__(self, name: str, read_gpus: Callable[[], Sequence[Gpu]]) -> None:
        self.name = name
        self._read_gpus = read_gpus
        #: A read is under way in a worker thread: the next one is refused until it ends.
        self._busy = False

    async def read(self) -> Sample:
        if self._busy:
            raise PowerSourceError("the previous NVML read is still running (NVML is not answering)")
        self._busy = True

        def work() -> Sequence[Gpu]:
            try:
                return self._read_gpus()
            finally:
                self._busy = False  # also when the monitor gave up waiting: the thread ends by itself

        return from_gpus(await asyncio.to_thread(work))

    async def aclose(self) -> None:
        return None
