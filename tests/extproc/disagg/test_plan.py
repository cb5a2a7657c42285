"""Pair selection in memory: a real Router over a real Fleet (roles both/prefill/decode), the byte
fallback for prompts (no tokenizer: 4 bytes stand for a token), the default scheduling profile."""

from __future__ import annotations

import random
import types
from collections.abc import Sequence
from pathlib import Path

import orjson
import pytest

from contracts.digest import Digest
from contracts.events import EndpointId
from engines.endpoint import Endpoint
from extproc.disagg.plan import Disaggregator, PdPolicy, PdRoute
from extproc.disagg.policy import PdSpec
from extproc.errors import Unavailable
from extproc.fleet import Fleet
from extproc.index.approximate import ApproximateIndex
from extproc.index.working_set import WorkingSet
from extproc.models.registry import ModelAssets, ModelRegistry
from extproc.routing.request import Kind, ParsedRequest, parse_body
from extproc.routing.router import Decision, Router, RoutingPolicy
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile

MODEL = "m"
NOW = 100.0


def endpoint(
    name: str,
    role: str,
    engine: str = "vllm",
    labels: dict[str, str] | None = None,
    bootstrap_port: int | None = None,
) -> Endpoint:
    n = sum(map(ord, name)) % 200
    return Endpoint(
        EndpointId(name),
        f"10.0.0.{n}:8000",
        frozenset({MODEL}),
        engine=engine,
        role=role,
        labels=tuple(sorted((labels or {}).items())),
        bootstrap_port=bootstrap_port,
    )


def make(
    endpoints: list[Endpoint], spec: PdSpec, labels: dict[str, str] | None = None
) -> tuple[Router, Disaggregator]:
    router = Router(
        Fleet(endpoints),
        ModelRegistry([]),
        ApproximateIndex(),
        RoutingPolicy(build_profile(DEFAULT_SCHEDULING), block_size=16),
        rng=random.Random(0),
    )
    route = PdRoute(spec, build_profile(DEFAULT_SCHEDULING), tuple(sorted((labels or {}).items())))
    return router, Disaggregator(router, PdPolicy(types.MappingProxyType({MODEL: route})), random.Random(0))


def request(prompt: str) -> ParsedRequest:
    return parse_body(Kind.COMPLETION, orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 8}))


def decide(router: Router, req: ParsedRequest, rid: str = "r") -> Decision:
    """As the processor decides a request whose model's serving spec may pair it (``paired``)."""
    return router.decide(req, request_id=rid, now=NOW, paired=True)


LONG = "".join(f"word{i} " for i in range(1000))  # ~7,000 bytes: ~1,700 tokens (inside the window)


def test_prefill_endpoints_are_never_picked_by_the_router() -> None:
    router, _ = make([endpoint("p0", "prefill"), endpoint("d0", "decode")], PdSpec("disaggregated"))
    for i in range(10):
        assert decide(router, request(f"hello {i}"), f"r{i}").served is not None
        assert decide(router, request(f"hello {i}"), f"s{i}").endpoints[0].id == "d0"
    only_prefill, _ = make([endpoint("p0", "prefill")], PdSpec("disaggregated"))
    with pytest.raises(Unavailable):
        decide(only_prefill, request("hello"))


def test_disaggregated_pairs_a_prefill_and_a_decode_endpoint() -> None:
    router, pd = make(
        [endpoint("p0", "prefill"), endpoint("d0", "decode"), endpoint("b0", "both")], PdSpec("disaggregated")
    )
    decision = decide(router, request("short"))
    verdict = pd.plan(decision, NOW)
    assert verdict is not None and verdict.mode == "disaggregated" and verdict.reason == "disaggregated"
    handoff = verdict.handoff
    assert handoff is not None
    assert handoff.prefill.id == "p0" and handoff.decode is decision.served
    assert handoff.protocol == "vllm" and handoff.timeout_s == 30.0
    assert handoff.prefill.in_flight == 1
    pd.release(handoff)
    pd.release(handoff)  # once only
    assert handoff.prefill.in_flight == 0


@pytest.mark.parametrize(
    ("prompt", "mode", "reason"),
    [
        ("short prompt", "aggregated", "cached"),  # 3 tokens < 512
        (LONG, "disaggregated", "disaggregated"),
    ],
)
def test_conditional_disaggregates_only_long_uncached_prompts(prompt: str, mode: str, reason: str) -> None:
    router, pd = make([endpoint("p0", "prefill"), endpoint("d0", "decode")], PdSpec("conditional", 512))
    verdict = pd.plan(decide(router, request(prompt)), NOW)
    assert verdict is not None and (verdict.mode, verdict.reason) == (mode, reason)


def test_conditional_counts_what_the_decode_pick_already_holds() -> None:
    router, pd = make([endpoint("p0", "prefill"), endpoint("d0", "decode")], PdSpec("conditional", 512))
    first = decide(router, request(LONG), "r1")
    router.commit(first, NOW)  # d0 now holds the prompt (speculatively)
    again = decide(router, request(LONG + " one more question"), "r2")
    assert again.matched_blocks * 16 >= again.prompt_tokens - 16
    verdict = pd.plan(again, NOW)
    assert verdict is not None and verdict.reason == "cached"


def test_a_repeated_long_prefix_goes_to_the_prefill_endpoint_that_holds_it() -> None:
    prefill = [endpoint(f"p{i}", "prefill") for i in range(4)]
    router, pd = make([*prefill, endpoint("d0", "decode"), endpoint("d1", "decode")], PdSpec("disaggregated"))
    picks = []
    for i in range(3):
        verdict = pd.plan(decide(router, request(LONG + f" question {i}"), f"r{i}"), NOW)
        assert verdict is not None and verdict.handoff is not None
        picks.append(verdict.handoff.prefill.id)
        pd.prefilled(verdict.handoff, NOW)  # its prefill succeeded
        pd.release(verdict.handoff)
    assert picks[1:] == [picks[0], picks[0]]
    cold = pd.plan(decide(router, request("another long document " * 400), "cold"), NOW)
    assert cold is not None and cold.handoff is not None
    assert cold.handoff.prefill.id != picks[0], "a cold prompt goes to a less loaded prefill endpoint"


def test_the_prefill_pick_weighs_the_prefill_work_queued_by_running_sub_requests() -> None:
    """The prefix holder computing a long prefill already: a repeat of its prefix costs more there
    (queued tokens + the uncached rest) than whole on an idle prefill endpoint; once that prefill ends,
    the repeat goes back to the holder."""
    prefill = [endpoint(f"p{i}", "prefill") for i in range(2)]
    router, pd = make([*prefill, endpoint("d0", "decode")], PdSpec("disaggregated"))
    first = pd.plan(decide(router, request(LONG + " question 0"), "r0"), NOW)
    assert first is not None and first.handoff is not None
    holder = first.handoff.prefill.id
    assert first.handoff.prefill_tokens >= 1_600  # cold: the whole prompt
    busy = pd.plan(decide(router, request(LONG + " question 1"), "r1"), NOW)
    assert busy is not None and busy.handoff is not None
    assert busy.handoff.prefill.id != holder, "the holder's queued prefill outweighs the prefix it saves"
    for done in (first.handoff, busy.handoff):  # both prefills succeeded
        pd.prefilled(done, NOW)
        pd.release(done)
    again = pd.plan(decide(router, request(LONG + " question 2"), "r2"), NOW)
    assert again is not None and again.handoff is not None
    assert again.handoff.prefill.id in {holder, busy.handoff.prefill.id}  # both hold it now
    assert again.handoff.prefill_tokens < 100, "the prefix is not computed again"


def test_the_least_work_pick_adds_the_sibling_workers_queued_prefill_work() -> None:
    """``sibling_queued`` (what the sibling workers of this host report, extproc/control/siblings.py)
    counts as this worker's own: an endpoint idle here but busy at a sibling is passed over."""
    prefill = [endpoint(f"p{i}", "prefill") for i in range(2)]
    router, pd = make([*prefill, endpoint("d0", "decode")], PdSpec("disaggregated"))
    alone = pd.plan(decide(router, request(LONG + " question 0"), "r0"), NOW)
    assert alone is not None and alone.handoff is not None
    idle_here = alone.handoff.prefill.id
    pd.release(alone.handoff)
    pd.sibling_queued = {idle_here: 10_000}  # a sibling's long prefills running there
    other = pd.plan(decide(router, request(LONG + " question 1"), "r1"), NOW)
    assert other is not None and other.handoff is not None
    assert other.handoff.prefill.id != idle_here, "the prefix it holds saves less than the sibling's work"
    assert pd.queued() == {other.handoff.prefill.id: other.handoff.prefill_tokens}  # own work only


def test_the_least_work_pick_never_takes_an_endpoint_the_filters_removed() -> None:
    """An unhealthy prefill endpoint has no queued work, but the profile's filters removed it: the busy
    healthy one is still the pick."""
    prefill = [endpoint(f"p{i}", "prefill") for i in range(2)]
    router, pd = make([*prefill, endpoint("d0", "decode")], PdSpec("disaggregated"))
    for state in router.fleet:
        if state.endpoint.id.endswith("p1"):
            state.healthy = False
    first = pd.plan(decide(router, request(LONG + " question 0"), "r0"), NOW)
    assert first is not None and first.handoff is not None
    busy = pd.plan(decide(router, request("a different long prompt " * 300), "r1"), NOW)
    assert busy is not None and busy.handoff is not None
    assert busy.handoff.prefill.id == first.handoff.prefill.id and busy.handoff.prefill.healthy


def test_no_prefill_endpoint_fits() -> None:
    router, pd = make(
        [endpoint("p0", "prefill", labels={"pool": "b"}), endpoint("d0", "decode", labels={"pool": "a"})],
        PdSpec("disaggregated"),
        labels={"pool": "a"},
    )
    verdict = pd.plan(decide(router, request("x")), NOW)
    assert verdict is not None and (verdict.mode, verdict.reason) == ("aggregated", "no_prefill")
    unhealthy, pd2 = make([endpoint("p0", "prefill"), endpoint("d0", "decode")], PdSpec("disaggregated"))
    for state in unhealthy.fleet:
        if state.endpoint.role == "prefill":
            state.healthy = False
    verdict = pd2.plan(decide(unhealthy, request("x")), NOW)
    assert verdict is not None and verdict.reason == "no_prefill"


@pytest.mark.parametrize("engine", ["llama_cpp", "trtllm", "openai_compat"])
def test_engines_without_a_handoff_protocol_are_served_aggregated(engine: str) -> None:
    router, pd = make(
        [endpoint("p0", "prefill", engine=engine), endpoint("d0", "decode", engine=engine)],
        PdSpec("disaggregated"),
    )
    verdict = pd.plan(decide(router, request("x")), NOW)
    assert verdict is not None and verdict.reason == "engine"


def test_models_without_a_disaggregating_route() -> None:
    router, pd = make([endpoint("p0", "prefill"), endpoint("d0", "both")], PdSpec("disaggregated"))
    pd.apply(PdPolicy())
    assert pd.plan(decide(router, request("x")), NOW) is None


def test_the_prefill_endpoint_speaks_the_decode_endpoints_protocol() -> None:
    router, pd = make(
        [endpoint("p0", "prefill", engine="sglang"), endpoint("d0", "decode")], PdSpec("disaggregated")
    )
    verdict = pd.plan(decide(router, request("x")), NOW)
    assert verdict is not None and verdict.reason == "no_prefill"
    router, pd = make(
        [endpoint("p0", "prefill", engine="sim"), endpoint("d0", "decode")], PdSpec("disaggregated")
    )
    verdict = pd.plan(decide(router, request("x")), NOW)
    assert verdict is not None and verdict.handoff is not None and verdict.handoff.prefill.id == "p0"


def test_sglang_pairs_need_a_bootstrap_port_and_get_a_room() -> None:
    router, pd = make(
        [
            endpoint("p0", "prefill", engine="sglang"),
            endpoint("p1", "prefill", engine="sglang", bootstrap_port=8998),
            endpoint("d0", "decode", engine="sglang"),
        ],
        PdSpec("disaggregated"),
    )
    rooms = set()
    for i in range(5):
        verdict = pd.plan(decide(router, request(f"x{i}"), f"r{i}"), NOW)
        assert verdict is not None and verdict.handoff is not None
        assert (verdict.handoff.prefill.id, verdict.handoff.protocol) == ("p1", "sglang")
        assert verdict.handoff.room is not None and 0 <= verdict.handoff.room < 2**63
        rooms.add(verdict.handoff.room)
        pd.release(verdict.handoff)
    assert len(rooms) == 5
    vllm, pd = make([endpoint("p0", "prefill"), endpoint("d0", "decode")], PdSpec("disaggregated"))
    verdict = pd.plan(decide(vllm, request("x")), NOW)
    assert verdict is not None and verdict.handoff is not None and verdict.handoff.room is None


def test_an_sglang_decode_server_is_always_paired_under_the_conditional_mode() -> None:
    """SGLang's decode servers refuse requests without a bootstrap room (400), so a short or cached
    request is paired too; an SGLang ``both`` server still serves it alone."""
    sglang = [
        endpoint("p0", "prefill", engine="sglang", bootstrap_port=8998),
        endpoint("d0", "decode", engine="sglang"),
    ]
    router, pd = make(sglang, PdSpec("conditional", 512))
    verdict = pd.plan(decide(router, request("short prompt")), NOW)
    assert verdict is not None and (verdict.mode, verdict.reason) == ("disaggregated", "disaggregated")
    router, pd = make([sglang[0], endpoint("b0", "both", engine="sglang")], PdSpec("conditional", 512))
    verdict = pd.plan(decide(router, request("short prompt")), NOW)
    assert verdict is not None and (verdict.mode, verdict.reason, verdict.alone) == (
        "aggregated",
        "cached",
        True,
    )
    router, pd = make([sglang[1]], PdSpec("conditional", 512))  # no prefill endpoint: it cannot serve
    verdict = pd.plan(decide(router, request("short prompt")), NOW)
    assert verdict is not None and (verdict.reason, verdict.alone) == ("no_prefill", False)


def test_the_prefill_pick_is_recorded_where_the_router_records_its_own() -> None:
    router, pd = make([endpoint("p0", "prefill"), endpoint("d0", "decode")], PdSpec("disaggregated"))
    router.working_set = WorkingSet(60.0, 256)
    heard: list[str] = []

    class Listener:
        def recorded(self, endpoint: EndpointId, digests: Sequence[Digest], now: float) -> None:
            heard.append(endpoint)

        def released(self, endpoint: EndpointId) -> None:
            heard.append(f"released {endpoint}")

    router.listener = Listener()
    verdict = pd.plan(decide(router, request(LONG)), NOW)
    assert verdict is not None and verdict.handoff is not None
    assert heard == [] and EndpointId("p0") not in router.working_set.sizes(NOW)  # not before it succeeded
    pd.prefilled(verdict.handoff, NOW)
    assert heard == ["p0"]  # siblings hear of it; the decode pick is recorded at commit
    assert router.working_set.sizes(NOW)[EndpointId("p0")] > 0
    pd.release(verdict.handoff)
    pd.release(verdict.handoff)
    assert heard == ["p0", "released p0"]


def test_the_subset_hint_binds_the_prefill_pick_too() -> None:
    """The EPP subset hint names the endpoints the request may go to: the prefill pick stays inside it as
    the decode pick does; with no prefill endpoint inside it the request is served aggregated."""
    endpoints = [endpoint("p0", "prefill"), endpoint("p1", "prefill"), endpoint("d0", "decode")]
    address = {e.id: e.address for e in endpoints}
    router, pd = make(endpoints, PdSpec("disaggregated"))
    for i in range(8):  # p0 would get some of these (the less loaded one) without the hint
        allowed = frozenset({address[EndpointId("p1")], address[EndpointId("d0")]})
        verdict = pd.plan(
            router.decide(request(f"q{i} {LONG}"), request_id=f"r{i}", now=NOW, subset=allowed), NOW, allowed
        )
        assert verdict is not None and verdict.handoff is not None
        assert verdict.handoff.prefill.id == "p1"
    decode_only = frozenset({address[EndpointId("d0")]})
    decision = router.decide(request(LONG), request_id="x", now=NOW, subset=decode_only)
    verdict = pd.plan(decision, NOW, decode_only)
    assert verdict is not None and (verdict.mode, verdict.reason, verdict.alone) == (
        "aggregated",
        "no_prefill",
        True,
    )
    assert pd.plan(decision, NOW) is not None  # no hint: any prefill endpoint may pair


def test_the_conformance_pin_binds_the_prefill_pick_when_it_names_one() -> None:
    """The pin (``test-epp-endpoint-selection``) binds the decode pick (the endpoint reported as served);
    it binds the prefill pick when it names a prefill endpoint of the model (``ip`` or ``ip:port``), and
    leaves it to the prefill profile when it names none."""
    endpoints = [
        endpoint("p0", "prefill"),
        endpoint("p1", "prefill"),
        endpoint("p2", "prefill", engine="sglang", bootstrap_port=8998),
        endpoint("d0", "decode"),
        endpoint("d1", "decode"),
    ]
    address = {e.id: e.address for e in endpoints}
    router, pd = make(endpoints, PdSpec("disaggregated"))

    def plan(pin: list[str], rid: str, subset: frozenset[str] | None = None) -> tuple[str, str | None]:
        decision = router.decide(request(f"{rid} {LONG}"), request_id=rid, now=NOW, subset=subset, pinned=pin)
        verdict = pd.plan(decision, NOW, subset, pin)
        assert verdict is not None and decision.served is not None
        if verdict.handoff is not None:
            verdict.handoff.prefill.in_flight = 0  # as if answered: the least loaded would alternate
            return decision.served.id, verdict.handoff.prefill.id
        assert verdict.reason == "no_prefill"
        return decision.served.id, None

    p1, d0 = address[EndpointId("p1")], address[EndpointId("d0")]
    assert {plan([p1, d0], f"a{i}") for i in range(6)} == {("d0", "p1")}
    host_only = p1.rpartition(":")[0]
    assert {plan([host_only, d0], f"b{i}") for i in range(6)} == {("d0", "p1")}
    # a pin naming no prefill endpoint: the decode pick is pinned, the prefill pick is the profile's (on a
    # fresh fleet, with the slots held, the least loaded alternates over the vLLM-protocol pool)
    fresh, free = make(endpoints, PdSpec("disaggregated"))
    picks = set()
    for i in range(6):
        decision = fresh.decide(request(f"c{i} {LONG}"), request_id=f"c{i}", now=NOW, pinned=[d0])
        verdict = free.plan(decision, NOW, None, [d0])
        assert decision.served is not None and decision.served.id == "d0"
        assert verdict is not None and verdict.handoff is not None
        picks.add(verdict.handoff.prefill.id)
    assert picks == {"p0", "p1"}
    # it names a prefill endpoint that cannot pair (another protocol; outside the subset): aggregated
    assert plan([address[EndpointId("p2")], d0], "d") == ("d0", None)
    assert plan([p1, d0], "e", subset=frozenset({d0, address[EndpointId("p0")]})) == ("d0", None)
    with pytest.raises(Unavailable):  # a pin naming only prefill endpoints leaves nothing to serve it
        router.decide(request(LONG), request_id="f", now=NOW, pinned=[p1])


def test_a_follow_ups_uncached_count_is_exact_when_the_lazy_path_stopped_early(model_dir: str) -> None:
    """A follow-up's decide stops tokenizing at its first unheld block, where ``prompt_tokens`` is only an
    estimate at the history's characters-per-token ratio; a new turn much denser in tokens (here ~5 tokens
    a word against ~1.3 in the history) is then underestimated several times over. The conditional
    verdict counts the window exactly first: the dense turn is disaggregated, with its exact uncached
    count."""
    assets = ModelAssets.load(MODEL, Path(model_dir), max_model_len=1 << 20)
    router = Router(
        Fleet([endpoint("p0", "prefill"), endpoint("d0", "decode")]),
        ModelRegistry([assets]),
        ApproximateIndex(),
        RoutingPolicy(build_profile(DEFAULT_SCHEDULING), block_size=16),
        max_blocks=256,
        rng=random.Random(0),
    )
    route = PdRoute(PdSpec("conditional", 256), build_profile(DEFAULT_SCHEDULING), ())
    pd = Disaggregator(router, PdPolicy(types.MappingProxyType({MODEL: route})), random.Random(0))
    history = "Disaggregated serving computes the prompt on one replica and decodes on another. " * 20

    def chat(*turns: str) -> ParsedRequest:
        messages = [{"role": "system", "content": history}, *({"role": "user", "content": t} for t in turns)]
        return parse_body(Kind.CHAT, orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 8}))

    first = decide(router, chat("hello"), "r1")
    router.commit(first, NOW)  # d0 holds the history (speculatively)
    dense = chat(" ".join(f"q2x{j}" for j in range(60)))
    follow = decide(router, dense, "r2")
    assert follow.rest is not None  # stopped in the dense turn: prompt_tokens is an estimate
    exact = len(router.tokens(dense, exact_count=True).ids)
    verdict = pd.plan(follow, NOW)
    assert verdict is not None and verdict.reason == "disaggregated"
    assert verdict.handoff is not None
    assert follow.prompt_tokens == exact
    assert verdict.handoff.uncached_tokens == exact - follow.matched_blocks * 16 >= 256
