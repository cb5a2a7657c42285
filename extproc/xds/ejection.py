"""Ejection of endpoints after a failed upstream try: how long, and how that grows and decays.

Pure: no clock reads (``now`` is monotonic seconds, passed in), no IO. The failed-try receiver
(:mod:`extproc.xds.als`) asks :meth:`Ejector.fail` and writes the answer into the fleet
(:meth:`extproc.fleet.Fleet.eject`), where the scheduler's ``healthy`` filter and the EDS assignment read
it. Formulas in ``README.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from contracts.events import EndpointId

DEFAULT_BASE_S = 2.0
"""First ejection of an endpoint (seconds)."""
DEFAULT_MAX_S = 30.0
"""Longest ejection, and the quiet period after which an endpoint's ejections are forgotten (seconds)."""


@dataclass(frozen=True, slots=True)
class Ejection:
    """One ejection: ``endpoint`` is out of picks for ``duration_s`` seconds from ``start`` (monotonic
    seconds) to :attr:`until` after a failed try of ``kind``; ``count`` is its ``k`` (the endpoint's
    ejections in a row, held once the duration has reached ``max_s``)."""

    endpoint: EndpointId
    kind: str
    count: int
    start: float
    duration_s: float

    @property
    def until(self) -> float:
        return self.start + self.duration_s


class Ejector:
    """Decides ejections: the ``k``-th lasts ``min(max_s, base_s * 2 ** (k - 1))`` seconds.

    ``k`` is 1 plus the endpoint's previous ``k`` when that previous ejection ended less than ``max_s``
    seconds ago, else 1 (a quiet period of ``max_s`` forgets the history). A failure reported while the
    endpoint is still ejected belongs to the same outage (other requests in flight, other Envoys) and
    changes nothing.
    """

    def __init__(self, base_s: float = DEFAULT_BASE_S, max_s: float = DEFAULT_MAX_S) -> None:
        if not 0.0 < base_s <= max_s < float("inf"):
            raise ValueError(f"need 0 < base_s <= max_s < inf, got base_s={base_s!r}, max_s={max_s!r}")
        self.base_s = base_s
        self.max_s = max_s
        self._last: dict[EndpointId, Ejection] = {}
        # The k at which the duration reaches max_s: k never grows past it (2 ** k stays small).
        k_max = 1
        while base_s * 2.0 ** (k_max - 1) < max_s:
            k_max += 1
        self._k_max = k_max

    def fail(self, endpoint: EndpointId, kind: str, now: float) -> Ejection | None:
        """A try to ``endpoint`` failed with ``kind`` at ``now``: the new ejection, or ``None`` when the
        endpoint is already ejected."""
        last = self._last.get(endpoint)
        if last is not None and now < last.until:
            return None
        self._forget_quiet(now)
        k = 1 if last is None or now - last.until >= self.max_s else min(last.count + 1, self._k_max)
        duration = min(self.max_s, self.base_s * 2.0 ** (k - 1))
        ejection = Ejection(endpoint, kind, k, now, duration)
        self._last[endpoint] = ejection
        return ejection

    def _forget_quiet(self, now: float) -> None:
        """Drop endpoints quiet for ``max_s`` (their next ejection starts over at k = 1), so endpoints
        that left the fleet are not remembered for ever."""
        quiet = [e for e, last in self._last.items() if now - last.until >= self.max_s]
        for endpoint in quiet:
            del self._last[endpoint]
