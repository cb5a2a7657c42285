"""Python's cyclic garbage collection moved off the decision path (issue 27: the decision tail).

CPython collects its youngest generation whenever allocations minus deallocations of tracked containers
pass ``threshold0`` (700), in whatever code allocates next, so one decision in ~30 first turns (4k
tokens, 64 endpoints) paid a ~1.5 ms young collection: its cost is traversing the token tuples the
segment cache gained since the last one (every new token is visited once, then the tuple is untracked).
That was the p99 of first turns (load/bench/decision.py with ``--gc``; BENCHMARKS.md "Decision latency").

:class:`Collector` (``[extproc] gc = "deferred"``, the default) keeps the same amount of work and the same
collection rule, and runs it where a request no longer waits: after a stream's answer is on its way
(:meth:`after_request`, beside the router's deferred index record). At start-up (:meth:`start`) it

- collects once and freezes what survives (``gc.freeze()``: the loaded tokenizer, config, modules); a
  full collection then walks only objects made since, not the start-up heap;
- raises the automatic young threshold to ``SAFETY_FACTOR * threshold0`` (14,000): a backstop for a
  process that allocates without finishing requests (feeds, scrapes), not the usual trigger.

Rule, at each :meth:`after_request`, with ``(c0, c1, c2) = gc.get_count()`` and CPython's thresholds
``(t0, t1, t2) = (700, 10, 10)``: nothing while ``c0 < t0``; else collect generation 2 if ``c1 >= t1``
and ``c2 >= t2``, generation 1 if ``c1 >= t1``, else generation 0. CPython's own rule, less its
"long-lived pending > 25 % of long-lived" test before a full collection (not readable from Python): a
full collection comes every ``(t1 + 1) * (t2 + 1)`` = 121 collections, over the heap made since the freeze.

Memory: objects alive at start-up are never examined by the cyclic collector again (a cycle among them
that becomes garbage is not freed; reference counting still frees everything else). Between requests
up to ``t0`` young containers wait, as with CPython's default; with no request finishing, up to
``SAFETY_FACTOR * t0`` (then CPython collects them itself). ``gc = "python"`` leaves CPython's collector
as it is.
"""

from __future__ import annotations

import gc

SAFETY_FACTOR = 20
"""The automatic young threshold while deferred: this many times CPython's ``threshold0``."""

MODES = ("deferred", "python")
"""``[extproc] gc`` values: collect after requests (:class:`Collector`), or CPython's default."""


class Collector:
    """Schedules CPython's cyclic collections after requests instead of inside them (process-wide)."""

    def __init__(self) -> None:
        self._thresholds = gc.get_threshold()
        self._started = False
        #: Collections run by :meth:`after_request`, per generation.
        self.collections = [0, 0, 0]

    @property
    def started(self) -> bool:
        return self._started

    def start(self) -> None:
        """Once the process has loaded what it keeps (after start-up): collect, freeze the survivors,
        raise the automatic threshold to the backstop."""
        if self._started:
            return
        t0, t1, t2 = self._thresholds = gc.get_threshold()
        gc.collect()
        gc.freeze()
        gc.set_threshold(t0 * SAFETY_FACTOR, t1, t2)
        self._started = True

    def after_request(self) -> int | None:
        """A request's answer has been sent: run the collection CPython would have run by now, if any.
        Returns the generation collected, or ``None``."""
        if not self._started:
            return None
        t0, t1, t2 = self._thresholds
        c0, c1, c2 = gc.get_count()
        if c0 < t0:
            return None
        generation = (2 if c2 >= t2 else 1) if c1 >= t1 else 0
        gc.collect(generation)
        self.collections[generation] += 1
        return generation

    def stop(self) -> None:
        """Back to CPython's collector (thresholds restored, start-up objects unfrozen)."""
        if not self._started:
            return
        gc.set_threshold(*self._thresholds)
        gc.unfreeze()
        self._started = False
