"""The asyncio pump around the sans-IO :class:`~load.sim.engine.Engine`.

It plans a step with the loop's clock, sleeps until the step's end (sleeping only for what is left,
so Python overhead does not add up), applies it and hands each request its tokens through an
:class:`asyncio.Queue`. With nothing to run it waits on an event: no polling.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from contracts.digest import Digest
from load.sim.engine import Engine, TokenEvent

log = logging.getLogger(__name__)

MAX_LAG_S = 0.002


class EngineDriver:
    """Pumps an :class:`Engine` on the event loop: plan a step, sleep until it ends, deliver its tokens.

    Sleeps on an event, not a poll, while the engine has nothing to run.
    """

    def __init__(self, engine: Engine, on_ttft: Callable[[float], None]) -> None:
        self.engine = engine
        self._on_ttft = on_ttft
        self._queues: dict[str, asyncio.Queue[TokenEvent]] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the step loop."""
        self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def aclose(self) -> None:
        """Stop the step loop and abort what is left."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for request_id in list(self._queues):
            self.abort(request_id)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds until no request waits or runs; whether that happened."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def submit(
        self,
        request_id: str,
        prompt: Sequence[int],
        output: Sequence[int],
        siblings: Sequence[tuple[str, Sequence[int]]] = (),
        queue: asyncio.Queue[TokenEvent] | None = None,
        *,
        remote_prefill: bool = False,
        priority: int = 0,
        seed: Digest | None = None,
        lora: str | None = None,
        salt: str | None = None,
    ) -> asyncio.Queue[TokenEvent]:
        """Queue a request (and the ``siblings`` (id, output) sharing its prefill, see
        :meth:`Engine.add_request`; ``remote_prefill``: its prompt was computed by another replica;
        ``priority``: its scheduling priority, lower first); the
        tokens of all of them arrive on ``queue`` (a new one by default), which is returned, each
        request's last with ``finished``. ``seed``, ``lora``, ``salt``: the request's chain seed, adapter
        and cache salt (:meth:`Engine.add_request`)."""
        now = asyncio.get_running_loop().time()
        self.engine.add_request(
            request_id,
            prompt,
            output,
            now,
            siblings,
            remote_prefill=remote_prefill,
            priority=priority,
            seed=seed,
            lora=lora,
            salt=salt,
        )
        queue = asyncio.Queue() if queue is None else queue
        for rid in (request_id, *(s for s, _ in siblings)):
            self._queues[rid] = queue
        self._idle.clear()
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> None:
        """Cancel a request (no-op once finished) and free its blocks."""
        if self._queues.pop(request_id, None) is not None:
            self.engine.abort(request_id)

    async def _run(self) -> None:
        try:
            await self._steps()
        except Exception:
            log.exception("engine step loop failed with %d requests in flight", len(self._queues))
            raise

    async def _steps(self) -> None:
        loop = asyncio.get_running_loop()
        last_end = -1.0
        while True:
            # Back-to-back steps chain on the model's timeline so that timer lateness does not add up;
            # after idling, or when running behind by more than MAX_LAG_S, a step starts at the clock.
            now = loop.time()
            step = self.engine.schedule(last_end if 0 <= now - last_end < MAX_LAG_S else now)
            if step is None:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                last_end = -1.0
                continue
            last_end = step.end
            await asyncio.sleep(max(0.0, step.end - loop.time()))
            for event in self.engine.complete(step):
                if event.ttft_s is not None:
                    self._on_ttft(event.ttft_s)
                queue = self._queues.get(event.request_id)
                if queue is not None:
                    queue.put_nowait(event)
                    if event.finished:
                        del self._queues[event.request_id]
