from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest

from contracts.digest import Digest
from contracts.errors import ConfigError
from contracts.events import EndpointId
from engines.endpoint import Endpoint
from extproc.errors import NotFound, Unavailable
from extproc.fleet import Fleet
from extproc.index.approximate import ApproximateIndex
from extproc.index.working_set import WorkingSet
from extproc.models.registry import ModelAssets, ModelRegistry
from extproc.routing.request import Kind, parse_body
from extproc.routing.router import Route, Router, RoutingPolicy
from extproc.scheduling.registry import DEFAULT_SCHEDULING, build_profile, parse_scheduling

MODEL = "m"


def router(
    model_dir: str,
    max_blocks: int = 2,
    *,
    working_set: WorkingSet | None = None,
    spread_only: bool = False,
    max_model_len: int | None = None,
) -> Router:
    assets = ModelAssets.load(MODEL, Path(model_dir), max_model_len=max_model_len)
    fleet = Fleet([Endpoint(EndpointId(f"e{i}"), f"127.0.0.{i}:1", frozenset({MODEL})) for i in range(3)])
    scheduling = DEFAULT_SCHEDULING
    if spread_only:
        scheduling = parse_scheduling(
            {
                "plugins": [{"type": "cache-spread"}, {"type": "max-score"}],
                "profiles": [{"name": "default", "plugins": [{"ref": "cache-spread"}, {"ref": "max-score"}]}],
            }
        )
    return Router(
        fleet,
        ModelRegistry([assets]),
        ApproximateIndex(),
        RoutingPolicy(build_profile(scheduling), block_size=16),
        max_blocks=max_blocks,
        rng=random.Random(0),
        working_set=working_set,
    )


def test_long_prompts_are_tokenized_only_as_far_as_digests_reach(model_dir: str) -> None:
    # A model whose context is longer than the prompt is in bytes: the context check needs no count
    # (tests/extproc/test_context_length.py covers prompts that may not fit).
    r = router(model_dir, max_model_len=32768)
    # Pieces are cut at special tokens, so a long chat has many (a long piece is cut into chunks).
    messages = [
        {"role": "user", "content": " ".join(f"turn {t} word{i}." for i in range(20))} for t in range(30)
    ]
    request = parse_body(Kind.CHAT, orjson.dumps({"model": MODEL, "messages": messages}))
    full = r.tokens(request, exact_count=True)
    # The window is held, so the lazy path must reach it (tests/extproc/routing/test_lazy_tokens.py
    # covers stopping at the first unheld block).
    r.index.record(EndpointId("e0"), r.digests(request, full), 0.0)
    windowed = r.tokens(request)
    assert len(windowed.ids) >= 32 and list(windowed.ids) == list(full.ids[: len(windowed.ids)])
    assert len(windowed.ids) < len(full.ids)
    assert abs(windowed.count - full.count) <= 0.2 * full.count  # the rest is estimated
    assert full.count == len(full.ids)
    assert r.digests(request, windowed) == r.digests(request, full)  # only 2 blocks are hashed either way


def test_commit_records_after_decide(model_dir: str) -> None:
    r = router(model_dir, max_blocks=256)
    request = parse_body(Kind.COMPLETION, orjson.dumps({"model": MODEL, "prompt": "hello " * 100}))
    decision = r.decide(request, request_id="x", now=0.0)
    assert r.index.occupancy() == {}  # nothing recorded until the reply is out
    r.commit(decision, 0.0)
    r.commit(decision, 0.0)
    pick = decision.endpoints[0]
    assert r.index.occupancy() == {pick.id: len(decision.digests)}
    assert pick.in_flight == 1
    r.finish(decision)
    r.finish(decision)
    assert pick.in_flight == 0


def test_decisions_count_recent_routing_and_exactness(model_dir: str) -> None:
    """decide counts the pick in its recent share (the balance filter's input), a fallback served by Envoy
    moves it; the cycle is exact only when every candidate's leads come from KV events."""
    from extproc.index.hybrid import HybridIndex
    from extproc.scheduling.interface import CycleState

    r = router(model_dir, max_blocks=256)
    request = parse_body(Kind.COMPLETION, orjson.dumps({"model": MODEL, "prompt": "hello " * 100}))
    decision = r.decide(request, request_id="x", now=10.0)
    pick = decision.endpoints[0]
    assert pick.recent_routed(10.0) == 1.0
    other = next(s for s in r.fleet if s.id != pick.id)
    r.served(decision, other.address, 10.0)
    assert pick.recent_routed(10.0) == 0.0 and other.recent_routed(10.0) == 1.0

    seen: list[bool] = []
    profile = r.policy.profile
    original = profile.schedule

    def spy(req: object, state: CycleState, *args: object) -> object:
        seen.append(state.exact)
        return original(req, state, *args)  # type: ignore[arg-type]

    profile.schedule = spy  # type: ignore[method-assign,assignment]
    r.decide(request, request_id="y", now=11.0)  # approximate index: never exact
    hybrid = HybridIndex()
    r.index = hybrid
    r.decide(request, request_id="z", now=12.0)  # hybrid, no endpoint event-fed
    for state in r.fleet:
        hybrid.set_precise(state.id, True)
    r.decide(request, request_id="w", now=13.0)
    assert seen == [False, False, True]


def test_cache_spread_reads_the_working_set_not_the_index(model_dir: str) -> None:
    """With a working set, ``cache-spread`` ranks endpoints by the blocks routed to them within its window,
    whatever the index's occupancy says; the router records each decision in both."""
    r = router(model_dir, max_blocks=256, working_set=WorkingSet(window_s=10.0), spread_only=True)
    assert r.working_set is not None
    e0, e1, e2 = (EndpointId(f"e{i}") for i in range(3))

    def digests(prompt: str) -> list[Digest]:
        parsed = parse_body(Kind.COMPLETION, orjson.dumps({"model": MODEL, "prompt": prompt}))
        return r.digests(parsed, r.tokens(parsed))

    old, recent = digests("old " * 300), digests("recent " * 50)
    for endpoint in (e1, e2):  # routed long ago: in the index (TTL 300 s), out of the 10 s window
        r.index.record(endpoint, old, 0.0)
        r.working_set.record(endpoint, old, 0.0)
    r.working_set.record(e0, recent, 15.0)  # routed lately (and absent from the index)
    assert r.index.occupancy() == {e1: len(old), e2: len(old)}
    request = parse_body(Kind.COMPLETION, orjson.dumps({"model": MODEL, "prompt": "new " * 100}))
    decision = r.decide(request, request_id="x", now=20.0)
    pick = decision.endpoints[0].id
    assert pick in (e1, e2)  # e0 holds the least, but it is the one asked to hold something now
    r.commit(decision, 20.0)
    assert r.working_set.sizes(20.0) == {e0: len(recent), pick: len(decision.digests)}
    assert r.index.occupancy()[pick] == len(old) + len(decision.digests)

    plain = router(model_dir, max_blocks=256, spread_only=True)  # no working set: the index occupancy
    for endpoint in (e1, e2):
        plain.index.record(endpoint, old, 0.0)
    assert plain.decide(request, request_id="x", now=20.0).endpoints[0].id == e0


def test_the_block_size_lives_in_the_routing_policy(model_dir: str) -> None:
    """Prompts are hashed in blocks of the policy's block size (no other copy: the models' assets carry
    none); :meth:`Router.apply` swaps profile, routes and block size as one value."""
    r = router(model_dir, max_blocks=256)
    request = parse_body(Kind.COMPLETION, orjson.dumps({"model": MODEL, "prompt": "hello " * 100}))
    tokens16 = r.tokens(request, exact_count=True)  # the whole prompt (the lazy path stops at block 0)
    assert tokens16.block_size == 16 and len(r.digests(request, tokens16)) == tokens16.count // 16
    profile = r.policy.profile
    r.apply(RoutingPolicy(profile, block_size=32))
    tokens32 = r.tokens(request, exact_count=True)
    assert tokens32.block_size == 32 and len(r.digests(request, tokens32)) == tokens32.count // 32
    assert r.policy.profile is profile and r.policy.routes == {}
    unknown = parse_body(Kind.COMPLETION, orjson.dumps({"model": "other", "prompt": "x" * 1000}))
    assert r.tokens(unknown).block_size == 32 * 4  # bytes standing in for tokens, 4 per token
    with pytest.raises(ConfigError, match="block_size"):
        RoutingPolicy(profile, block_size=0)


def declaring_router(model_dir: str) -> Router:
    """A fleet serving ``m`` (one endpoint with the LoRA adapter ``m-lora``, one draining, one unhealthy
    serving ``sick``), the config's ``[[models]]`` naming ``m`` and its alias ``m-alias`` (no endpoint),
    and a route declared for ``routed`` (no endpoint)."""
    assets = ModelAssets.load(MODEL, Path(model_dir))
    fleet = Fleet(
        [
            Endpoint(
                EndpointId("e0"), "127.0.0.1:1", frozenset({MODEL, "m-lora"}), adapters=frozenset({"m-lora"})
            ),
            Endpoint(EndpointId("e1"), "127.0.0.2:1", frozenset({MODEL, "draining"})),
            Endpoint(EndpointId("e2"), "127.0.0.3:1", frozenset({"sick"})),
        ]
    )
    fleet.set_state(EndpointId("e1"), draining=True)
    fleet.set_state(EndpointId("e2"), healthy=False)
    profile = build_profile(DEFAULT_SCHEDULING)
    return Router(
        fleet,
        ModelRegistry({MODEL: assets, "m-alias": assets}),
        ApproximateIndex(),
        RoutingPolicy(profile, routes={"routed": Route((), profile)}, block_size=16),
        rng=random.Random(0),
    )


@pytest.mark.parametrize(
    ("model", "known"),
    [
        (MODEL, True),  # served
        ("m-lora", True),  # a LoRA adapter an endpoint lists
        ("draining", True),  # only a draining endpoint declares it
        ("sick", True),  # only an unhealthy endpoint declares it
        ("m-alias", True),  # the config's [[models]] names it: no endpoint now (scale-from-zero)
        ("routed", True),  # a route (etcd models/<name>) is declared for it
        ("gpt-4", False),  # nothing declares it
        ("M", False),  # names are exact
    ],
)
def test_a_known_model_without_a_routable_endpoint_is_503_an_unknown_one_404(
    model_dir: str, model: str, known: bool
) -> None:
    r = declaring_router(model_dir)
    assert r.knows(model) is known
    request = parse_body(Kind.COMPLETION, orjson.dumps({"model": model, "prompt": "hello"}))
    if model in (MODEL, "m-lora"):
        assert r.decide(request, request_id="x", now=0.0).endpoints
        return
    with pytest.raises(Unavailable if known else NotFound) as caught:
        r.decide(request, request_id="x", now=0.0)
    assert caught.value.code == ("no_endpoint" if known else "model_not_found")
