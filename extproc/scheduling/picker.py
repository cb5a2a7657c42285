"""The picker: turns weighted total scores into the ordered endpoint list (pick, then fallbacks)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

from contracts.events import EndpointId
from extproc.fleet import EndpointState


@dataclass(frozen=True, slots=True)
class MaxScoreParams:
    """``max_fallbacks``: endpoints returned after the pick (Envoy retries walk them in order).
    ``epsilon``: scores within this of a tie group's best count as tied."""

    max_fallbacks: int = 2
    epsilon: float = 1e-9

    def __post_init__(self) -> None:
        if self.max_fallbacks < 0:
            raise ValueError(f"max_fallbacks must be >= 0, got {self.max_fallbacks!r}")
        if not 0 <= self.epsilon < math.inf:
            raise ValueError(f"epsilon must be finite and >= 0, got {self.epsilon!r}")


_by_score = itemgetter(1)


def _key(pair: tuple[EndpointState, float]) -> float:
    score = pair[1]
    return score if score == score else -math.inf  # NaN sorts last


class MaxScorePicker:
    """Highest total score first; ties broken uniformly at random with the caller's ``rng``.

    Candidates are sorted by score, descending; consecutive candidates within ``epsilon`` of the best of
    their group form a tie group, shuffled as a whole. Returns up to ``1 + max_fallbacks`` distinct
    endpoints; fallbacks are the next best, so a retry lands where the scores say it should.
    """

    __slots__ = ("name", "params")

    def __init__(self, name: str = "max-score", params: MaxScoreParams | None = None) -> None:
        self.name = name
        self.params = params or MaxScoreParams()

    def pick(self, scored: Sequence[tuple[EndpointState, float]], rng: random.Random) -> list[EndpointState]:
        if any(map(math.isnan, map(_by_score, scored))):  # NaN sorts last, as -inf
            order = sorted(scored, key=_key, reverse=True)
            keys = [_key(pair) for pair in order]
        else:  # the same order and keys without a call per candidate
            order = sorted(scored, key=_by_score, reverse=True)
            keys = [score for _, score in order]
        return self._walk(range(len(order)), keys, [endpoint for endpoint, _ in order], rng)

    def pick_list(
        self, candidates: Sequence[EndpointState], scores: Sequence[float], rng: random.Random
    ) -> list[EndpointState]:
        """:meth:`pick` of ``list(zip(candidates, scores))`` without building the pairs (``ListPicker``):
        the candidates' positions sorted on their scores (the same stable order as sorting the pairs),
        then the same walk and shuffles, which look at the first tie groups only. A NaN score:
        :meth:`pick` itself."""
        if any(map(math.isnan, scores)):
            return self.pick(list(zip(candidates, scores, strict=True)), rng)
        ranked = sorted(range(len(scores)), key=scores.__getitem__, reverse=True)
        return self._walk(ranked, scores, candidates, rng)

    def _walk(
        self,
        ranked: Sequence[int],
        keys: Sequence[float],
        items: Sequence[EndpointState],
        rng: random.Random,
    ) -> list[EndpointState]:
        """``items`` in the order of the positions ``ranked`` (best first; ``keys``: their sort keys, by
        position), each tie group shuffled as a whole, up to ``1 + max_fallbacks`` distinct endpoints."""
        limit = 1 + self.params.max_fallbacks
        epsilon = self.params.epsilon
        out: list[EndpointState] = []
        seen: set[EndpointId] = set()
        i, n = 0, len(ranked)
        while i < n and len(out) < limit:
            best = keys[ranked[i]]
            j = i + 1
            while j < n and best - keys[ranked[j]] <= epsilon:
                j += 1
            group = [items[k] for k in ranked[i:j]]
            if len(group) > 1:
                rng.shuffle(group)
            for endpoint in group:
                endpoint_id = endpoint.endpoint.id
                if endpoint_id not in seen and len(out) < limit:
                    seen.add(endpoint_id)
                    out.append(endpoint)
            i = j
        return out
