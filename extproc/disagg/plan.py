"""The pair: whether a routed request is disaggregated, and which prefill endpoint computes its prompt.
Pure (no IO, ``now`` passed in): the router has already picked the decode endpoint.

For a request of model ``m`` whose route has a :class:`~extproc.disagg.policy.PdSpec`:

1. the **decode profile** is the route's own: :meth:`Router.decide` runs it over the decode-capable
   endpoints (role ``both`` or ``decode``; prefill-only endpoints are never picked by it), so the decode
   pick already weighs load, KV use and the prefix it holds (it keeps the transferred blocks);
2. ``uncached = max(0, prompt_tokens - matched_blocks x block_size)`` at that pick; the spec says
   whether to disaggregate (``disaggregated``: always; ``conditional``: when ``uncached >=
   min_uncached_tokens``, but always when the pick is an SGLang server of role ``decode``, which refuses
   a request without a bootstrap room);
3. the **prefill profile** (the spec's ``prefill_profile``, else the route's) runs over the prefill pool:
   endpoints of role ``prefill`` serving ``m`` that the route's labels admit, that speak the decode
   pick's handoff protocol, that flow control's limits for their (model, ``prefill``) role leave room
   (the processor's ``admit``) and that the request's EPP subset hint (if any) allows, narrowed further by the
   conformance pin when it names any prefill endpoint of ``m`` (:meth:`Disaggregator.plan`), with the
   prefix index's match of the prompt against that pool (its prefix scorer prefers the replica holding
   the prompt's lead), plus whatever load scorers the profile has; with no ``prefill_profile`` the
   profile only breaks ties and the pick is the endpoint with the least prefill work: the uncached tokens
   of the prefill sub-requests still running there (this worker's, and its sibling workers' as they
   last reported them, :attr:`Disaggregator.sibling_queued`) plus what this prompt lacks there
   (README.md, "The pair");
4. the pick's in-flight count and routed count rise until :meth:`Disaggregator.release`; once its
   prefill succeeded (:meth:`Disaggregator.prefilled`) the prompt's digests are recorded for it, so a
   repeated long prefix goes back to the prefill endpoint that computed it (a failed or abandoned
   prefill records nothing: the request was served whole by its decode endpoint, which is recorded).

Only engines with a known handoff protocol are paired: vLLM and the simulator (``kv_transfer_params``),
SGLang (bootstrap fields; its prefill endpoint must have registered its ``bootstrap_port``, and each pair
gets a random ``bootstrap_room`` in [0, 2^63)); anything else is served aggregated (reason ``engine``).
"""

from __future__ import annotations

import random
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from contracts.digest import Digest
from contracts.events import EndpointId
from extproc.disagg.policy import PdSpec
from extproc.disagg.protocol import MAX_ROOM
from extproc.fleet import EndpointState
from extproc.routing.router import Decision, Router, is_pinned
from extproc.scheduling.interface import CycleState, SchedulingRequest
from extproc.scheduling.profile import Profile

#: Engine kind -> the handoff protocol its prefill and decode servers speak (:mod:`extproc.disagg.protocol`).
PROTOCOLS: Mapping[str, str] = types.MappingProxyType({"vllm": "vllm", "sim": "vllm", "sglang": "sglang"})


@dataclass(frozen=True, slots=True)
class PdRoute:
    """A model's serving spec with its prefill profile built (``labels``: the route's, which prefill
    endpoints must carry too)."""

    spec: PdSpec
    prefill: Profile
    labels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class PdPolicy:
    """Model name -> :class:`PdRoute`; a model without one is served aggregated."""

    routes: Mapping[str, PdRoute] = field(default_factory=lambda: types.MappingProxyType({}))

    def prefill_bound(self, models: Iterable[str]) -> float:
        """The longest prefill half (``prefill_timeout_s``) any of ``models`` may wait for; 0 when none
        is disaggregated."""
        routes = self.routes
        return max((routes[m].spec.prefill_timeout_s for m in models if m in routes), default=0.0)


@dataclass(slots=True)
class Handoff:
    """A disaggregated request's pair: ``prefill`` computes the prompt (the gateway's sub-request),
    ``decode`` streams the answer (Envoy's route). ``uncached_tokens``: what the decode pick lacked;
    ``protocol``: ``vllm`` or ``sglang`` (:data:`PROTOCOLS`); ``timeout_s``: the prefill's bound;
    ``room``: SGLang's bootstrap room pairing the two servers (``None`` for vLLM)."""

    request_id: str
    prefill: EndpointState
    decode: EndpointState
    protocol: str
    uncached_tokens: int
    timeout_s: float
    room: int | None = None
    released: bool = False
    #: The prompt tokens the prefill pick lacked (counted in its queued prefill work until released).
    prefill_tokens: int = 0
    #: The prompt's digests, recorded at the prefill pick once its prefill succeeded.
    digests: Sequence[Digest] = ()


@dataclass(frozen=True, slots=True)
class Verdict:
    """What :meth:`Disaggregator.plan` decided: a ``handoff``, or ``None`` with why the request is served
    aggregated (``reason``: ``cached`` under the threshold, ``no_prefill`` no prefill endpoint fit,
    ``engine`` no handoff protocol for the decode engine). ``alone``: whether the decode pick can serve the
    request by itself (not an SGLang decode server, which refuses requests without a bootstrap room)."""

    handoff: Handoff | None
    reason: str
    alone: bool = True

    @property
    def mode(self) -> str:
        return "aggregated" if self.handoff is None else "disaggregated"


class Disaggregator:
    """Plans the prefill half of disaggregated requests under a :class:`PdPolicy` (swapped whole by
    :meth:`apply`, as the router's policy)."""

    def __init__(
        self, router: Router, policy: PdPolicy | None = None, rng: random.Random | None = None
    ) -> None:
        self._router = router
        self._policy = policy or PdPolicy()
        self._rng = rng or random.Random()
        #: Prefill endpoint id -> uncached prompt tokens of its prefill sub-requests still running.
        self._queued: dict[EndpointId, int] = {}
        #: The same, summed over this host's sibling workers as they last reported it (written by
        #: :class:`~extproc.control.siblings.SiblingBus`; empty without siblings).
        self.sibling_queued: Mapping[EndpointId, int] = types.MappingProxyType({})

    @property
    def policy(self) -> PdPolicy:
        return self._policy

    def apply(self, policy: PdPolicy) -> None:
        self._policy = policy

    def pairs(self, model: str) -> bool:
        """Whether a request for ``model`` may be paired with a prefill half: its serving spec is not
        aggregated (only then may the router pick an SGLang decode server: ``routing.router.alone``)."""
        route = self._policy.routes.get(model)
        return route is not None and route.spec.mode != "aggregated"

    def queued(self) -> dict[EndpointId, int]:
        """This worker's own queued prefill tokens per endpoint (what the sibling workers are sent)."""
        return dict(self._queued)

    def plan(
        self,
        decision: Decision,
        now: float,
        subset: frozenset[str] | None = None,
        pinned: Sequence[str] | None = None,
        admit: Callable[[EndpointState], bool] | None = None,
    ) -> Verdict | None:
        """The verdict for a decided request; ``None`` when its model has no serving spec or an
        aggregated one (nothing to count). ``subset``: the request's EPP subset hint (``ip:port``
        addresses), which binds the prefill pick as it bound the decode pick (:meth:`Router.decide`):
        with no prefill endpoint inside it the request is served aggregated (``no_prefill``).

        ``pinned``: the conformance pin (``ip`` or ``ip:port`` entries), which bound the decode pick (the
        endpoint that serves the request and is reported as served). It binds the prefill pick only when
        it names some prefill endpoint of the model: then the prefill pick is one of those (none of them
        fit, e.g. of another protocol or outside the subset: ``no_prefill``); a pin naming only decode
        endpoints leaves the prefill pick to the prefill profile, so the pinned request is paired as an
        unpinned one would be.

        ``admit``: flow control's room test (the processor's, with the request's band): a prefill endpoint
        it refuses (saturated under the limits of its (model, ``prefill``) role) is not in the prefill
        pool; none left: ``no_prefill``."""
        route = self._policy.routes.get(decision.model)
        if route is None or route.spec.mode == "aggregated" or decision.served is None:
            return None
        decode = decision.served
        block_size = self._router.policy.block_size
        rest = decision.rest
        if rest is not None:
            # Where the lazy path stopped at the first unheld block, ``prompt_tokens`` is an estimate from
            # characters (a follow-up's new turn at its history's ratio). Whether to disaggregate turns on
            # the uncached count, so the window is counted exactly; the prefill pick records it anyway. The
            # ext_proc tokenizes a paired request's window whole where it prepares the request (Router.tokens
            # ``window``: in a worker thread for a large body), so this finds it done there and tokenizes
            # nothing on the event loop.
            rest.finish()
            decision.prompt_tokens = rest.cursor.estimate()  # exact unless the prompt outruns the window
        uncached = max(0, decision.prompt_tokens - decision.matched_blocks * block_size)
        protocol = PROTOCOLS.get(decode.endpoint.engine)
        # An SGLang decode server refuses a request without a bootstrap room (400): it cannot serve alone.
        paired_only = protocol == "sglang" and decode.endpoint.role == "decode"
        if not route.spec.disaggregates(uncached) and not paired_only:
            return Verdict(None, "cached")
        if protocol is None:
            return Verdict(None, "engine")
        picked = self._pick_prefill(decision, route, protocol, now, subset, pinned, admit)
        if picked is None:
            return Verdict(None, "no_prefill", alone=not paired_only)
        prefill, work, digests = picked
        self._queued[prefill.id] = self._queued.get(prefill.id, 0) + work
        prefill.in_flight += 1
        prefill.routed_since_scrape += 1
        prefill.count_routed(now)
        room = self._rng.randrange(MAX_ROOM + 1) if protocol == "sglang" else None
        handoff = Handoff(
            decision.request_id,
            prefill,
            decode,
            protocol,
            uncached,
            route.spec.prefill_timeout_s,
            room,
            prefill_tokens=work,
            digests=digests,
        )
        return Verdict(handoff, "disaggregated")

    def _pick_prefill(
        self,
        decision: Decision,
        route: PdRoute,
        protocol: str,
        now: float,
        subset: frozenset[str] | None,
        pinned: Sequence[str] | None = None,
        admit: Callable[[EndpointState], bool] | None = None,
    ) -> tuple[EndpointState, int, Sequence[Digest]] | None:
        """The prefill pick, the uncached prompt tokens it will compute and the prompt's digests
        (``None``: none fit)."""
        model = decision.model
        fleet: Iterable[EndpointState] = self._router.fleet
        if pinned is not None and any(
            s.endpoint.role == "prefill" and model in s.endpoint.models and is_pinned(s.address, pinned)
            for s in fleet
        ):
            fleet = [s for s in fleet if is_pinned(s.address, pinned)]
        pool = [
            s
            for s in fleet
            if s.endpoint.role == "prefill"
            and model in s.endpoint.models
            and set(route.labels) <= set(s.endpoint.labels)
            and PROTOCOLS.get(s.endpoint.engine) == protocol
            and (protocol != "sglang" or s.endpoint.bootstrap_port is not None)
            and (subset is None or s.endpoint.address in subset)
            and (admit is None or admit(s))
        ]
        if not pool:
            return None
        rest = decision.rest
        if rest is not None:  # the lazy path stopped early: the prefill endpoint records the whole window
            rest.finish()
        digests = list(rest.digests) if rest is not None else list(decision.digests)
        index = self._router.index
        match = index.match(digests, now)
        ids: set[EndpointId] = {s.id for s in pool}
        working_set = self._router.working_set
        state = CycleState(
            prefix_blocks={k: v for k, v in match.items() if k in ids},
            cached_blocks=index.occupancy() if working_set is None else working_set.sizes(now),
        )
        state.exact = all(index.is_precise(s.id) for s in pool)
        request = SchedulingRequest(
            request_id=decision.request_id,
            model=model,
            digests=digests,
            prompt_tokens=decision.prompt_tokens,
            now=now,
        )
        result = route.prefill.schedule(request, state, pool, self._rng)
        if not result.endpoints:
            return None
        block_size = self._router.policy.block_size
        prompt = decision.prompt_tokens

        def uncached(s: EndpointState) -> int:
            return max(0, prompt - state.prefix_blocks.get(s.id, 0) * block_size)

        pick = result.endpoints[0]
        if route.spec.prefill_profile is None:
            # Least prefill work (README.md, "The pair"): the tokens queued on the endpoint by this
            # host's running prefill sub-requests (this worker's and its siblings') plus what this
            # prompt lacks there, among the
            # endpoints the profile's filters kept (``scores``: every survivor, the pick's list cut at
            # the fallback limit); ties keep the profile's order.
            rank = {s.id: i for i, s in enumerate(result.endpoints)}
            fit = [s for s in pool if s.id in result.scores] or [pick]
            own, siblings = self._queued, self.sibling_queued
            pick = min(
                fit,
                key=lambda s: (
                    own.get(s.id, 0) + siblings.get(s.id, 0) + uncached(s),
                    rank.get(s.id, len(rank)),
                ),
            )
        return pick, uncached(pick), digests

    def prefilled(self, handoff: Handoff, now: float) -> None:
        """The prefill sub-request succeeded: its endpoint holds the prompt's blocks (index, working set,
        sibling workers, as :meth:`Router.record`). Only then: a failed prefill computed nothing the
        gateway used, and would leave the endpoint credited with the prefix."""
        self._router.record(handoff.prefill.id, handoff.digests, now)

    def release(self, handoff: Handoff) -> None:
        """The prefill sub-request ended (answered, failed or abandoned): its in-flight slot is free."""
        if not handoff.released:
            handoff.released = True
            handoff.prefill.in_flight = max(0, handoff.prefill.in_flight - 1)
            # It left the engine, as a completion does for a routed request (Router.completed): the
            # endpoint's load (flow control's in-flight limit) stops counting it before the next scrape.
            handoff.prefill.completed_since_scrape += 1
            left = self._queued.get(handoff.prefill.id, 0) - handoff.prefill_tokens
            if left > 0:
                self._queued[handoff.prefill.id] = left
            else:
                self._queued.pop(handoff.prefill.id, None)
            listener = self._router.listener
            if listener is not None:  # the sibling workers share in-flight counts
                listener.released(handoff.prefill.id)
